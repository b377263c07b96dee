"""DRelay vs the equal-budget DFlash continuation, on the same samples (issue: DRelay itself).

Both come out of the train@dflash / train@drelay stages: the same train_dflash drafter continued for
the same extra steps on the same batches. For each prompt set (the validation prompts of
prepare_data, and the first N samples of each chosen benchmark; MT-Bench with both turns) the target's
greedy continuation is generated once and every method is replayed along it (exact T=0 τ, see
drelay/eval/replay_eval.py):

    dflash         the dflash continuation's native top-1
    dflash+oracle  its pool with the true token picked whenever it is in the pool (the upper bound)
    drelay-native  the drelay backbone without its selector
    drelay         the drelay backbone repaired by its selector at the saved δ
    drelay+oracle  the drelay backbone's oracle

Then live greedy decoding on a few prompts per set (bf16, same process): AR, dflash, drelay, with τ,
speedup and the selector's share of a step. Prints a table; writes JSON with everything.

    .venv/bin/python benchmarks/drelay_vs_dflash.py [--samples 24] [--live-prompts 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drelay.config import load_params  # noqa: E402
from drelay.data.benchmarks import BenchmarkSample, load_prepared_benchmark  # noqa: E402
from drelay.eval.live import live_compare  # noqa: E402
from drelay.eval.replay_eval import continuations, replay_methods  # noqa: E402
from drelay.io import read_jsonl  # noqa: E402
from drelay.models.methods import Speculator, load_speculator  # noqa: E402
from drelay.models.repair import Native, Oracle  # noqa: E402
from drelay.models.target import Target  # noqa: E402


def val_samples(path: Path) -> list[BenchmarkSample]:
    return [BenchmarkSample(r["id"], "val", tuple(m["content"] for m in r["messages"] if m["role"] == "user"), None)
            for r in read_jsonl(path)]


def row(stats) -> dict:
    s = stats.summary()
    return {k: s[k] for k in ("tau", "pool_hit", "replace_rate", "repair_precision", "harm_rate")} | {
        "steps": stats.steps, "accept_pos": (stats.accepted_at / stats.reached.clamp(min=1)).tolist(),
        "pool_hit_pos": (stats.pool_hit / stats.reached.clamp(min=1)).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--benchmarks", nargs="*", default=["gsm8k", "humaneval", "mt_bench"], help="none: only val")
    ap.add_argument("--no-val", action="store_true", help="leave out the validation prompts")
    ap.add_argument("--samples", type=int, default=24, help="samples per benchmark (and val prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--live-prompts", type=int, default=3, help="live-decoded prompts per set (0: none)")
    ap.add_argument("--live-max-new-tokens", type=int, default=128)
    ap.add_argument("--cache", default="data/continuations", help="where target continuations are kept")
    ap.add_argument("--out", default="reports/drelay_vs_dflash.json")
    args = ap.parse_args()

    p = load_params(args.params)
    target = Target.load(p.target.path, dtype=p.target.dtype, device=p.target.device)
    joint = Path(p.joint.common.out_dir)
    dflash, drelay = load_speculator(target, joint, "dflash"), load_speculator(target, joint, "drelay")
    relay = drelay.method
    k = p.decode.pool_size
    methods = {"dflash": dflash, "dflash+oracle": Speculator(dflash.drafter, Oracle()),
               "drelay-native": Speculator(drelay.drafter, Native()), "drelay": drelay,
               "drelay+oracle": Speculator(drelay.drafter, Oracle())}
    sets = {} if args.no_val else {"val": val_samples(Path(p.data.out_dir) / "val.jsonl")[: args.samples]}
    for name in args.benchmarks:
        sets[name] = load_prepared_benchmark(Path(p.data.out_dir) / "benchmarks", name, args.samples)

    results, pooled = {}, {}
    for name, samples in sets.items():
        t0 = time.perf_counter()
        seqs = continuations(target, samples, Path(args.cache) / name, max_new_tokens=args.max_new_tokens,
                             max_prompt_tokens=p.distill.max_prompt_tokens, batch_size=p.distill.batch_size)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = replay_methods(methods, seqs, k)
        results[name] = {m: row(s) for m, s in stats.items()}
        results[name]["_info"] = {"sequences": len(seqs), "response_tokens": sum(s.response_len for s in seqs),
                                  "continuation_s": t_gen, "replay_s": time.perf_counter() - t0}
        for m, s in stats.items():
            pooled[m] = s if m not in pooled else pooled[m].merge(s)
        if args.live_prompts:
            ids = [s.tokens[: s.prompt_len].tolist() for s in seqs[: args.live_prompts]]
            live = live_compare(target, {"dflash": dflash, "drelay": drelay}, ids,
                                args.live_max_new_tokens, k, desc=f"live {name}")
            results[name]["_live"] = live
        print(f"{name}: {len(seqs)} sequences, τ dflash {results[name]['dflash']['tau']:.3f} "
              f"drelay {results[name]['drelay']['tau']:.3f}", flush=True)
    results["all"] = {m: row(s) for m, s in pooled.items()}
    results["all"]["_info"] = {"sequences": sum(r["_info"]["sequences"] for n, r in results.items() if n != "all")}

    def closed(r: dict) -> float:
        gap = r["dflash+oracle"]["tau"] - r["dflash"]["tau"]
        return (r["drelay"]["tau"] - r["dflash"]["tau"]) / gap if gap > 1e-9 else 0.0

    print("\n| set | n | τ dflash | τ drelay | Δτ | τ drelay-native | oracle τ (dflash / drelay) | gap closed "
          "| pool-hit | replace | precision | harm | live τ dflash / drelay | live speedup dflash / drelay "
          "| selector share |")
    print("|" + "---|" * 15)
    for name, r in results.items():
        live = r.get("_live", {})
        lv = (f"{live['dflash']['live_tau']:.2f} / {live['drelay']['live_tau']:.2f}",
              f"{live['dflash']['live_speedup']:.2f}x / {live['drelay']['live_speedup']:.2f}x",
              f"{live['drelay']['live_repair_share']:.2f}") if live else ("", "", "")
        d = r["drelay"]
        n = r["_info"]["sequences"]
        print(f"| {name} | {n} | {r['dflash']['tau']:.3f} | {d['tau']:.3f} | {d['tau'] - r['dflash']['tau']:+.3f} "
              f"| {r['drelay-native']['tau']:.3f} | {r['dflash+oracle']['tau']:.3f} / {r['drelay+oracle']['tau']:.3f} "
              f"| {closed(r):.3f} | {d['pool_hit']:.3f} | {d['replace_rate']:.3f} | {d['repair_precision']:.3f} "
              f"| {d['harm_rate']:.3f} | {lv[0]} | {lv[1]} | {lv[2]} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results["_settings"] = {**vars(args), "repair_margin": relay.config.repair_margin, "pool_size": k,
                            "threads": torch.get_num_threads()}
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
