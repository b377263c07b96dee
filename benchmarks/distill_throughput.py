"""Distillation throughput: response tokens/s of the previous generation loop (kept below, here only,
as the baseline) against `drelay.training.distill.generate_batch`, on the same training prompts, and
whether both wrote the same tokens and features. Prints a table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/distill_throughput.py \
        [--target runs/cpu-small/models/target] [--prompts 32] [--max-new-tokens 128] [--batch-size 64]

Both paths batch like `distill()`: the prompts sorted by length, then cut into batches. The paths
alternate block by block (one block = the larger batch size), so load from other jobs on the machine
falls on both alike. Ratios measured side by side in one run are what to compare.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from drelay.data.records import Sequence
from drelay.decoding.verify import sample_tokens
from drelay.io import read_jsonl
from drelay.models.target import Target, context_layer_ids
from drelay.training.distill import encode_prompts, generate_batch


@torch.inference_mode()
def old_generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                       temperature: float = 0.0, generator: torch.Generator | None = None) -> list[Sequence]:
    """The loop distill used before issue 13: one left-padded prefill, rows leave the batch (and
    the KV cache, a full copy) at their stop token, per-row Python loops every step."""
    b, device = len(prompts), target.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = target.new_cache()
    out = target.forward(ids, cache, position_ids=positions, attention_mask=mask, logits_to_keep=1)
    feats = [[out.features[row, width - len(p):].cpu()] for row, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    stop = torch.tensor(sorted(stop_ids) or [-1], device=device)
    active = torch.arange(b, device=device)  # original row of each batch row
    logits, last_pos = out.logits[:, -1], positions[:, -1]
    for step in range(max_new_tokens):
        token = sample_tokens(logits, temperature, generator)
        for row, tok in zip(active.tolist(), token.tolist()):
            tokens[row].append(tok)
        keep = ~torch.isin(token, stop)
        if step == max_new_tokens - 1 or not bool(keep.any()):
            break
        if not bool(keep.all()):
            cache.batch_select_indices(keep.nonzero().squeeze(1))
            active, token, mask, last_pos = active[keep], token[keep], mask[keep], last_pos[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last_pos = last_pos + 1
        out = target.forward(token[:, None], cache, position_ids=last_pos[:, None], attention_mask=mask)
        for i, row in enumerate(active.tolist()):
            feats[row].append(out.features[i].cpu())
        logits = out.logits[:, -1]
    sequences = []
    for row, p in enumerate(prompts):
        f = torch.cat(feats[row])
        f = torch.cat([f, torch.zeros_like(f[:1])])
        sequences.append(Sequence(torch.tensor(p + tokens[row]), len(p), f))
    return sequences


def run_path(generate, target: Target, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
             stop: set[int]) -> tuple[dict[int, Sequence], float]:
    """Sequences by index into `prompts` (sorted by length, cut into batches, as distill does) and
    the seconds spent generating."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results, seconds = {}, 0.0
    for start in range(0, len(order), batch_size):
        batch = order[start: start + batch_size]
        t0 = time.perf_counter()
        seqs = generate(target, [prompts[i] for i in batch], max_new_tokens, stop)
        seconds += time.perf_counter() - t0
        results.update(zip(batch, seqs))
    return results, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="runs/cpu-small/models/target", help="HF folder of the target")
    parser.add_argument("--dtype", default="float32", help="target dtype (bf16 is ~7x slower on AVX2-only CPUs)")
    parser.add_argument("--data", default="runs/cpu-small/data/prepared/train.jsonl", help="training prompts")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64, help="new path's batch (distill.batch_size)")
    parser.add_argument("--old-batch-size", type=int, default=16, help="old path's batch (its params default)")
    parser.add_argument("--context-layers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype=args.dtype)
    target.set_layer_ids(context_layer_ids(target.num_layers, args.context_layers))
    prompts, _ = encode_prompts(target, read_jsonl(Path(args.data)), 384)
    prompts = prompts[: args.prompts]
    stop = set(target.stop_token_ids())

    block = max(args.batch_size, args.old_batch_size)
    old, new, old_s, new_s = {}, {}, 0.0, 0.0
    for start in range(0, len(prompts), block):  # alternate the paths block by block
        part = prompts[start: start + block]
        seqs, s = run_path(old_generate_batch, target, part, args.old_batch_size, args.max_new_tokens, stop)
        old.update({start + i: q for i, q in seqs.items()})
        old_s += s
        seqs, s = run_path(generate_batch, target, part, args.batch_size, args.max_new_tokens, stop)
        new.update({start + i: q for i, q in seqs.items()})
        new_s += s
        print(f"  prompts {start}-{start + len(part) - 1}: old {old_s:.1f} s, new {new_s:.1f} s", flush=True)

    same_tokens = sum(old[i].tokens.tolist() == new[i].tokens.tolist() for i in old)
    feature_diff = max([(old[i].features - new[i].features).abs().max().item()
                        for i in old if old[i].tokens.tolist() == new[i].tokens.tolist()], default=float("nan"))
    tokens = sum(s.response_len for s in old.values())
    new_tokens = sum(s.response_len for s in new.values())
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"\ntarget={args.target} dtype={args.dtype} threads={torch.get_num_threads()} prompts={len(prompts)} "
          f"(prompt tokens {prompt_tokens}) max_new_tokens={args.max_new_tokens} response tokens={tokens}")
    print("| path | batch | seconds | response tok/s |")
    print("|---|---|---|---|")
    print(f"| old loop | {args.old_batch_size} | {old_s:.1f} | {tokens / old_s:.1f} |")
    print(f"| generate_batch | {args.batch_size} | {new_s:.1f} | {new_tokens / new_s:.1f} |")
    identical = "yes" if same_tokens == len(old) else "no"
    print(f"ratio new/old: {new_tokens / new_s / (tokens / old_s):.2f}x; identical tokens: {identical} "
          f"({same_tokens}/{len(old)} sequences); max |feature diff| on those: {feature_diff:.2e}")


if __name__ == "__main__":
    main()
