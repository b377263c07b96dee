"""Where DRelay's select (the repair of one block, the engine's hook) spends its time, part by part, on real
blocks of a reproduced workspace: the blocks the live decoder proposes on validation prompts, each repaired
`--repeats` times after a warm-up, with the parts timed by wrapping the functions select calls (their own
code runs; the wrapper adds one timer call per part). Parts nest (a row with more leading dots is inside the row above it);
"other" is select's own remainder. Run it alone: the times are wall clock, and the machine's other jobs land in
them. A hot loop of selects keeps the relay's weights in cache, so these times are below a live step's repair
time (there the target's forward evicts them between selects: `benchmarks/step_phases.py` measures that).

    .venv/bin/python benchmarks/select_phases.py [--params P] [--method drelay] [--prompts 4] [--steps 8]
        [--repeats 3] [--threads N] [--out FILE]
    (run it where the pipeline ran: the repo root, or runs/<profile>/)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import drelay.models.relay as relay_module  # noqa: E402
from drelay.decoding.generate import SpeculativeDecoder  # noqa: E402
from drelay.io import read_jsonl  # noqa: E402
from drelay.models.methods import load_speculator  # noqa: E402
from workspace import load_workspace  # noqa: E402

# (depth, label, owner, attribute): what select calls, in the order of a step
PARTS = [
    (0, "select", relay_module.DRelay, "select"),
    (1, "position-1 lattice pool", relay_module.DRelay, "with_first_lattice_pool"),
    (2, "vocabulary product", relay_module.Lattice, "vocabulary"),
    (1, "read", relay_module.DRelay, "read"),
    (2, "lattice table", relay_module.Lattice, "table"),
    (2, "lattice messages", relay_module, "lattice_messages"),
    (2, "reader", relay_module.GlobalReader, "forward"),
    (1, "candidate terms", relay_module.CausalSelector, "candidate_terms"),
    (1, "anchor input", relay_module.DRelay, "anchor_input"),
    (1, "walk (relay_select)", None, "relay_select"),
]


def timed(totals: Counter, label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0
    return wrapper


def live_blocks(params, target, method: str, num_prompts: int, steps: int, caller: str):
    """(the DRelay method, the blocks its live decoder proposes: `steps` per prompt on the first `num_prompts`
    validation prompts, the prompts), with the relay's inference tables built (`prepare_inference`)."""
    spec = load_speculator(target, params.joint.common.out_dir, method)
    relay = spec.method
    if not isinstance(relay, relay_module.DRelay):
        sys.exit(f"{caller}: {method} is not a DRelay method ({type(relay).__name__})")
    decoder = SpeculativeDecoder(target, spec.drafter, relay, pool_size=params.decode.pool_size,
                                 verify_size=params.decode.verify_size)
    prompts = [target.encode_chat(r["messages"]) for r in read_jsonl(f"{params.data.out_dir}/val.jsonl")]
    prompts = [p for p in prompts if len(p) <= params.distill.max_prompt_tokens][:num_prompts]
    blocks = []
    with torch.inference_mode():
        for ids in prompts:
            state = decoder.start(ids)
            for _ in range(steps):
                blocks.append(decoder.propose(state))
                decoder.step(state)
    relay.prepare_inference()
    return relay, blocks, prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--method", default="drelay", help="a DRelay method (drelay, drelay-lite)")
    ap.add_argument("--prompts", type=int, default=4, help="validation prompts whose blocks are repaired")
    ap.add_argument("--steps", type=int, default=8, help="decoding steps (blocks) per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over all the blocks")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the params' run.threads)")
    ap.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = ap.parse_args()
    params, target, _ = load_workspace(args.params)
    if args.threads:
        torch.set_num_threads(args.threads)
    relay, blocks, prompts = live_blocks(params, target, args.method, args.prompts, args.steps, "select_phases")

    totals: Counter = Counter()
    saved = []
    for _, label, owner, name in PARTS:
        if owner is None:  # the walk: the relay's bound op set is frozen, so a copy with the wrapped op
            saved.append((relay, "ops", relay.ops))
            relay.ops = dataclasses.replace(relay.ops, relay_select=timed(totals, label, relay.ops.relay_select))
        else:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, timed(totals, label, getattr(owner, name)))
    try:
        with torch.inference_mode():
            for block in blocks[:5]:  # warm-up
                relay.select(block)
            totals.clear()
            for _ in range(args.repeats):
                for block in blocks:
                    relay.select(block)
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)

    count = args.repeats * len(blocks)
    ms = {label: 1000 * totals[label] / count for _, label, _, _ in PARTS}
    children: dict[str, float] = Counter()
    parents: list[str] = []
    for depth, label, _, _ in PARTS:  # "other": each part's time minus its direct children's
        parents[depth:] = [label]
        if depth:
            children[parents[depth - 1]] += ms[label]
    total = ms["select"]
    print(f"\n{args.method}: {len(blocks)} blocks ({len(prompts)} prompts x {args.steps} steps), {args.repeats} passes, "
          f"{torch.get_num_threads()} threads, verify size {params.decode.verify_size}\n")
    print("| part | ms per select | share |")
    print("|---|---|---|")
    rows = {}
    for depth, label, _, _ in PARTS:
        rows[label] = ms[label]
        print(f"| {'. ' * depth}{label} | {ms[label]:.3f} | {ms[label] / total:.1%} |")
    for depth, label, _, _ in PARTS[:1] + [p for p in PARTS if p[1] == "read"]:
        other = ms[label] - children[label]
        rows[f"{label}: other"] = other
        print(f"| {'. ' * (depth + 1)}{label}: other | {other:.3f} | {other / total:.1%} |")
    if args.out:
        args.out.write_text(json.dumps({"method": args.method, "blocks": len(blocks), "threads": torch.get_num_threads(),
                                        "ms_per_select": rows}, indent=2))


if __name__ == "__main__":
    main()
