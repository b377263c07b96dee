"""Distillation: the target regenerates responses to the training prompts, and the context
features the drafter learns from are captured during that same generation (no second pass).

Each sequence is stored as its token ids (prompt + response), the prompt length, and the raw
outputs of the drafter's context layers at every position (the last position's row is zeros: its
features are never needed, since a block anchored at position a reads positions < a). Sequences
go into shards of `shard_size`; a shard is written atomically, so a killed run resumes from the
last complete shard.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from drelay.data.records import MANIFEST, SETTINGS, Sequence, save_shard, summarize
from drelay.decoding.verify import sample_tokens
from drelay.models.target import Target, resolve_dtype


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> list[Sequence]:
    """Batched generation with left padding, capturing context features for every fed token.

    Rows that hit a stop token leave the batch (and the KV cache), so the remaining steps only
    pay for the rows still generating.
    """
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
        f = torch.cat(feats[row])  # positions 0 .. T-2 (the last token is never fed)
        f = torch.cat([f, torch.zeros_like(f[:1])])  # row T-1: never read
        sequences.append(Sequence(torch.tensor(p + tokens[row]), len(p), f))
    return sequences


def distill(target: Target, prompts: list[list[int]], out_dir: str | Path, *, max_new_tokens: int,
            batch_size: int, shard_size: int, temperature: float = 0.0, feature_dtype: str = "bfloat16",
            seed: int = 0, stop_ids: Iterable[int] = (), settings: dict | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Generate responses for `prompts` (token ids, chat template applied) into shards.

    Shards already on disk are kept (resume) when they were made with the same `settings`
    (params, target fingerprint, prompts); otherwise the folder is cleared first. Within a shard,
    prompts are batched by length to waste little on padding. Returns counts and throughput.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {**(settings or {}), "max_new_tokens": max_new_tokens, "shard_size": shard_size,
                "temperature": temperature, "feature_dtype": feature_dtype, "seed": seed,
                "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]}
    settings_path = out_dir / SETTINGS
    if settings_path.is_file() and json.loads(settings_path.read_text()) != settings:
        for old in out_dir.iterdir():  # made with other settings: not resumable
            old.unlink()
    # unlink first: DVC may have hard-linked the file to its cache, which must not change in place
    settings_path.unlink(missing_ok=True)
    settings_path.write_text(json.dumps(settings, indent=2, sort_keys=True))
    for stale in out_dir.glob("*.partial"):
        stale.unlink()
    (out_dir / MANIFEST).unlink(missing_ok=True)
    fdtype = resolve_dtype(feature_dtype)
    stop = set(stop_ids)
    shards, reused, gen_tokens, gen_seconds = [], 0, 0, 0.0
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    for index in range(n_shards):
        name = f"shard_{index:05d}.safetensors"
        shards.append(name)
        path = out_dir / name
        chunk = prompts[index * shard_size: (index + 1) * shard_size]
        if path.is_file():
            reused += 1
            if progress:
                progress(len(chunk), 0)
            continue
        generator = torch.Generator(device=target.device).manual_seed(seed * 100_003 + index)
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))
        results: dict[int, Sequence] = {}
        for start in range(0, len(order), batch_size):
            batch = order[start: start + batch_size]
            t0 = time.perf_counter()
            seqs = generate_batch(target, [chunk[i] for i in batch], max_new_tokens, stop, temperature, generator)
            gen_seconds += time.perf_counter() - t0
            for i, seq in zip(batch, seqs):
                results[i] = seq
                gen_tokens += seq.response_len
            if progress:
                progress(len(batch), sum(s.response_len for s in seqs))
        save_shard([results[i] for i in range(len(chunk))], path, fdtype)
    summary = summarize(out_dir, shards)
    summary.update({"shards_reused": reused, "generated_tokens_this_run": gen_tokens,
                    "generation_tokens_per_s": gen_tokens / gen_seconds if gen_seconds else 0.0})
    (out_dir / MANIFEST).write_text(json.dumps({"shards": shards, **summary}, indent=2))
    return summary


def encode_prompts(target: Target, records: list[dict], max_prompt_tokens: int) -> tuple[list[list[int]], int]:
    """Chat-template token ids of prompt records ({"messages": [...]}); drops over-long ones."""
    kept, dropped = [], 0
    for record in records:
        ids = target.encode_chat(record["messages"])
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        kept.append(ids)
    return kept, dropped
