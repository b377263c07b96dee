"""The data card of the training prompts: where they come from, what was dropped and why, how the
domains are mixed (written by prepare_data: flat metrics + a markdown report), and the response
tokens per source and domain that distillation produced from them."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from drelay.config import DOMAINS

# Why a prompt was left out, in the order they are checked (the first that applies is counted).
DROP_REASONS = ("too_long", "unfinished", "non_text", "too_short", "repetitive", "off_domain",
                "bench_exact", "bench_near", "duplicate", "near_duplicate")
DEGENERATE = ("unfinished", "non_text", "too_short", "repetitive", "off_domain")  # written prompts only
LICENCES = {"gsm8k": "MIT", "mbpp": "CC BY 4.0", "self_instruct": "Apache-2.0",
            "codealpaca": "CC BY-NC 4.0 (non-commercial, opt-in)", "written": "written by the target"}


@dataclass
class DataCard:
    """Counts of one prepare_data run; `metrics()` for MLflow and metrics/prepare_data.json, `markdown()`
    for reports/data_card.md."""

    sources: list[str]  # in the order they were read (written last)
    source_domains: dict[str, str]  # source -> its domain ("mixed" for written)
    mix: dict[str, float]  # data.mix
    loaded: Counter = field(default_factory=Counter)  # source -> prompts read or written
    dropped: dict[str, Counter] = field(default_factory=dict)  # reason -> source -> prompts
    unchecked: Counter = field(default_factory=Counter)  # source -> prompts left unchecked (it had enough)
    pool: Counter = field(default_factory=Counter)  # (source, domain) -> prompts left after filtering
    split: dict[str, Counter] = field(default_factory=dict)  # "train"/"val" -> (source, domain) -> prompts
    benchmarks: dict[str, int] = field(default_factory=dict)  # benchmark -> samples
    near_duplicates: list[dict] = field(default_factory=list)  # examples: prompt, benchmark text, similarity
    written_requested: dict[str, int] = field(default_factory=dict)  # domain -> requests asked of the target
    written_examples: list[tuple[str, str]] = field(default_factory=list)  # (domain, request) kept
    written_seconds: float = 0.0
    written_tokens: int = 0

    def drop(self, reason: str, source: str) -> None:
        self.dropped.setdefault(reason, Counter())[source] += 1

    def count(self, split: str, source: str = "", domain: str = "") -> int:
        table = self.pool if split == "pool" else self.split.get(split, Counter())
        return sum(n for (s, d), n in table.items() if source in ("", s) and domain in ("", d))

    def metrics(self) -> dict[str, float]:
        """Flat counts: loaded.<source>, dropped.<reason> (and dropped.degenerate, their sum for written
        prompts), unchecked.<source>, pool.<source>, {train,val}.<source>, {train,val}.domain.<domain>, {train,val}.total,
        bench.<name>, written.*."""
        m: dict[str, float] = {f"loaded.{s}": self.loaded[s] for s in self.sources}
        m |= {f"dropped.{r}": sum(self.dropped.get(r, Counter()).values()) for r in DROP_REASONS}
        m["dropped.degenerate"] = sum(m[f"dropped.{r}"] for r in DEGENERATE)
        m |= {f"unchecked.{s}": self.unchecked[s] for s in self.sources}
        m |= {f"pool.{s}": self.count("pool", s) for s in self.sources}
        for split in ("train", "val"):
            m |= {f"{split}.{s}": self.count(split, s) for s in self.sources}
            m |= {f"{split}.domain.{d}": self.count(split, domain=d) for d in DOMAINS}
            m[f"{split}.total"] = self.count(split)
        m |= {f"bench.{name}": n for name, n in self.benchmarks.items()}
        if self.written_requested:
            m["written.requested"] = sum(self.written_requested.values())
            m["written.seconds"] = self.written_seconds
            m["written.tokens_per_s"] = self.written_tokens / self.written_seconds if self.written_seconds else 0.0
        return m

    def markdown(self, max_examples: int = 8) -> str:
        train_total = self.count("train")
        lines = ["# Data card: training prompts", "",
                 f"{train_total} training and {self.count('val')} validation prompts. Asked mix (data.mix): "
                 + ", ".join(f"{d} {share:.2f}" for d, share in self.mix.items()) + ". Every prompt was "
                 "checked against every turn of the eight benchmarks (exact and near-duplicate) and against "
                 "the prompts kept before it. Response tokens per source and domain: metrics/distill.json "
                 "(response_tokens.*).", "",
                 "## Per domain", "", "| domain | asked share | pool | train | val | train share |",
                 "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for d in DOMAINS:
            n = self.count("train", domain=d)
            lines.append(f"| {d} | {self.mix.get(d, 0):.2f} | {self.count('pool', domain=d)} | {n} | "
                         f"{self.count('val', domain=d)} | {n / train_total if train_total else 0:.3f} |")
        lines += ["", "## Per source", "",
                  "| source | domain | licence | loaded | unchecked | dropped | pool | train | val |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for s in self.sources:
            dropped = sum(c[s] for c in self.dropped.values())
            lines.append(f"| {s} | {self.source_domains.get(s, '')} | {LICENCES.get(s, '')} | {self.loaded[s]} | "
                         f"{self.unchecked[s]} | {dropped} | {self.count('pool', s)} | {self.count('train', s)} | "
                         f"{self.count('val', s)} |")
        lines += ["", "unchecked: prompts of a source that already had as many as the selection can take "
                  "(data.max_train_prompts + data.val_prompts), in the seeded order; pool: kept after the checks."]
        lines += ["", "## Dropped, per reason", "",
                  "| reason | " + " | ".join(self.sources) + " | total |",
                  "| --- | " + " | ".join("---:" for _ in self.sources) + " | ---: |"]
        for r in DROP_REASONS:
            c = self.dropped.get(r, Counter())
            lines.append(f"| {r} | " + " | ".join(str(c[s]) for s in self.sources) + f" | {sum(c.values())} |")
        lines += ["", "too_long: over data.max_prompt_chars; unfinished .. off_domain: written prompts only "
                  "(cut at the token budget, control tokens or mostly non-letters, under 4 words, looping, no word "
                  "of the asked domain); bench_exact / bench_near: equal (normalised) or similar (Jaccard of word "
                  "shingles >= data.near_dup_threshold) to a benchmark turn; duplicate / near_duplicate: the same "
                  "against an earlier training prompt."]
        if self.near_duplicates:
            lines += ["", f"## Near-duplicates of benchmark prompts (first {max_examples})", "",
                      "| similarity | training prompt | benchmark turn |", "| ---: | --- | --- |"]
            for ex in self.near_duplicates[:max_examples]:
                lines.append(f"| {ex['similarity']:.2f} | {_cell(ex['text'])} ({ex['id']}) | "
                             f"{_cell(ex['bench_text'])} ({ex['bench_id']}) |")
        if self.written_requested:
            kept = self.count("pool", "written")
            rate = self.written_tokens / self.written_seconds if self.written_seconds else 0.0
            lines += ["", "## Written by the target", "",
                      f"Asked: " + ", ".join(f"{d} {n}" for d, n in self.written_requested.items())
                      + f"; {kept} passed every filter. Writing took {self.written_seconds:.1f} s "
                      f"({self.written_tokens} tokens, {rate:.1f} tokens/s).", ""]
            if self.written_examples:
                lines += ["| domain | request |", "| --- | --- |"]
                lines += [f"| {d} | {_cell(text, 300)} |" for d, text in self.written_examples[:max_examples]]
        if self.benchmarks:
            lines += ["", "## Benchmarks (held out)", "", "| benchmark | samples |", "| --- | ---: |"]
            lines += [f"| {name} | {n} |" for name, n in self.benchmarks.items()]
        return "\n".join(lines) + "\n"


def _cell(text: str, limit: int = 160) -> str:
    """Text for one markdown table cell: one line, pipes escaped, cut at `limit` characters."""
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def response_tokens_by_group(distill_dir: str | Path, groups: dict[tuple[int, ...], tuple[str, str]]) -> dict[str, int]:
    """Response tokens per source and per domain of a finished distillation. Each sequence's prompt token
    ids are looked up in `groups` ({prompt ids: (source, domain)}; not found: "unknown"), so any order of
    the sequences in the shards works. Reads the shards' token ids, not their features.
    Keys: response_tokens.source.<source>, response_tokens.domain.<domain>."""
    from safetensors import safe_open

    from drelay.data.records import MANIFEST

    distill_dir = Path(distill_dir)
    out: Counter[str] = Counter()
    for name in json.loads((distill_dir / MANIFEST).read_text())["shards"]:
        with safe_open(str(distill_dir / name), framework="pt") as f:
            tokens, offsets, prompt_lens = (f.get_tensor(k).tolist() for k in ("tokens", "offsets", "prompt_lens"))
        for start, end, prompt_len in zip(offsets[:-1], offsets[1:], prompt_lens):
            source, domain = groups.get(tuple(tokens[start: start + prompt_len]), ("unknown", "unknown"))
            out[f"response_tokens.source.{source}"] += end - start - prompt_len
            out[f"response_tokens.domain.{domain or 'unknown'}"] += end - start - prompt_len
    return dict(out)
