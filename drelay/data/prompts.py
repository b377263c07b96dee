"""Training prompts (the target answers them during distillation) and the prepare_data stage.

Sources, read from `<mirror>/` (see benchmarks/SOURCES.md), each prompt one user message:
- gsm8k: GSM8K train questions + the math suffix (7473). Hub: openai/gsm8k, main, train.
- mbpp: MBPP validation (task_id 511-600) and train (601-974) problems, formatted like the MBPP
  benchmark prompt (464; disjoint from the 11-510 test range). Hub: google-research-datasets/mbpp.
- self_instruct: the 175 seed tasks + 252 user-oriented instructions: the instruction, plus
  "\\n\\n" + the first instance's input when it has one (427). No hub copy.
  The 252 user-oriented instructions, formatted this way, ARE AlpacaEval's "selfinstruct"
  subset, i.e. 252 of the alpaca benchmark's 805 prompts; `prepare_prompts` drops training
  prompts that equal a benchmark turn (decontaminate=True) so they cannot leak into training.
- codealpaca: CodeAlpaca 2k: instruction + "\\n\\n" + input (2017). Its data licence is
  CC BY-NC 4.0 (non-commercial), so it is used only when listed in data.train_sources. No hub copy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from drelay.config import DataConfig, TRAIN_SOURCES
from drelay.data.benchmarks import BENCHMARK_NAMES, load_benchmark, math_prompt, mbpp_prompt
from drelay.io import HubSource, load_rows, write_jsonl

MBPP_TRAIN_IDS = range(511, 975)  # validation 511-600 + train 601-974


@dataclass(frozen=True)
class Prompt:
    """One training prompt as chat messages (a single user turn)."""

    id: str  # "<source>/<the source's own id, or the row index>"
    source: str  # one of TRAIN_SOURCES
    messages: tuple[dict, ...]  # ({"role": "user", "content": text},)

    @classmethod
    def user(cls, id: str, source: str, text: str) -> Prompt:
        return cls(id, source, ({"role": "user", "content": text},))

    @classmethod
    def from_dict(cls, d: dict) -> Prompt:
        """The inverse of `dataclasses.asdict` (what `write_jsonl` stores)."""
        return cls(d["id"], d["source"], tuple(dict(m) for m in d["messages"]))

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def _joined(instruction: str, input_text: str) -> str:
    return f"{instruction}\n\n{input_text}" if input_text else instruction


def _gsm8k(mirror: Path) -> list[Prompt]:
    rows = load_rows(mirror / "train_prompts/gsm8k/train.jsonl", HubSource("openai/gsm8k", "main", "train"))
    return [Prompt.user(f"gsm8k/{i}", "gsm8k", math_prompt(r["question"])) for i, r in enumerate(rows)]


def _mbpp(mirror: Path) -> list[Prompt]:
    hub = HubSource("google-research-datasets/mbpp", "full", "validation+train")  # file order: by task_id
    rows = load_rows(mirror / "benchmarks/mbpp/mbpp.jsonl", hub)
    return [Prompt.user(f"mbpp/{r['task_id']}", "mbpp", mbpp_prompt(r["text"]))
            for r in rows if r["task_id"] in MBPP_TRAIN_IDS]


def _self_instruct(mirror: Path) -> list[Prompt]:
    prompts = []
    for name in ("seed_tasks.jsonl", "user_oriented_instructions.jsonl"):
        for r in load_rows(mirror / "train_prompts/self_instruct" / name, hub=None):
            text = _joined(r["instruction"], r["instances"][0]["input"] if r["instances"] else "")
            prompts.append(Prompt.user(f"self_instruct/{r['id']}", "self_instruct", text))
    return prompts


def _codealpaca(mirror: Path) -> list[Prompt]:
    rows = load_rows(mirror / "train_prompts/codealpaca/code_alpaca_2k.json", hub=None)
    return [Prompt.user(f"codealpaca/{i}", "codealpaca", _joined(r["instruction"], r.get("input") or ""))
            for i, r in enumerate(rows)]


_LOADERS = {"gsm8k": _gsm8k, "mbpp": _mbpp, "self_instruct": _self_instruct, "codealpaca": _codealpaca}
assert tuple(_LOADERS) == TRAIN_SOURCES


def load_train_prompts(sources: tuple[str, ...] | list[str], mirror: str | Path) -> list[Prompt]:
    """The prompts of each source, sources in the given order, each in its file's order."""
    for source in sources:
        if source not in _LOADERS:
            raise ValueError(f"unknown training source {source!r}; valid: {', '.join(TRAIN_SOURCES)}")
    return [p for source in sources for p in _LOADERS[source](Path(mirror))]


# ---- prepare_data ----------------------------------------------------------------------------


def _val_counts(sizes: dict[str, int], n: int) -> dict[str, int]:
    """How many of `n` validation prompts each source gives: one each when n allows, the rest in
    proportion to what is left (largest remainder), so small sources are not left out."""
    base = {s: int(n >= len(sizes) and size > 0) for s, size in sizes.items()}
    left = {s: sizes[s] - base[s] for s in sizes}
    rest, total = n - sum(base.values()), sum(left.values())
    quota = {s: rest * left[s] / total if total else 0.0 for s in sizes}
    counts = {s: base[s] + int(quota[s]) for s in sizes}
    by_remainder = sorted(sizes, key=lambda s: (int(quota[s]) - quota[s], list(sizes).index(s)))
    for s in by_remainder[: n - sum(counts.values())]:
        counts[s] += 1
    return counts


def prepare_prompts(cfg: DataConfig, mirror: str | Path, out_dir: str | Path, seed: int,
                    decontaminate: bool = True) -> dict[str, int]:
    """Write out_dir/train.jsonl, out_dir/val.jsonl and out_dir/benchmarks/<name>.jsonl.

    Training prompts: the configured sources, minus prompts over cfg.max_prompt_chars, minus
    duplicate texts, minus (decontaminate) any text equal to a benchmark turn; shuffled with
    `random.Random(seed)`; cfg.val_prompts held out, stratified by source; the rest capped at
    cfg.max_train_prompts (0 = all). Benchmarks: all eight, full sets.
    Returns flat counts for logging: loaded.<source>, dropped.<reason>, train.<source>,
    train.total, val.<source>, val.total, bench.<name>.
    """
    out_dir = Path(out_dir)
    benchmarks = {name: load_benchmark(name, mirror) for name in BENCHMARK_NAMES}
    bench_texts = {turn for samples in benchmarks.values() for s in samples for turn in s.turns}
    loaded = load_train_prompts(cfg.train_sources, mirror)

    kept, seen = [], set()
    dropped = {"too_long": 0, "duplicate": 0, "bench_overlap": 0}
    for p in loaded:
        if len(p.text) > cfg.max_prompt_chars:
            dropped["too_long"] += 1
        elif p.text in seen:
            dropped["duplicate"] += 1
        elif decontaminate and p.text in bench_texts:
            dropped["bench_overlap"] += 1
        else:
            seen.add(p.text)
            kept.append(p)
    if cfg.val_prompts >= len(kept):
        raise ValueError(f"data.val_prompts={cfg.val_prompts} leaves no training prompts ({len(kept)} kept)")

    random.Random(seed).shuffle(kept)
    sizes = {s: sum(p.source == s for p in kept) for s in cfg.train_sources}
    want = _val_counts(sizes, cfg.val_prompts)
    val_ids = set()
    for p in kept:  # the first want[s] of each source in shuffled order
        if want[p.source] > 0:
            want[p.source] -= 1
            val_ids.add(p.id)
    val = [p for p in kept if p.id in val_ids]
    train = [p for p in kept if p.id not in val_ids]
    if cfg.max_train_prompts:
        train = train[: cfg.max_train_prompts]

    write_jsonl(train, out_dir / "train.jsonl")
    write_jsonl(val, out_dir / "val.jsonl")
    for name, samples in benchmarks.items():
        write_jsonl(samples, out_dir / "benchmarks" / f"{name}.jsonl")

    summary = {f"loaded.{s}": sum(p.source == s for p in loaded) for s in cfg.train_sources}
    summary |= {f"dropped.{reason}": n for reason, n in dropped.items()}
    for split, prompts in (("train", train), ("val", val)):
        summary |= {f"{split}.{s}": sum(p.source == s for p in prompts) for s in cfg.train_sources}
        summary[f"{split}.total"] = len(prompts)
    summary |= {f"bench.{name}": len(samples) for name, samples in benchmarks.items()}
    return summary
