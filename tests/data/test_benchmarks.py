"""drelay.data.benchmarks: the eight sets from the offline mirror, their counts and prompt formats."""

import dataclasses
import gzip
import importlib.util
import json
import shutil
import sys
import types

import pytest

from drelay.data.benchmarks import BENCHMARK_NAMES, BenchmarkSample, HF_IDS, MATH_SUFFIX, conversation, load_benchmark
from drelay.io import DataFormatError, DataNotFoundError, read_jsonl, write_jsonl

COUNTS = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30,
          "humaneval": 164, "mbpp": 257, "mt_bench": 80, "alpaca": 805}
MATH_SETS = ("gsm8k", "math500", "aime24", "aime25")


@pytest.fixture(scope="module")
def loaded(mirror):
    return {name: load_benchmark(name, mirror) for name in BENCHMARK_NAMES}


def test_names_and_hub_ids_cover_the_eight_sets():
    assert BENCHMARK_NAMES == tuple(COUNTS)
    assert set(HF_IDS) == set(BENCHMARK_NAMES)


@pytest.mark.parametrize("name", BENCHMARK_NAMES)
def test_each_set_has_its_documented_count_and_unique_ids(loaded, name):
    samples = loaded[name]
    assert len(samples) == COUNTS[name]
    assert len({s.id for s in samples}) == len(samples)
    assert all(s.benchmark == name and s.id.startswith(f"{name}/") for s in samples)
    assert all(isinstance(t, str) and t.strip() for s in samples for t in s.turns)


def test_math_suffix_only_on_math_sets(loaded):
    for name, samples in loaded.items():
        with_suffix = [s.turns[0].endswith(MATH_SUFFIX) for s in samples]
        assert all(with_suffix) if name in MATH_SETS else not any(with_suffix), name
    assert MATH_SUFFIX == "\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_math_references_are_final_answers(loaded):
    assert loaded["gsm8k"][0].reference == "18"  # Janet's ducks: "... #### 18"
    assert loaded["aime25"][0].reference == "70"
    assert loaded["gsm8k"][0].turns[0].startswith("Janet")


def test_only_mt_bench_has_two_turns(loaded):
    for name, samples in loaded.items():
        assert {len(s.turns) for s in samples} == ({2} if name == "mt_bench" else {1}), name


def test_conversation_puts_the_models_own_answer_between_the_turns(loaded):
    sample = loaded["mt_bench"][0]
    first = conversation(sample, [])
    assert first == [{"role": "user", "content": sample.turns[0]}]
    second = conversation(sample, ["my own answer"])
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "my own answer" and second[2]["content"] == sample.turns[1]
    with pytest.raises(ValueError, match="2 turn"):
        conversation(sample, ["a", "b"])


def test_mbpp_is_the_sanitized_test_range(loaded):
    task_ids = [int(s.id.split("/")[1]) for s in loaded["mbpp"]]
    assert all(11 <= t <= 510 for t in task_ids)
    assert task_ids == sorted(task_ids)
    assert loaded["mbpp"][0].id == "mbpp/11" and loaded["mbpp"][0].reference.lstrip().startswith("def")


def test_humaneval_prompt_holds_the_function_stub(loaded):
    first = loaded["humaneval"][0]
    assert first.id == "humaneval/0"
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first.turns[0]
    assert first.turns[0].startswith("Write a solution") and "```python\n" in first.turns[0]


def test_limit_keeps_file_order(mirror, loaded):
    assert load_benchmark("gsm8k", mirror, limit=0) == []
    assert load_benchmark("gsm8k", mirror, limit=5) == loaded["gsm8k"][:5]
    assert load_benchmark("mbpp", mirror, limit=3) == loaded["mbpp"][:3]


def test_unknown_name_lists_the_valid_ones(mirror):
    with pytest.raises(ValueError, match="gsm8k, math500, .*alpaca"):
        load_benchmark("gsm9k", mirror)


def test_missing_mirror_file_names_the_path_and_the_hub_id(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # as if no `datasets`
    with pytest.raises(DataNotFoundError) as err:
        load_benchmark("math500", tmp_path)
    message = str(err.value)
    assert str(tmp_path / "benchmarks" / "math500" / "test.jsonl") in message
    assert "HuggingFaceH4/MATH-500" in message and "data.mirror" in message
    assert isinstance(err.value, FileNotFoundError)


@pytest.fixture
def fake_hub(monkeypatch):
    """A stand-in `datasets` module: records each load_dataset call and returns the rows given."""
    calls, rows = [], {}

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if path not in rows:
            raise ConnectionError("offline")
        return rows[path]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    return calls, rows


def test_hub_fallback_maps_rows_to_the_same_record(tmp_path, fake_hub):
    calls, rows = fake_hub
    rows["HuggingFaceH4/mt_bench_prompts"] = [
        {"prompt_id": 81, "category": "writing", "prompt": ["Q1", "Q2"], "reference": []}]
    rows["tatsu-lab/alpaca"] = [{"instruction": "Sort.", "input": "3 1 2", "output": "1 2 3"}]
    [mt] = load_benchmark("mt_bench", tmp_path)
    assert mt == BenchmarkSample("mt_bench/81", "mt_bench", ("Q1", "Q2"), None)
    with pytest.warns(UserWarning, match="AlpacaEval"):
        [alpaca] = load_benchmark("alpaca", tmp_path)
    assert alpaca.turns == ("Sort.\n\nInput:\n3 1 2",)
    with pytest.raises(DataNotFoundError, match=r"test\.jsonl.*openai/gsm8k.*offline"):
        load_benchmark("gsm8k", tmp_path)
    assert calls == [("HuggingFaceH4/mt_bench_prompts", None, "train"), ("tatsu-lab/alpaca", None, "train"),
                     ("openai/gsm8k", "main", "test")]


def test_corrupt_line_names_the_file_and_line(tmp_path, mirror):
    path = tmp_path / "benchmarks" / "gsm8k" / "test.jsonl"
    path.parent.mkdir(parents=True)
    lines = (mirror / "benchmarks" / "gsm8k" / "test.jsonl").read_text().splitlines()[:4]
    lines[2] = lines[2][:-5]  # cut off the closing brace
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}: line 3"):
        load_benchmark("gsm8k", tmp_path)


def test_corrupt_gzip_line_and_json_array_name_file_and_line(tmp_path, mirror):
    gz = tmp_path / "benchmarks" / "humaneval" / "HumanEval.jsonl.gz"
    gz.parent.mkdir(parents=True)
    with gzip.open(gz, "wt") as f:
        f.write('{"task_id": "HumanEval/0"}\nnot json\n')
    with pytest.raises(DataFormatError, match=rf"{gz}: line 2"):
        load_benchmark("humaneval", tmp_path)
    arr = tmp_path / "benchmarks" / "mbpp" / "sanitized-mbpp.json"
    arr.parent.mkdir(parents=True)
    arr.write_text('[\n{"task_id": 11},\n{"task_id": \n')
    with pytest.raises(DataFormatError, match=rf"{arr}: line \d+"):
        load_benchmark("mbpp", tmp_path)


def test_record_with_missing_field_names_the_file_and_record(tmp_path, mirror):
    dst = tmp_path / "benchmarks" / "math500" / "test.jsonl"
    dst.parent.mkdir(parents=True)
    shutil.copy(mirror / "benchmarks" / "math500" / "test.jsonl", dst)
    with dst.open("a") as f:
        f.write(json.dumps({"question": "no problem field"}) + "\n")
    with pytest.raises(DataFormatError, match=rf"{dst}: record 501"):
        load_benchmark("math500", tmp_path)


def test_jsonl_round_trip_is_atomic_and_creates_parents(tmp_path, loaded):
    samples = loaded["mt_bench"][:3]
    path = write_jsonl(samples, tmp_path / "a" / "b" / "mt.jsonl")
    assert [BenchmarkSample.from_dict(d) for d in read_jsonl(path)] == samples
    assert read_jsonl(path)[0] == json.loads(json.dumps(dataclasses.asdict(samples[0])))
    assert sorted(p.name for p in path.parent.iterdir()) == ["mt.jsonl"]  # no temp file left

    def broken():
        yield samples[0]
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_jsonl(broken(), path)
    assert [BenchmarkSample.from_dict(d) for d in read_jsonl(path)] == samples  # old file intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["mt.jsonl"]


def test_prepared_copies_read_back_as_the_same_samples(loaded, tmp_path):
    """evaluate reads prepare_data's JSONL copies: the same samples, in the same order, first `limit` of them."""
    from drelay.data.benchmarks import load_prepared_benchmark
    from drelay.io import write_jsonl

    for name in ("mt_bench", "humaneval"):
        write_jsonl(loaded[name], tmp_path / f"{name}.jsonl")
        assert load_prepared_benchmark(tmp_path, name) == loaded[name]
        assert load_prepared_benchmark(tmp_path, name, 3) == loaded[name][:3]
    with pytest.raises(FileNotFoundError, match="gsm8k.jsonl is missing \\(the prepare_data stage writes it\\)"):
        load_prepared_benchmark(tmp_path, "gsm8k")
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        load_prepared_benchmark(tmp_path, "nope")
