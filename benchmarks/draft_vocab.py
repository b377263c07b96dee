"""Draft vocabulary (drafter.draft_vocab): what scoring only N token ids costs and saves on this machine.

For each N (0 = the target's whole vocabulary) it prints, side by side in one process (the variants
alternate round by round, so load from other jobs falls on all alike):
- the share of the held-out distilled response tokens the N ids cover (a drafter can never draft the
  rest; choose N on this, never on the benchmarks);
- ms per DFlash training step (forward, backward, AdamW; train.blocks_per_step blocks, the
  narrow cross-entropy the trainer uses), and the ratio to the whole vocabulary;
- ms per drafter proposal of one block at inference (context cache of ~300 positions), and the ratio.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/draft_vocab.py [--sizes 0 4096 8192 16384] [--rounds 3]

Run it in a workspace whose distill stage has run (the default profile: the repo root).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from drelay.config import load_params
from drelay.data.records import (IGNORE, load_distilled, make_batch, response_token_counts, split_sequences,
                                 usable)
from drelay.kernels.reference import dflash_ce
from drelay.models.drafter import BlockDrafter, DraftContextCache, draft_vocabulary
from drelay.models.target import Target
from drelay.training.trainer import block_hidden, scorable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 4096, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (each: 2 steps and 5 proposals per size)")
    args = parser.parse_args()
    params = load_params(args.params)
    target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
    train, val = split_sequences(usable(load_distilled(params.distill.out_dir)), params.train.val_fraction,
                                 params.run.seed)
    counts = response_token_counts(train, target.vocab_size)
    held_out = torch.cat([s.tokens[s.prompt_len:] for s in val])
    d, t = params.drafter, params.train
    drafters, coverage = {}, {}
    for n in args.sizes:
        ids = None if n == 0 else draft_vocabulary(counts, min(n, target.vocab_size), target.stop_token_ids())
        torch.manual_seed(0)
        drafters[n] = BlockDrafter.for_target(target, vocab_ids=ids, num_layers=d.num_layers,
                                              block_size=d.block_size, num_context_layers=d.num_context_layers).float()
        coverage[n] = 1.0 if ids is None else float(torch.isin(held_out, ids).float().mean())
    step_ms: dict[int, list[float]] = {n: [] for n in args.sizes}
    draft_ms: dict[int, list[float]] = {n: [] for n in args.sizes}
    rng = random.Random(0)
    seq = max(train, key=lambda s: len(s.tokens))
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for n, drafter in drafters.items():
            optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-5)
            for _ in range(2):
                batch = scorable(make_batch(rng.sample(train, max(1, t.blocks_per_step // t.anchors_per_sequence)),
                                            t.anchors_per_sequence, d.block_size, rng), drafter)
                t0 = time.perf_counter()
                hidden = block_hidden(drafter, batch)
                loss, _ = dflash_ce(*drafter.scored_logits(hidden, batch.labels, IGNORE), t.gamma)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if round_:
                    step_ms[n].append((time.perf_counter() - t0) * 1000)
            with torch.inference_mode():
                cache = DraftContextCache(d.num_layers)
                T = min(300, len(seq.tokens) - 1)
                drafter.extend_context(cache, seq.features[None, :T].float(), torch.arange(T)[None])
                for _ in range(5):
                    t0 = time.perf_counter()
                    hidden, _ = drafter.draft(cache, seq.tokens[T: T + 1], torch.tensor([T]))
                    drafter.pool(hidden, params.decode.pool_size)
                    if round_:
                        draft_ms[n].append((time.perf_counter() - t0) * 1000)
    full_step = statistics.median(step_ms[args.sizes[0]])
    full_draft = statistics.median(draft_ms[args.sizes[0]])
    print(f"{len(train)} training / {len(val)} held-out sequences; {int((counts > 0).sum())} distinct response "
          f"ids in training; {t.blocks_per_step} blocks per step; torch threads {torch.get_num_threads()}")
    print("| draft vocab | held-out coverage | train step ms | vs first | proposal ms | vs first |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        s, p = statistics.median(step_ms[n]), statistics.median(draft_ms[n])
        print(f"| {n or 'all'} | {coverage[n]:.4f} | {s:.0f} | {full_step / s:.2f}x | {p:.1f} "
              f"| {full_draft / p:.2f}x |")


if __name__ == "__main__":
    main()
