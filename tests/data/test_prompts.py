"""drelay.data.prompts: training-prompt sources, the domain mix, deduplication and the prepare_data split."""

import dataclasses
import filecmp
import importlib.util
import random
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from drelay.config import DataConfig, DomainCounts, DomainMix, WriterConfig, load_params
from drelay.data.benchmarks import BENCHMARK_NAMES, MATH_SUFFIX, load_benchmark
from drelay.data.dedup import normalize, shingles
from drelay.io import DataNotFoundError, read_jsonl
from drelay.data.prompts import (Prompt, WrittenPrompts, _round_robin, _val_counts, load_train_prompts, mix_counts,
                                 prepare_prompts)

REPO = Path(__file__).resolve().parents[2]
SOURCE_COUNTS = {"gsm8k": 7473, "mbpp": 464, "self_instruct": 427, "codealpaca": 2017}
DEFAULT_SOURCES = ("gsm8k", "mbpp", "self_instruct")


@pytest.mark.parametrize("source", list(SOURCE_COUNTS))
def test_each_source_has_its_documented_count(mirror, source):
    prompts = load_train_prompts([source], mirror)
    assert len(prompts) == SOURCE_COUNTS[source]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.source == source and p.messages[0]["role"] == "user" and p.text.strip() for p in prompts)
    assert {p.domain for p in prompts} == {"gsm8k": {"math"}, "self_instruct": {"chat"}}.get(source, {"code"})


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
    return cfg, out, prepare_prompts(cfg, mirror, out, seed=3).metrics()


def test_prepare_writes_the_documented_files_and_schema(prepared):
    cfg, out, summary = prepared
    train, val = read_jsonl(out / "train.jsonl"), read_jsonl(out / "val.jsonl")
    for record in train + val:
        assert set(record) == {"id", "source", "messages", "domain"}
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
    assert summary["dropped.bench_exact"] >= 252 and summary["dropped.bench_near"] > 0
    alpaca = {s.turns[0] for s in load_benchmark("alpaca", mirror)}
    texts = {r["messages"][0]["content"] for name in ("train", "val") for r in read_jsonl(out / f"{name}.jsonl")}
    assert not texts & alpaca


def test_prepare_is_deterministic_for_a_seed(prepared, mirror, tmp_path):
    cfg, out, summary = prepared
    again = prepare_prompts(cfg, mirror, tmp_path / "again", seed=3).metrics()
    assert again == summary
    for name in ("train.jsonl", "val.jsonl", "benchmarks/alpaca.jsonl"):
        assert filecmp.cmp(out / name, tmp_path / "again" / name, shallow=False)
    other = prepare_prompts(cfg, mirror, tmp_path / "other", seed=4).metrics()
    assert read_jsonl(tmp_path / "other" / "val.jsonl") != read_jsonl(out / "val.jsonl")
    assert other["val.total"] == 40


def test_codealpaca_only_when_asked(prepared, mirror, tmp_path):
    _, out, summary = prepared
    assert "train.codealpaca" not in summary
    assert not any(r["source"] == "codealpaca" for r in read_jsonl(out / "train.jsonl"))
    cfg = DataConfig(train_sources=("mbpp", "codealpaca"), mix=DomainMix(math=0, code=1, chat=0),
                     max_train_prompts=0, val_prompts=10, max_prompt_chars=300)
    summary = prepare_prompts(cfg, mirror, tmp_path, seed=0).metrics()
    assert summary["loaded.codealpaca"] == 2017 and summary["val.codealpaca"] >= 1
    assert summary["dropped.too_long"] > 0
    train = read_jsonl(tmp_path / "train.jsonl")
    assert all(len(r["messages"][0]["content"]) <= 300 for r in train)
    kept = sum(summary[f"loaded.{s}"] for s in ("mbpp", "codealpaca")) - sum(
        summary[k] for k in summary if k.startswith("dropped.") and k != "dropped.degenerate")
    assert summary["train.total"] + summary["val.total"] == kept  # max_train_prompts=0: all


def test_prompt_round_trip():
    p = Prompt.user("gsm8k/0", "gsm8k", "hi")
    assert Prompt.from_dict(dataclasses.asdict(p)) == p and p.text == "hi" and p.domain == "math"
    written = Prompt.user("written/code/0", "written", "Write a sort.", "code")
    assert Prompt.from_dict(dataclasses.asdict(written)) == written
    old = {"id": "mbpp/600", "source": "mbpp", "messages": [{"role": "user", "content": "x"}]}  # before domains
    assert Prompt.from_dict(old).domain == "code"


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


# ---- the domain mix ------------------------------------------------------------------------------


def test_mix_counts_follow_the_shares_and_refill_a_short_domain():
    shares = {"math": 0.4, "code": 0.3, "chat": 0.3}
    plenty = {"math": 1000, "code": 1000, "chat": 1000}
    assert mix_counts(plenty, shares, 100) == {"math": 40, "code": 30, "chat": 30}
    assert mix_counts(plenty, shares, 7) == {"math": 3, "code": 2, "chat": 2}  # largest remainder
    # chat has 10: the other 20 of its quota go to math and code in their 4:3 ratio
    assert mix_counts({"math": 1000, "code": 1000, "chat": 10}, shares, 100) == {"math": 51, "code": 39, "chat": 10}
    assert mix_counts({"math": 5, "code": 5, "chat": 5}, shares, 100) == {"math": 5, "code": 5, "chat": 5}
    assert mix_counts(plenty, {"math": 0.5, "code": 0.5, "chat": 0.0}, 10) == {"math": 5, "code": 5, "chat": 0}


def test_round_robin_takes_each_source_in_turn():
    assert _round_robin([["a1", "a2", "a3", "a4"], ["b1"], []], 4) == ["a1", "b1", "a2", "a3"]
    assert _round_robin([["a1"], ["b1", "b2"]], 9) == ["a1", "b1", "b2"]


def _sentences(n: int, seed: int) -> list[str]:
    """`n` made-up requests of 12 random pseudo-words: no two alike, none like a benchmark turn."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3)) for _ in range(400)]
    return [" ".join(rng.sample(words, 12)).capitalize() + "?" for _ in range(n)]


def _written(texts: list[str], domain: str, unfinished: list[str] = ()) -> WrittenPrompts:
    make = lambda i, t: Prompt.user(f"written/{domain}/{i}", "written", t, domain)  # noqa: E731
    return WrittenPrompts(prompts=[make(i, t) for i, t in enumerate(texts)],
                          unfinished=[make(len(texts) + i, t) for i, t in enumerate(unfinished)],
                          requested={domain: len(texts) + len(unfinished)}, seconds=2.0, tokens=100)


def test_the_mix_shares_are_kept_and_a_domains_sources_take_turns(mirror, tmp_path):
    cfg = DataConfig(mix=DomainMix(math=0.5, code=0.2, chat=0.3), max_train_prompts=400, val_prompts=20,
                     writer=WriterConfig(prompts=DomainCounts(chat=200)))
    card = prepare_prompts(cfg, mirror, tmp_path, seed=1, write=lambda: _written(_sentences(200, 0), "chat"))
    train, val = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "val.jsonl")
    assert len(train) == 400 and len(val) == 20
    both = Counter(r["domain"] for r in train + val)
    assert both == {"math": 210, "code": 84, "chat": 126}  # exactly the shares of 420
    for domain, share in cfg.mix.shares().items():
        assert abs(sum(r["domain"] == domain for r in train) / 400 - share) <= 0.01
    chat_sources = Counter(r["source"] for r in train + val if r["domain"] == "chat")
    assert chat_sources == {"self_instruct": 63, "written": 63}  # in turn, while both last
    metrics = card.metrics()
    assert metrics["train.domain.chat"] + metrics["val.domain.chat"] == 126 and metrics["loaded.written"] == 200
    assert metrics["written.requested"] == 200 and metrics["written.tokens_per_s"] == 50.0
    assert "| written | mixed | written by the target | 200 |" in card.markdown()


def test_written_prompts_are_filtered_and_every_drop_is_counted(mirror, tmp_path):
    mt_bench = load_benchmark("mt_bench", mirror)
    alpaca = load_benchmark("alpaca", mirror)
    long_turn = next(s.turns[0] for s in mt_bench if len(s.turns[0].split()) >= 20)
    words = long_turn.split(" ")
    words[len(words) // 2] = "zebra"
    good = _sentences(3, 1)
    texts = [*good,
             "Why " + good[0].lower(),  # near-duplicate of an earlier written prompt
             good[1].upper(),  # exact (normalised) duplicate of one
             alpaca[5].turns[0].lower(),  # a benchmark turn, re-cased: bench_exact
             " ".join(words),  # one word changed: bench_near
             "and so on and so on " * 6,  # repetitive
             "12 + 34 = ?? ### $$$ 5678 !!",  # non_text
             "Help me.",  # too_short
             "x" * 2100]  # too_long
    cfg = DataConfig(max_train_prompts=50, val_prompts=5, writer=WriterConfig(prompts=DomainCounts(chat=12)))
    card = prepare_prompts(cfg, mirror, tmp_path, seed=0, write=lambda: _written(texts, "chat", ["Tell me about"]))
    written_drops = {reason: c["written"] for reason, c in card.dropped.items() if c["written"]}
    assert written_drops == {"near_duplicate": 1, "duplicate": 1, "bench_exact": 1, "bench_near": 1, "repetitive": 1,
                             "non_text": 1, "too_short": 1, "too_long": 1, "unfinished": 1}
    assert card.count("pool", "written") == 3 and card.metrics()["dropped.degenerate"] == 4
    assert any(ex["id"] == "written/chat/6" and ex["bench_id"].startswith("mt_bench/") for ex in card.near_duplicates)
    records = read_jsonl(tmp_path / "train.jsonl") + read_jsonl(tmp_path / "val.jsonl")
    kept = {r["messages"][0]["content"] for r in records}
    kept_written = kept & set(texts)  # one of each pair of duplicates: which one depends on the seeded order
    assert len(kept_written) == 3 and good[2] in kept_written
    assert len(kept_written & {good[0], texts[3]}) == 1 and len(kept_written & {good[1], texts[4]}) == 1
    text = card.markdown()
    assert "| bench_near |" in text and "## Near-duplicates of benchmark prompts" in text and good[2][:40] in text


def test_no_prepared_prompt_equals_or_nearly_equals_a_benchmark_prompt(mirror, tmp_path):
    """The default profile's prompt data (its sources, mix and thresholds; the target's own prompts are left to
    the pipeline test), checked against every benchmark turn by brute force, not through the index."""
    cfg = dataclasses.replace(load_params(REPO / "params.yaml").data, writer=WriterConfig())
    prepare_prompts(cfg, mirror, tmp_path, seed=0)
    records = read_jsonl(tmp_path / "train.jsonl") + read_jsonl(tmp_path / "val.jsonl")
    prompts = [r["messages"][0]["content"] for r in records]
    assert len(prompts) == cfg.max_train_prompts + cfg.val_prompts
    turns = [t for name in BENCHMARK_NAMES for s in load_benchmark(name, mirror) for t in s.turns]
    bench_exact = {normalize(t) for t in turns}
    bench = [shingles(normalize(t), cfg.shingle_words) for t in turns]
    t = cfg.near_dup_threshold
    for text in prompts:
        grams = shingles(normalize(text), cfg.shingle_words)
        assert normalize(text) not in bench_exact, text
        for b in bench:  # Jaccard <= min/max of the sizes: only pairs that pass it are computed
            if t * max(len(grams), len(b)) <= min(len(grams), len(b)) and not grams.isdisjoint(b):
                assert len(grams & b) / len(grams | b) < t, text
