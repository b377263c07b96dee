"""Throughput of 1 vs N processes under torchrun (drelay/training/distributed.py) on this machine:
distillation response tokens/s and drafter training blocks/s, the same work in each configuration.
Prints a table.

    .venv/bin/python benchmarks/ddp_throughput.py [--target models/target] [--prompts data/prepared/train.jsonl]
        [--n-prompts 16] [--max-new-tokens 48] [--steps 8] [--procs 2] [--repeats 1]

Each configuration is one `python -m torch.distributed.run --nproc-per-node P --standalone` launch of this file
(`--worker`); the configurations alternate (1, P, 1, P, ... with --repeats), so load from other jobs falls on
both alike. Cores are shared fairly: the single process gets all `--cores` torch threads, each of P
processes cores // P. Distillation: the prompts in P shards (one per rank; `distill`'s own throughput
number, all ranks' tokens over the slowest rank's generation time). Training: a fresh drafter on those
distilled sequences, `--steps` DFlash steps of params.yaml's batch (`train.blocks_per_step` blocks, the
global batch split over the ranks), blocks/s as `fit` measures it (optimizer steps only, no evaluation).
Start-up (imports, loading the target) is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    import torch

    from drelay.config import load_params
    from drelay.data.records import load_distilled
    from drelay.io import read_jsonl
    from drelay.models.drafter import BlockDrafter
    from drelay.models.target import Target, context_layer_ids
    from drelay.training import distributed
    from drelay.training.distill import distill, encode_prompts
    from drelay.training.trainer import train_dflash

    params = load_params(ROOT / "params.yaml")
    with distributed.process_group("cpu"):
        world = distributed.world_size()
        torch.set_num_threads(max(1, args.cores // world))
        torch.manual_seed(0)
        target = Target.load(args.target, dtype="float32", device="cpu")
        target.set_layer_ids(context_layer_ids(target.num_layers, params.drafter.num_context_layers))
        prompts, _ = encode_prompts(target, read_jsonl(args.prompts)[: args.n_prompts], 384)
        out = Path(args.out)
        shard = -(-len(prompts) // args.procs)  # one shard per rank of the largest configuration
        distributed.barrier()
        t0 = time.perf_counter()
        summary = distill(target, prompts, out / "distilled", max_new_tokens=args.max_new_tokens,
                          batch_size=shard, shard_size=shard, feature_dtype="float32", stop_ids=target.stop_token_ids())
        distill_wall = time.perf_counter() - t0
        d = params.drafter
        drafter = BlockDrafter.for_target(target, num_layers=d.num_layers, block_size=d.block_size,
                                          num_context_layers=d.num_context_layers).float()
        seqs = [s for s in load_distilled(out / "distilled") if s.response_len >= 2]
        cfg = dataclasses.replace(params.train, max_steps=args.steps, eval_every=10_000, checkpoint_every=10_000,
                                  patience=0, out_dir=str(out / "drafter"), checkpoint_dir=str(out / "ckpt"),
                                  precision="float32")
        result = train_dflash(drafter, seqs[2:], seqs[:2], cfg, pool_size=params.decode.pool_size, seed=0)
        if distributed.is_main():
            (out / "result.json").write_text(json.dumps({
                "processes": world, "threads": torch.get_num_threads(),
                "distill_tokens_per_s": summary["generation_tokens_per_s"],
                "distill_tokens": summary["generated_tokens_this_run"], "distill_wall_s": distill_wall,
                "train_blocks_per_s": result.blocks_per_s, "blocks_per_step": cfg.blocks_per_step}))


def launch(nproc: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
                   __file__, "--worker", "--out", tmp, "--target", args.target, "--prompts", args.prompts,
                   "--n-prompts", str(args.n_prompts), "--max-new-tokens", str(args.max_new_tokens),
                   "--steps", str(args.steps), "--procs", str(args.procs), "--cores", str(args.cores)]
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(max(1, args.cores // nproc))})
        if run.returncode != 0:
            raise SystemExit(f"{nproc} process(es) failed:\n{(run.stdout + run.stderr)[-3000:]}")
        return json.loads(Path(tmp, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(ROOT / "models/target"))
    parser.add_argument("--prompts", default=str(ROOT / "data/prepared/train.jsonl"))
    parser.add_argument("--n-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results: dict[int, list[dict]] = {1: [], args.procs: []}
    for _ in range(args.repeats):
        for nproc in (1, args.procs):
            results[nproc].append(launch(nproc, args))
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    base = results[1]
    print(f"{args.n_prompts} prompts x {args.max_new_tokens} new tokens, {args.steps} training steps of "
          f"{base[0]['blocks_per_step']} blocks, {args.cores} cores, {args.repeats} repeat(s)")
    print("| processes x threads | distill tokens/s | speedup | train blocks/s | speedup |")
    print("|---|---|---|---|---|")
    for nproc, rows in results.items():
        dist, train = mean(rows, "distill_tokens_per_s"), mean(rows, "train_blocks_per_s")
        print(f"| {nproc} x {rows[0]['threads']} | {dist:.1f} | {dist / mean(base, 'distill_tokens_per_s'):.2f}x "
              f"| {train:.1f} | {train / mean(base, 'train_blocks_per_s'):.2f}x |")


if __name__ == "__main__":
    main()
