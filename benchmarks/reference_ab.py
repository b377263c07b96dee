"""DRelay's walk (`relay_select_ref`) and lattice messages (`lattice_messages`): a git revision's reference.py
against the working tree's, on the real calls of a reproduced workspace's live decoder, interleaved in one process
so that the machine's noise lands on both (median of the per-round ratios). Checks that the two give the same
choices and prints the largest difference of σ and of the messages.

    .venv/bin/python benchmarks/reference_ab.py [--base HEAD] [--params P] [--method drelay] [--prompts 4]
        [--steps 8] [--rounds 15]
    (run it where the pipeline ran: the repo root, or runs/<profile>/)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import drelay.models.relay as relay_module  # noqa: E402
from drelay.kernels import reference as current  # noqa: E402
from select_phases import live_blocks  # noqa: E402
from workspace import load_workspace  # noqa: E402


def load_revision(rev: str):
    """drelay/kernels/reference.py as of git revision `rev`, imported as a module of its own."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:drelay/kernels/reference.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "reference_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("reference_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reference_base"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def recorded_calls(relay, blocks):
    """The arguments of every walk and every lattice_messages call that selecting `blocks` makes."""
    walks, messages = [], []
    ops, messages_fn = relay.ops, relay_module.lattice_messages
    relay.ops = dataclasses.replace(ops, relay_select=lambda *a: (walks.append(a), ops.relay_select(*a))[1])
    relay_module.lattice_messages = lambda *a: (messages.append(a), messages_fn(*a))[1]
    try:
        with torch.inference_mode():
            for block in blocks:
                relay.select(block)
    finally:
        relay.ops, relay_module.lattice_messages = ops, messages_fn
    return walks, messages


def ms_per_call(fn, calls) -> float:
    t0 = time.perf_counter()
    for args in calls:
        fn(*args)
    return 1000 * (time.perf_counter() - t0) / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision whose reference.py is the baseline")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--method", default="drelay")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    base = load_revision(args.base)
    params, target, _ = load_workspace(args.params)
    relay, blocks, _ = live_blocks(params, target, args.method, args.prompts, args.steps, "reference_ab")
    walks, messages = recorded_calls(relay, blocks)
    print(f"\n{args.method}: {len(blocks)} blocks; {args.base}'s reference.py vs the working tree's, {args.rounds} "
          f"interleaved rounds, {torch.get_num_threads()} threads\n")
    print("| op | calls | base ms | new ms | new/base median [min, max] | max abs diff |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name, calls in (("relay_select_ref", walks), ("lattice_messages", messages)):
            if not calls:
                print(f"| {name} | 0 | - | - | - | - |")
                continue
            old_fn, new_fn = getattr(base, name), getattr(current, name)
            diff = 0.0
            for a in calls:
                old, new = old_fn(*a), new_fn(*a)
                if name == "relay_select_ref":
                    if not torch.equal(old[0], new[0]):
                        sys.exit(f"reference_ab: the walk's choices differ from {args.base}'s")
                    old, new = old[1], new[1]
                diff = max(diff, (old - new).abs().max().item())
            base_ms, new_ms = [], []
            for _ in range(args.rounds):
                base_ms.append(ms_per_call(old_fn, calls))
                new_ms.append(ms_per_call(new_fn, calls))
            ratios = [n / b for n, b in zip(new_ms, base_ms)]
            print(f"| {name} | {len(calls)} | {statistics.median(base_ms):.3f} | {statistics.median(new_ms):.3f} | "
                  f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] | {diff:.1e} |")


if __name__ == "__main__":
    main()
