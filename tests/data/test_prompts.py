"""drelay.training.prompts: training-prompt sources and the prepare_data split."""

import dataclasses
import filecmp
import importlib.util
import sys
import types

import pytest

from drelay.config import DataConfig
from drelay.data.benchmarks import BENCHMARK_NAMES, MATH_SUFFIX, load_benchmark
from drelay.io import DataNotFoundError, read_jsonl
from drelay.data.prompts import Prompt, _val_counts, load_train_prompts, prepare_prompts

SOURCE_COUNTS = {"gsm8k": 7473, "mbpp": 464, "self_instruct": 427, "codealpaca": 2017}
DEFAULT_SOURCES = ("gsm8k", "mbpp", "self_instruct")


@pytest.mark.parametrize("source", list(SOURCE_COUNTS))
def test_each_source_has_its_documented_count(mirror, source):
    prompts = load_train_prompts([source], mirror)
    assert len(prompts) == SOURCE_COUNTS[source]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.source == source and p.messages[0]["role"] == "user" and p.text.strip() for p in prompts)


def test_source_formats(mirror):
    by_source = {s: load_train_prompts([s], mirror) for s in SOURCE_COUNTS}
    assert all(p.text.endswith(MATH_SUFFIX) for p in by_source["gsm8k"])
    assert not any(p.text.endswith(MATH_SUFFIX) for s in ("mbpp", "self_instruct") for p in by_source[s])
    mbpp_ids = [int(p.id.split("/")[1]) for p in by_source["mbpp"]]
    assert min(mbpp_ids) == 511 and max(mbpp_ids) == 974  # never the 11-510 test range
    with_input = [p for p in by_source["self_instruct"] if "\n\n" in p.text]
    assert with_input and by_source["self_instruct"][0].id == "self_instruct/seed_task_0"


def test_unknown_source_and_missing_file_without_hub(tmp_path, mirror):
    with pytest.raises(ValueError, match="gsm8k, mbpp, self_instruct, codealpaca"):
        load_train_prompts(["alpaca"], mirror)
    with pytest.raises(DataNotFoundError, match=r"seed_tasks\.jsonl.*no hub copy"):
        load_train_prompts(["self_instruct"], tmp_path)


def test_val_counts_cover_every_source_and_sum_to_n():
    counts = _val_counts({"a": 7000, "b": 400, "c": 170}, 64)
    assert sum(counts.values()) == 64 and min(counts.values()) >= 1
    assert counts["a"] > counts["b"] > counts["c"]
    assert _val_counts({"a": 5, "b": 0}, 3) == {"a": 3, "b": 0}
    assert sum(_val_counts({"a": 10, "b": 10, "c": 10}, 2).values()) == 2


@pytest.fixture(scope="module")
def prepared(mirror, tmp_path_factory):
    cfg = DataConfig(train_sources=DEFAULT_SOURCES, max_train_prompts=500, val_prompts=40)
    out = tmp_path_factory.mktemp("prepared")
    return cfg, out, prepare_prompts(cfg, mirror, out, seed=3)


def test_prepare_writes_the_documented_files_and_schema(prepared):
    cfg, out, summary = prepared
    train, val = read_jsonl(out / "train.jsonl"), read_jsonl(out / "val.jsonl")
    for record in train + val:
        assert set(record) == {"id", "source", "messages"}
        assert record["messages"] == [{"role": "user", "content": record["messages"][0]["content"]}]
    assert len(train) == summary["train.total"] == 500
    assert len(val) == summary["val.total"] == 40
    assert {r["source"] for r in val} == set(DEFAULT_SOURCES)  # stratified: every source held out
    assert sum(summary[f"val.{s}"] for s in DEFAULT_SOURCES) == 40
    bench_files = sorted(p.name for p in (out / "benchmarks").iterdir())
    assert bench_files == sorted(f"{name}.jsonl" for name in BENCHMARK_NAMES)
    mt = read_jsonl(out / "benchmarks" / "mt_bench.jsonl")
    assert set(mt[0]) == {"id", "benchmark", "turns", "reference"} and len(mt[0]["turns"]) == 2
    assert summary["bench.mbpp"] == 257 and summary["bench.alpaca"] == 805 and summary["bench.gsm8k"] == 1319


def test_train_and_val_do_not_overlap_or_repeat(prepared):
    _, out, _ = prepared
    train, val = read_jsonl(out / "train.jsonl"), read_jsonl(out / "val.jsonl")
    texts = [r["messages"][0]["content"] for r in train + val]
    assert len(set(texts)) == len(texts)
    assert not {r["id"] for r in train} & {r["id"] for r in val}


def test_benchmark_prompts_are_kept_out_of_training(prepared, mirror):
    cfg, out, summary = prepared
    # the 252 user-oriented self-instruct prompts are AlpacaEval's "selfinstruct" subset
    assert summary["dropped.bench_overlap"] >= 252
    alpaca = {s.turns[0] for s in load_benchmark("alpaca", mirror)}
    texts = {r["messages"][0]["content"] for name in ("train", "val") for r in read_jsonl(out / f"{name}.jsonl")}
    assert not texts & alpaca


def test_prepare_is_deterministic_for_a_seed(prepared, mirror, tmp_path):
    cfg, out, summary = prepared
    again = prepare_prompts(cfg, mirror, tmp_path / "again", seed=3)
    assert again == summary
    for name in ("train.jsonl", "val.jsonl", "benchmarks/alpaca.jsonl"):
        assert filecmp.cmp(out / name, tmp_path / "again" / name, shallow=False)
    other = prepare_prompts(cfg, mirror, tmp_path / "other", seed=4)
    assert read_jsonl(tmp_path / "other" / "val.jsonl") != read_jsonl(out / "val.jsonl")
    assert other["val.total"] == 40


def test_codealpaca_only_when_asked(prepared, mirror, tmp_path):
    _, out, summary = prepared
    assert "train.codealpaca" not in summary
    assert not any(r["source"] == "codealpaca" for r in read_jsonl(out / "train.jsonl"))
    cfg = DataConfig(train_sources=("mbpp", "codealpaca"), max_train_prompts=0, val_prompts=10,
                     max_prompt_chars=300)
    summary = prepare_prompts(cfg, mirror, tmp_path, seed=0)
    assert summary["loaded.codealpaca"] == 2017 and summary["val.codealpaca"] >= 1
    assert summary["dropped.too_long"] > 0
    train = read_jsonl(tmp_path / "train.jsonl")
    assert all(len(r["messages"][0]["content"]) <= 300 for r in train)
    kept = sum(summary[f"loaded.{s}"] for s in ("mbpp", "codealpaca")) - sum(
        summary[k] for k in summary if k.startswith("dropped."))
    assert summary["train.total"] + summary["val.total"] == kept  # max_train_prompts=0: all


def test_prompt_round_trip():
    p = Prompt.user("gsm8k/0", "gsm8k", "hi")
    assert Prompt.from_dict(dataclasses.asdict(p)) == p and p.text == "hi"


def test_hub_fallback_uses_the_train_splits(tmp_path, monkeypatch):
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if path == "openai/gsm8k":
            return [{"question": "2+2?", "answer": "#### 4"}]
        return [{"task_id": 600, "text": "Write f.", "code": "", "test_list": []},
                {"task_id": 42, "text": "A test problem.", "code": "", "test_list": []}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    prompts = load_train_prompts(["gsm8k", "mbpp"], tmp_path)
    assert [p.id for p in prompts] == ["gsm8k/0", "mbpp/600"]  # task 42 is in the test range
    assert prompts[0].text == "2+2?" + MATH_SUFFIX
    assert calls == [("openai/gsm8k", "main", "train"),
                     ("google-research-datasets/mbpp", "full", "validation+train")]
