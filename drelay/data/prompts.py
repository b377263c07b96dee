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
- written: requests the target writes itself (drelay/training/write_prompts.py, data.writer), passed in.

Each prompt has a domain (math, code, chat: SOURCE_DOMAINS, or the domain a written one was asked for).
`prepare_prompts` drops what is too long, degenerate (written prompts only), an exact or near duplicate
of any benchmark turn, or of a training prompt kept before it (drelay/data/dedup.py); then draws the
domains in the shares of data.mix, each domain's sources in turn, and holds out a validation split.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from drelay.config import DOMAINS, SOURCE_DOMAINS, TRAIN_SOURCES, WRITTEN_SOURCE, DataConfig
from drelay.data.benchmarks import BENCHMARK_NAMES, load_benchmark, math_prompt, mbpp_prompt
from drelay.data.datacard import DataCard
from drelay.data.dedup import ShingleIndex, degenerate_reason
from drelay.io import HubSource, load_rows, write_jsonl

MBPP_TRAIN_IDS = range(511, 975)  # validation 511-600 + train 601-974


@dataclass(frozen=True)
class Prompt:
    """One training prompt as chat messages (a single user turn)."""

    id: str  # "<source>/<the source's own id, or the row index>"
    source: str  # one of TRAIN_SOURCES, or WRITTEN_SOURCE
    messages: tuple[dict, ...]  # ({"role": "user", "content": text},)
    domain: str = ""  # one of DOMAINS: the source's (SOURCE_DOMAINS), or the one a written prompt was asked for

    @classmethod
    def user(cls, id: str, source: str, text: str, domain: str | None = None) -> Prompt:
        return cls(id, source, ({"role": "user", "content": text},), domain or SOURCE_DOMAINS[source])

    @classmethod
    def from_dict(cls, d: dict) -> Prompt:
        """The inverse of `dataclasses.asdict` (what `write_jsonl` stores)."""
        domain = d.get("domain") or SOURCE_DOMAINS.get(d["source"], "")
        return cls(d["id"], d["source"], tuple(dict(m) for m in d["messages"]), domain)

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


@dataclass
class WrittenPrompts:
    """What the target wrote (drelay.training.write_prompts): finished requests, the ones cut at the token
    budget (dropped as "unfinished"), what was asked per domain, and the cost."""

    prompts: list[Prompt] = field(default_factory=list)
    unfinished: list[Prompt] = field(default_factory=list)
    requested: dict[str, int] = field(default_factory=dict)  # domain -> requests asked
    seconds: float = 0.0
    tokens: int = 0  # generated tokens, unfinished ones included


def _apportion(weights: dict[str, float], n: int) -> dict[str, int]:
    """`n` split in proportion to `weights` (largest remainder; ties go to the first listed)."""
    total = sum(weights.values())
    quota = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(q) for k, q in quota.items()}
    order = sorted(weights, key=lambda k: (counts[k] - quota[k], list(weights).index(k)))
    for k in order[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def mix_counts(available: dict[str, int], shares: dict[str, float], total: int) -> dict[str, int]:
    """Prompts to draw per domain: `total` split by `shares`; a domain with fewer than its quota gives all
    it has and the rest is split again among the others by their shares, while any have prompts left.
    A domain with share 0 gives none."""
    counts = {d: 0 for d in shares}
    left = total
    while left > 0:
        open_domains = {d: w for d, w in shares.items() if w > 0 and counts[d] < available.get(d, 0)}
        if not open_domains:
            break
        quota = _apportion(open_domains, left)
        for d in open_domains:
            take = min(quota[d], available[d] - counts[d])
            counts[d] += take
            left -= take
    return counts


def _round_robin(by_source: list[list[Prompt]], n: int) -> list[Prompt]:
    """`n` prompts taken in turn from each list (each in its own order): a domain's sources give equal
    numbers while they last."""
    out, queues, depth = [], [q for q in by_source if q], 0
    while len(out) < n and queues:
        for q in queues:
            if depth < len(q) and len(out) < n:
                out.append(q[depth])
        depth += 1
        queues = [q for q in queues if depth < len(q)]
    return out


def _filter(prompts: list[Prompt], bench: ShingleIndex | None, bench_texts: dict[str, str], cfg: DataConfig,
            card: DataCard, enough: int | None) -> list[Prompt]:
    """The prompts that pass every check, in order; the others are counted in `card` by their first reason.
    A source with `enough` kept prompts (as many as the selection can take) has the rest left unchecked."""
    own, kept, per_source = ShingleIndex(cfg.shingle_words), [], Counter()
    for p in prompts:
        if enough is not None and per_source[p.source] >= enough:
            card.unchecked[p.source] += 1
            continue
        reason, match = None, None
        if len(p.text) > cfg.max_prompt_chars:
            reason = "too_long"
        elif p.source == WRITTEN_SOURCE:
            reason = degenerate_reason(p.text, p.domain)
        if reason is None and bench is not None and (match := bench.find(p.text, cfg.near_dup_threshold)):
            reason = "bench_exact" if match.exact else "bench_near"
            if not match.exact:
                card.near_duplicates.append({"id": p.id, "text": p.text, "bench_id": match.key,
                                             "bench_text": bench_texts[match.key], "similarity": match.similarity})
        if reason is None and (match := own.find(p.text, cfg.near_dup_threshold)):
            reason = "duplicate" if match.exact else "near_duplicate"
        if reason is not None:
            card.drop(reason, p.source)
            continue
        own.add(p.id, p.text)
        kept.append(p)
        per_source[p.source] += 1
    return kept


def prepare_prompts(cfg: DataConfig, mirror: str | Path, out_dir: str | Path, seed: int,
                    decontaminate: bool = True, write: Callable[[], WrittenPrompts] | None = None) -> DataCard:
    """Write out_dir/train.jsonl, out_dir/val.jsonl and out_dir/benchmarks/<name>.jsonl; return the data card.

    Training prompts: the configured sources and `write()`'s (called after the mirror was read, so a
    missing file fails before the target is loaded), shuffled with `random.Random(seed)` and filtered in
    that order (see `_filter`; decontaminate: against every benchmark turn) until each source has
    cfg.max_train_prompts + cfg.val_prompts (no source can give more). Then that many are drawn by domain
    in the shares of cfg.mix (`mix_counts`), each domain's sources in turn (`_round_robin`);
    max_train_prompts=0 takes every kept prompt instead. cfg.val_prompts of them are held out,
    stratified by source. Benchmarks: all eight, full sets.
    """
    out_dir = Path(out_dir)
    benchmarks = {name: load_benchmark(name, mirror) for name in BENCHMARK_NAMES}
    loaded = load_train_prompts(cfg.train_sources, mirror)
    written = write() if write is not None else WrittenPrompts()

    sources = list(cfg.train_sources) + ([WRITTEN_SOURCE] if written.requested else [])
    card = DataCard(sources=sources, source_domains={**SOURCE_DOMAINS, WRITTEN_SOURCE: "mixed"},
                    mix=cfg.mix.shares(), benchmarks={name: len(s) for name, s in benchmarks.items()},
                    written_requested=dict(written.requested), written_seconds=written.seconds,
                    written_tokens=written.tokens)
    card.loaded.update(p.source for p in loaded + written.prompts + written.unfinished)
    for p in written.unfinished:
        card.drop("unfinished", p.source)

    bench, bench_texts = None, {}
    if decontaminate:
        bench = ShingleIndex(cfg.shingle_words)
        for samples in benchmarks.values():
            for sample in samples:
                for i, turn in enumerate(sample.turns):
                    bench_texts[f"{sample.id}#{i}"] = turn
                    bench.add(f"{sample.id}#{i}", turn)
    rng = random.Random(seed)
    candidates = loaded + written.prompts
    rng.shuffle(candidates)  # checked in a seeded order: which of two duplicates stays is not the file order's
    enough = cfg.max_train_prompts + cfg.val_prompts if cfg.max_train_prompts else None
    kept = _filter(candidates, bench, bench_texts, cfg, card, enough)
    card.pool.update((p.source, p.domain) for p in kept)
    card.written_examples = [(p.domain, p.text) for p in kept if p.source == WRITTEN_SOURCE]
    if cfg.val_prompts >= len(kept):
        raise ValueError(f"data.val_prompts={cfg.val_prompts} leaves no training prompts ({len(kept)} kept)")

    if cfg.max_train_prompts:
        available = {d: sum(p.domain == d for p in kept) for d in DOMAINS}
        counts = mix_counts(available, cfg.mix.shares(), cfg.max_train_prompts + cfg.val_prompts)
        selected = []
        for d in DOMAINS:
            by_source = [[p for p in kept if p.domain == d and p.source == s] for s in sources]
            selected += _round_robin(by_source, counts[d])
        rng.shuffle(selected)
    else:
        selected = kept
    sizes = {s: sum(p.source == s for p in selected) for s in sources}
    want = _val_counts(sizes, cfg.val_prompts)
    val_ids = set()
    for p in selected:  # the first want[s] of each source in shuffled order
        if want[p.source] > 0:
            want[p.source] -= 1
            val_ids.add(p.id)
    val = [p for p in selected if p.id in val_ids]
    train = [p for p in selected if p.id not in val_ids]
    if cfg.max_train_prompts:
        train = train[: cfg.max_train_prompts]

    write_jsonl(train, out_dir / "train.jsonl")
    write_jsonl(val, out_dir / "val.jsonl")
    for name, samples in benchmarks.items():
        write_jsonl(samples, out_dir / "benchmarks" / f"{name}.jsonl")
    for split, prompts in (("train", train), ("val", val)):
        card.split[split] = Counter((p.source, p.domain) for p in prompts)
    return card
