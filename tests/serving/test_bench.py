"""The serving benchmark's pieces without SGLang (drelay/serving/bench.py): prompt files, the server and client
command lines, the client's result read back, speedups and the report. That SGLang itself accepts the
commands and loads the prompt file is tests/serving/test_serve_commands.py (in .venv-sglang)."""

from __future__ import annotations

import json

import pytest

from drelay.serving import bench


def test_prompt_file_has_a_user_and_an_assistant_turn_per_prompt(tmp_path):
    turns = ["What is 2+2?", "Write a haiku about rain.", "def f(x):\n    return x"]
    path = bench.write_prompt_file(tmp_path / "prompts" / "x.jsonl", turns)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["conversations"][0]["content"] for r in rows] == turns
    # SGLang's custom dataset drops rows without a second turn of >= 2 tokens
    assert all(r["conversations"][1]["role"] == "assistant" and len(r["conversations"][1]["content"].split()) >= 2
               for r in rows)


def test_server_command_per_configuration(tmp_path):
    none = bench.server_command("py", "models/target", 30001, bench.NONE, extra=["--attention-backend", "triton"])
    assert none[:3] == ["py", "-m", "sglang.launch_server"] and "--speculative-algorithm" not in none
    assert none[-2:] == ["--attention-backend", "triton"] and none[none.index("--port") + 1] == "30001"
    relay = bench.server_command("py", "models/target", 30001, "drelay", tmp_path / "d", 8)
    i = relay.index("--speculative-algorithm")
    assert relay[i:i + 6] == ["--speculative-algorithm", "DRELAY", "--speculative-draft-model-path",
                              str(tmp_path / "d"), "--speculative-num-draft-tokens", "8"]
    assert bench.server_command("py", "t", 1, "dflash", "d", 16)[i + 1] == "DFLASH"
    with pytest.raises(ValueError, match="dspark"):
        bench.server_command("py", "t", 1, "dspark", "d", 8)
    with pytest.raises(ValueError, match="draft folder"):
        bench.server_command("py", "t", 1, "drelay")


def test_client_command_is_greedy_fixed_length_and_writes_the_result_file():
    cmd = bench.client_command("py", 30001, "p.jsonl", 16, 8, 256, "out.jsonl", seed=3)
    rest = cmd[3:]  # after `py -m sglang.benchmark.serving`
    args = {flag: value for flag, value in zip(rest, rest[1:] + [""]) if flag.startswith("--")
            and not value.startswith("--")}
    assert cmd[:3] == ["py", "-m", "sglang.benchmark.serving"]
    assert {k: args[k] for k in ("--dataset-name", "--dataset-path", "--num-prompts", "--max-concurrency",
                                 "--temperature", "--sharegpt-output-len", "--output-file", "--seed")} == {
        "--dataset-name": "custom", "--dataset-path": "p.jsonl", "--num-prompts": "16", "--max-concurrency": "8",
        "--temperature": "0", "--sharegpt-output-len": "256", "--output-file": "out.jsonl", "--seed": "3"}
    assert "--apply-chat-template" in cmd and args["--base-url"] == "http://127.0.0.1:30001"


def _record(**numbers) -> str:
    base = {"backend": "sglang", "completed": 4, "output_throughput": 100.0, "mean_tpot_ms": 10.0,
            "median_tpot_ms": 9.5, "mean_ttft_ms": 30.0, "accept_length": 3.5, "total_output_tokens": 64,
            "duration": 0.64}
    return json.dumps({**base, **numbers}) + "\n"


def test_client_result_is_the_last_record_and_must_be_complete(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(_record(output_throughput=1.0) + _record(output_throughput=250.0))  # the client appends
    numbers = bench.read_client_result(path, expected=4)
    assert numbers["output_throughput"] == 250.0 and numbers["accept_length"] == 3.5
    assert set(numbers) == set(bench.RESULT_KEYS)
    with pytest.raises(bench.ClientResultError, match="3 of 4 requests completed"):
        path.write_text(_record(completed=3))
        bench.read_client_result(path, expected=4)
    for text in ("", "{not json\n"):
        path.write_text(text)
        with pytest.raises(bench.ClientResultError, match=str(path)):
            bench.read_client_result(path, expected=4)
    with pytest.raises(bench.ClientResultError, match="no benchmark result"):
        bench.read_client_result(tmp_path / "missing.jsonl", expected=4)


def test_speedups_are_over_no_speculation_at_the_same_benchmark_and_concurrency():
    def numbers(tps, accept=None):
        return {"output_throughput": tps, "mean_tpot_ms": 1000 / tps, "accept_length": accept}

    results = {"none": {"gsm8k": {1: numbers(50.0), 8: numbers(200.0)}, "mbpp": {1: numbers(40.0), 8: numbers(100.0)}},
               "drelay": {"gsm8k": {1: numbers(150.0, 4.0), 8: numbers(300.0, 4.0)},
                          "mbpp": {1: numbers(60.0, 2.0), 8: numbers(100.0, 2.0)}},
               "dspark": {"skipped": "not exported"}}
    out = bench.with_speedups(results)
    assert out["drelay"]["gsm8k"][1]["speedup"] == pytest.approx(3.0)
    assert out["drelay"]["mbpp"][8]["speedup"] == pytest.approx(1.0)
    assert out["drelay"]["mean"][1]["speedup"] == pytest.approx((3.0 + 1.5) / 2)
    assert out["drelay"]["mean"][8]["accept_length"] == pytest.approx(3.0)
    assert out["none"]["mean"][1]["speedup"] == pytest.approx(1.0) and out["dspark"] == {"skipped": "not exported"}
    report = bench.markdown({"results": json.loads(json.dumps(out))})  # as read back from metrics/serve.json
    assert "## Concurrency 1" in report and "## Concurrency 8" in report
    assert "| drelay | 150.0 · 3.00x · 4.00 | 60.0 · 1.50x · 2.00 | 105.0 · 2.25x · 3.00 |" in report
    assert "- dspark: not served: not exported" in report


def test_report_of_a_skip_says_why_and_what_was_written():
    report = bench.markdown({"skipped": "no CUDA", "reason": "torch sees no CUDA device",
                             "prompt_files": {"gsm8k": 16}})
    assert "Not measured: **no CUDA**. torch sees no CUDA device" in report and "gsm8k (16)" in report
    assert "tokens/s" not in report

