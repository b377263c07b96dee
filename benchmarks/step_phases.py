"""Where a live decoding step's time goes, per method: drafting, the repair (a method's select) and the
target's verification, in ms per step and as shares of the step; and what the walk stopping at the last
checked draft saves (`DraftBlock.checked`: with `decode.verify_size` V the target checks drafts 1..V-1 only,
so a selector walks those and leaves the rest native, and DRelay's reader computes its last layer for those
positions only; `--whole-walk` also times every method walking the whole block, as before). The two walks choose
the same tokens up to float rounding in the reader's last layer: the benchmark reports any prompt where they part.
Methods and walks alternate prompt by prompt, so machine noise hits them alike.

    .venv/bin/python benchmarks/step_phases.py [--params P] [--methods dflash drelay ...] [--verify-size 3]
        [--prompts 4] [--max-new-tokens 64] [--whole-walk] [--out FILE]
    (run it where the pipeline ran: the repo root, or runs/<profile>/)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drelay.decoding.generate import SpeculativeDecoder, ar_generate  # noqa: E402
from drelay.io import read_jsonl  # noqa: E402
from drelay.models import cpu_linear  # noqa: E402
from drelay.models.methods import load_speculator  # noqa: E402
from workspace import load_workspace  # noqa: E402


class WholeWalkDecoder(SpeculativeDecoder):
    """The engine as it was before `DraftBlock.checked`: every method walks the whole block."""

    def propose(self, state):
        return dataclasses.replace(super().propose(state), checked=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--methods", nargs="+", default=["dflash", "dflash2", "domino", "dspark", "drelay"])
    ap.add_argument("--verify-size", type=int, default=None, help="default: the params' decode.verify_size")
    ap.add_argument("--prompts", type=int, default=4, help="validation prompts decoded live")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per live prompt")
    ap.add_argument("--whole-walk", action="store_true", help="also time the whole-block walk (before/after)")
    ap.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = ap.parse_args()
    params, target, _ = load_workspace(args.params)
    verify = params.decode.verify_size if args.verify_size is None else args.verify_size
    specs = {m: load_speculator(target, params.joint.common.out_dir, m) for m in args.methods}
    pool, stop = params.decode.pool_size, target.stop_token_ids()
    walks = {"checked": SpeculativeDecoder, **({"whole block": WholeWalkDecoder} if args.whole_walk else {})}

    prompts = [target.encode_chat(r["messages"]) for r in read_jsonl(f"{params.data.out_dir}/val.jsonl")]
    prompts = [p for p in prompts if len(p) <= params.distill.max_prompt_tokens][: args.prompts]
    totals = {(m, w): {"draft_s": 0.0, "repair_s": 0.0, "verify_s": 0.0, "steps": 0, "new_tokens": 0}
              for m in specs for w in walks}
    ar_s = ar_tokens = 0
    for i, ids in enumerate(prompts):
        ar = ar_generate(target, ids, args.max_new_tokens, stop_token_ids=stop)
        ar_s, ar_tokens = ar_s + ar.stats.wall_s, ar_tokens + ar.stats.new_tokens
        for m, spec in specs.items():
            outputs = {}
            for w, decoder_class in walks.items():
                if decoder_class is WholeWalkDecoder and not spec.method.repairs:  # nothing walks: same step
                    continue
                decoder = decoder_class(target, spec.drafter, spec.method if spec.method.repairs else None,
                                        pool_size=pool, verify_size=verify)
                res = decoder.generate(ids, args.max_new_tokens, stop_token_ids=stop)
                outputs[w] = res.tokens
                t = totals[(m, w)]
                for key in ("draft_s", "repair_s", "verify_s"):
                    t[key] += getattr(res.stats, key)
                t["steps"] += res.stats.steps
                t["new_tokens"] += res.stats.new_tokens
            if len(set(map(tuple, outputs.values()))) > 1:  # speculative decoding is lossless either way: only
                print(f"  note: {m}'s walks parted on prompt {i}", flush=True)  # a near-tie of a choice can do this
        print(f"prompt {i + 1}/{len(prompts)} decoded", flush=True)

    ar_ms = 1000 * ar_s / max(ar_tokens, 1)
    print(f"\nAR: {ar_ms:.1f} ms per token; verify size {verify}; {len(prompts)} validation prompts, "
          f"{args.max_new_tokens} new tokens; few-row products: {cpu_linear.MODE}\n")
    for rows, t in cpu_linear.measured_orders().items():  # auto: the whole forwards timed before decoding
        print(f"  {rows} rows: F.linear {t['linear']:.1f} ms, (W @ x^T)^T {t['transposed']:.1f} ms -> {t['kept']}")
    print("| method | walk | draft ms | repair ms | verify ms | step ms | repair share | tokens per step |")
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    for (m, w), t in totals.items():
        if not t["steps"]:
            continue
        steps = max(t["steps"], 1)
        ms = {key: 1000 * t[f"{key}_s"] / steps for key in ("draft", "repair", "verify")}
        step = sum(ms.values())
        rows.setdefault(m, {})[w] = {**{f"{k}_ms": v for k, v in ms.items()}, "step_ms": step,
                                     "repair_share": ms["repair"] / step if step else 0.0,
                                     "tokens_per_step": t["new_tokens"] / steps}
        print(f"| {m} | {w} | {ms['draft']:.1f} | {ms['repair']:.1f} | {ms['verify']:.1f} | {step:.1f} "
              f"| {rows[m][w]['repair_share']:.1%} | {rows[m][w]['tokens_per_step']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"ar_ms_per_token": ar_ms, "verify_size": verify, "prompts": len(prompts),
                                        "methods": rows}, indent=2))


if __name__ == "__main__":
    main()
