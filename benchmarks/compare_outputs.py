"""Compare two pipeline workspaces output by output: is a refactor behaviour-preserving?

    .venv/bin/python benchmarks/compare_outputs.py OLD_WORKSPACE NEW_WORKSPACE

Every safetensors file under models/ and data/ (drafters, relays, heads, distilled shards, evaluation
continuations) tensor by tensor, bit for bit; every evaluation cell under data/eval/cells/ value by value
(replay cells: τ, per-position counters; live cells: everything but wall times and tokens/s, which are
timings). Prints one line per difference and a summary table; exits 1 if anything deterministic differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

TIMING_KEYS = ("tokens_per_s", "wall_s", "draft_s", "repair_s", "verify_s", "prefill_s")


def _tensors(old: Path, new: Path, rel: str) -> list[str]:
    a, b = load_file(old / rel), load_file(new / rel)
    if set(a) != set(b):
        return [f"{rel}: tensor names differ ({sorted(set(a) ^ set(b))[:5]})"]
    return [f"{rel}: {name} differs" for name in sorted(a)
            if a[name].dtype != b[name].dtype or a[name].shape != b[name].shape or not a[name].equal(b[name])]


def _strip_timings(value):
    if isinstance(value, dict):
        return {k: _strip_timings(v) for k, v in value.items() if not k.endswith(TIMING_KEYS)}
    if isinstance(value, list):
        return [_strip_timings(v) for v in value]
    return value


def compare(old: Path, new: Path) -> tuple[dict[str, list[int]], list[str]]:
    """({kind: [compared, differing]}, difference lines)."""
    counts: dict[str, list[int]] = {}
    problems: list[str] = []

    def count(kind: str, diffs: list[str]) -> None:
        row = counts.setdefault(kind, [0, 0])
        row[0] += 1
        row[1] += bool(diffs)
        problems.extend(diffs)

    for root in ("models", "data"):
        for path in sorted((old / root).rglob("*.safetensors")):
            rel = str(path.relative_to(old))
            kind = "evaluation continuations" if "/eval/" in rel else "distilled shards" if "distill" in rel else \
                "model weights"
            count(kind, _tensors(old, new, rel) if (new / rel).is_file() else [f"{rel}: missing in {new}"])
        for path in sorted((old / root).rglob("config.json")):
            rel = str(path.relative_to(old))
            if (new / rel).is_file():
                a, b = json.loads(path.read_text()), json.loads((new / rel).read_text())
                a = {{"margin": "repair_margin"}.get(k, k): v for k, v in a.items()}  # δ's old config key
                count("model configs", [] if a == b else [f"{rel}: {a} != {b}"])
    for path in sorted((old / "data/eval/cells").rglob("*.json")):
        rel = str(path.relative_to(old))
        kind = "live cells (timings excluded)" if "/live_" in rel else "replay cells"
        if not (new / rel).is_file():
            count(kind, [f"{rel}: missing in {new}"])
            continue
        a = json.loads(path.read_text())["value"]
        b = json.loads((new / rel).read_text())["value"]
        a, b = (_strip_timings(a), _strip_timings(b)) if kind.startswith("live") else (a, b)
        count(kind, [] if a == b else [f"{rel}: values differ"])
    return counts, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args()
    counts, problems = compare(args.old, args.new)
    for line in problems:
        print(line)
    print("\n| outputs | compared | differing |\n|---|---|---|")
    for kind, (n, bad) in counts.items():
        print(f"| {kind} | {n} | {bad} |")
    if not counts:
        print(f"nothing to compare under {args.old}", file=sys.stderr)
        return 2
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
