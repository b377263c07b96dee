"""How many drafts the target should check per step (`decode.verify_size`), measured where settings are chosen:
the held-out distilled split (replay τ, exact at T = 0) and the validation prompts (live decoding against AR).

Checking fewer tokens makes every verification forward cheaper, and loses only the steps whose accepted run
would have gone past the cut. For each method and each verify size this prints the held-out replay τ, the live
step time and speedup over AR on the validation prompts, and the speedup the cost model predicts from the
replay τ (τ x AR ms per token / live ms per step). Sizes and methods alternate prompt by prompt, so machine
noise hits them alike. Writes the numbers as JSON with `--out`.

    .venv/bin/python benchmarks/verify_size.py [--params P] [--sizes 2 3 4 8] [--methods dflash drelay]
        [--prompts 4] [--max-new-tokens 64] [--out FILE]
    (run it where the pipeline ran: the repo root, or runs/<profile>/)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drelay.decoding.generate import ar_generate, speculative_generate  # noqa: E402
from drelay.eval.replay_eval import replay_methods  # noqa: E402
from drelay.io import read_jsonl  # noqa: E402
from drelay.models.methods import load_speculator  # noqa: E402
from workspace import load_workspace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 8], help="verify sizes (the block's: all)")
    ap.add_argument("--methods", nargs="+", default=["dflash", "dflash2", "dspark", "drelay"])
    ap.add_argument("--prompts", type=int, default=4, help="validation prompts decoded live")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per live prompt")
    ap.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = ap.parse_args()
    params, target, val = load_workspace(args.params)
    specs = {m: load_speculator(target, params.joint.common.out_dir, m) for m in args.methods}
    pool, stop = params.decode.pool_size, target.stop_token_ids()
    autocast = params.train.precision == "bfloat16"

    rows: dict[str, dict[int, dict]] = {m: {v: {} for v in args.sizes} for m in specs}
    for v in args.sizes:
        for m, stats in replay_methods(specs, val, pool, autocast=autocast, verify_size=v).items():
            rows[m][v]["replay_tau"] = stats.tau
        print(f"verify size {v}: held-out replay τ " + ", ".join(f"{m} {rows[m][v]['replay_tau']:.3f}" for m in specs),
              flush=True)

    prompts = [target.encode_chat(r["messages"]) for r in read_jsonl(f"{params.data.out_dir}/val.jsonl")]
    prompts = [p for p in prompts if len(p) <= params.distill.max_prompt_tokens][: args.prompts]
    ar_s, ar_tokens = 0.0, 0
    live: dict[str, dict[int, list]] = {m: {v: [] for v in args.sizes} for m in specs}
    for i, ids in enumerate(prompts):
        ar = ar_generate(target, ids, args.max_new_tokens, stop_token_ids=stop)
        ar_s, ar_tokens = ar_s + ar.stats.wall_s, ar_tokens + ar.stats.new_tokens
        for v in args.sizes:
            for m, spec in specs.items():
                res = speculative_generate(target, spec.drafter, ids, args.max_new_tokens, method=spec.method,
                                           pool_size=pool, stop_token_ids=stop, verify_size=v)
                if res.tokens != ar.tokens:  # float32 targets are exact; a low-precision one may part at a near-tie
                    print(f"  note: {m} at verify size {v} parted from AR on prompt {i}", flush=True)
                live[m][v].append(res.stats)
        print(f"prompt {i + 1}/{len(prompts)} decoded", flush=True)

    ar_ms = 1000 * ar_s / max(ar_tokens, 1)
    print(f"\nAR: {ar_ms:.1f} ms per token ({len(prompts)} validation prompts, {args.max_new_tokens} new tokens)\n")
    print("| method | verify size | held-out replay τ | live τ | ms per step | live speedup | predicted speedup |")
    print("|---|---|---|---|---|---|---|")
    for m in specs:
        for v in args.sizes:
            stats = live[m][v]
            step_s = sum(s.draft_s + s.repair_s + s.verify_s for s in stats)
            steps = sum(s.steps for s in stats)
            tokens, wall = sum(s.new_tokens for s in stats), sum(s.wall_s for s in stats)
            row = rows[m][v]
            row |= {"live_tau": statistics.mean(s.tau for s in stats), "step_ms": 1000 * step_s / max(steps, 1),
                    "live_speedup": (tokens / wall) / (1000 / ar_ms) if wall else 0.0}
            row["predicted_speedup"] = row["replay_tau"] * ar_ms / row["step_ms"]
            print(f"| {m} | {v} | {row['replay_tau']:.3f} | {row['live_tau']:.3f} | {row['step_ms']:.1f} "
                  f"| {row['live_speedup']:.2f}x | {row['predicted_speedup']:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({"ar_ms_per_token": ar_ms, "prompts": len(prompts),
                                        "methods": {m: {str(v): r for v, r in rows[m].items()} for m in rows}},
                                       indent=2))


if __name__ == "__main__":
    main()
