"""Distillation: the target regenerates responses to the training prompts, and the context
features the drafter learns from are captured during that same generation (no second pass).

Each sequence is stored as its token ids (prompt + response), the prompt length, and the raw
outputs of the drafter's context layers at every position (the last position's row is zeros: its
features are never needed, since a block anchored at position a reads positions < a). Sequences
go into shards of `shard_size`; a shard is written atomically, so a killed run resumes from the
last complete shard.

Under torchrun (several processes, drelay/training/distributed.py) shard i is made by rank
i % world_size: each rank writes its own shards, and the shards are the very ones one process writes
(same prompts, batches and seeds per shard), so a run resumes whatever the number of processes.
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
from drelay.training import distributed


# Prompt tokens (rows x padded width) per prefill forward. Rows are prefilled in length-sorted groups
# up to this size, so a batch of mixed lengths pays little padding. Measured on 64 training prompts
# (SmolLM2, fp32, 1 thread): groups of 2048 tokens fed 5996 (padded) tokens in 70 s, 512: 5234 in
# 54 s, 256: 5101 in 54 s. A ~500-row matmul is already as efficient as a bigger one.
PREFILL_TOKENS = 512
# Finished rows stay in the batch (their outputs are ignored) until dropping them pays: one dropped
# row saves 1/rows of a step per remaining step, and dropping copies the whole KV cache, measured at
# about one decode step (64 rows x 240 tokens). So drop when dead_rows * steps_left >= this * rows.
COMPACT_COST_STEPS = 2.0


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> list[Sequence]:
    """Batched generation capturing the context features of every fed token; at T=0 each row's tokens
    and features are those of generating it alone (up to float rounding), whatever the other rows.

    The prompts' common prefix (the chat template's system turn) is computed once; the rest is
    prefilled in length-sorted groups (PREFILL_TOKENS), then all rows decode together, left-padded
    after the prefix. Tokens and features go into preallocated tensors, split once at the end.
    """
    if not prompts:
        return []
    b, device = len(prompts), target.device
    cache, prompt_mask, prompt_features, logits = _prefill(target, prompts)
    width = prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, prompt_mask.new_ones((b, max_new_tokens - 1))], dim=1)  # (b, width + new - 1)
    last_pos = torch.tensor([len(p) - 1 for p in prompts], device=device)
    stop = torch.tensor(sorted(stop_ids) or [-1], device=device)
    new_tokens = torch.zeros((b, max_new_tokens), dtype=torch.long, device=device)
    feature_width = prompt_features[0].shape[-1]
    new_features = logits.new_zeros((b, max_new_tokens - 1, feature_width))  # of the fed new tokens
    done = torch.zeros(b, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device)  # original row of each batch row
    steps = 0
    for step in range(max_new_tokens):
        token = sample_tokens(logits, temperature, generator)  # (rows,)
        new_tokens[rows, step] = token  # rows already done write past their stop token: ignored
        done[rows] |= torch.isin(token, stop)
        steps = step + 1
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        dead = done[rows]
        n_dead = int(dead.sum())
        if n_dead and n_dead * (max_new_tokens - 1 - step) >= COMPACT_COST_STEPS * len(rows):
            keep = (~dead).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, token, mask, last_pos = rows[keep], token[keep], mask[keep], last_pos[keep]
        last_pos = last_pos + 1
        out = target.forward(token[:, None], cache, position_ids=last_pos[:, None],
                             attention_mask=mask[:, : width + step + 1])
        if feature_width:
            new_features[rows, step] = out.features[:, 0]
        logits = out.logits[:, -1]
    # a row's response ends at its first stop token (or after `steps` tokens)
    is_stop = torch.isin(new_tokens[:, :steps], stop)
    lengths = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, steps).tolist()
    new_tokens, new_features = new_tokens.cpu(), new_features.cpu()
    sequences = []
    for row, (p, n) in enumerate(zip(prompts, lengths)):
        f = torch.cat([prompt_features[row].cpu(), new_features[row, : n - 1],  # every fed position
                       new_features.new_zeros((1, feature_width))])  # the last token: never fed
        sequences.append(Sequence(torch.cat([torch.tensor(p), new_tokens[row, :n]]), len(p), f))
    return sequences


def _prefill(target: Target, prompts: list[list[int]]):
    """Prefill every prompt: the common prefix (P tokens) once, then each row's rest in length-sorted
    groups. Returns the batch's KV cache laid out per row as [prefix | left padding | rest], its
    attention mask (b, P + W) for W the longest rest, each row's prompt features (len, F), and the
    last prompt position's logits (b, V)."""
    b, device = len(prompts), target.device
    shared = min(len(p) for p in prompts) - 1  # every row keeps >= 1 token of its own: its logits
    for p in prompts[1:]:
        shared = next((i for i in range(shared) if p[i] != prompts[0][i]), shared)
    rests = [p[shared:] for p in prompts]
    width = max(len(r) for r in rests)
    prefix = target.new_cache()
    if shared:
        out = target.forward(torch.tensor([prompts[0][:shared]], device=device), prefix, logits_to_keep=1)
        prefix_features = _features(out, shared)[0]  # (P, F)
    order = sorted(range(b), key=lambda i: len(rests[i]))
    groups, start = [], 0
    while start < b:  # sorted: a group's width is the length of its last (longest) rest
        end = start + 1
        while end < b and (end + 1 - start) * len(rests[order[end]]) <= PREFILL_TOKENS:
            end += 1
        groups.append(order[start:end])
        start = end
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    features: list[torch.Tensor | None] = [None] * b
    logits = None
    for group in groups:
        g, w = len(group), max(len(rests[i]) for i in group)
        ids = torch.zeros((g, w), dtype=torch.long)
        mask = torch.zeros((g, w), dtype=torch.long)
        for j, i in enumerate(group):
            ids[j, w - len(rests[i]):] = torch.tensor(rests[i])
            mask[j, w - len(rests[i]):] = 1
        ids, mask = ids.to(device), mask.to(device)
        cache = target.new_cache()
        for layer_id, layer in enumerate(prefix.layers if shared else ()):
            cache.update(layer.keys.expand(g, *layer.keys.shape[1:]),
                         layer.values.expand(g, *layer.values.shape[1:]), layer_id)
        out = target.forward(ids, cache, position_ids=shared + (mask.cumsum(-1) - 1).clamp(min=0),
                             attention_mask=torch.cat([mask.new_ones((g, shared)), mask], dim=1),
                             logits_to_keep=1)
        index = torch.tensor(group, device=device)
        for layer_id, layer in enumerate(cache.layers):
            if len(keys) <= layer_id:  # (b, kv heads, P + W, head dim), zeros where padded
                keys.append(layer.keys.new_zeros((b, *layer.keys.shape[1:-2], shared + width, layer.keys.shape[-1])))
                values.append(layer.values.new_zeros(keys[-1].shape[:-1] + layer.values.shape[-1:]))
            keys[layer_id][index, ..., :shared, :] = layer.keys[..., :shared, :]
            keys[layer_id][index, ..., shared + width - w:, :] = layer.keys[..., shared:, :]
            values[layer_id][index, ..., :shared, :] = layer.values[..., :shared, :]
            values[layer_id][index, ..., shared + width - w:, :] = layer.values[..., shared:, :]
        group_features = _features(out, w)
        for j, i in enumerate(group):
            f = group_features[j, w - len(rests[i]):]
            features[i] = torch.cat([prefix_features, f]) if shared else f
        if logits is None:
            logits = out.logits.new_zeros((b, out.logits.shape[-1]))
        logits[index] = out.logits[:, -1]
    cache = target.new_cache()
    for layer_id, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer_id)
    mask = torch.ones((b, shared + width), dtype=torch.long, device=device)
    for i, rest in enumerate(rests):
        mask[i, shared: shared + width - len(rest)] = 0
    return cache, mask, features, logits


def _features(out, width: int) -> torch.Tensor:
    """(rows, width, F) context features of a forward; F = 0 when the target captures no layers."""
    if out.features is not None:
        return out.features
    return out.logits.new_zeros((out.logits.shape[0], width, 0))


def distill(target: Target, prompts: list[list[int]], out_dir: str | Path, *, max_new_tokens: int,
            batch_size: int, shard_size: int, temperature: float = 0.0, feature_dtype: str = "bfloat16",
            seed: int = 0, stop_ids: Iterable[int] = (), settings: dict | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Generate responses for `prompts` (token ids, chat template applied) into shards.

    Shards already on disk are kept (resume) when they were made with the same `settings`
    (params, target fingerprint, prompts); otherwise the folder is cleared first. Within a shard,
    prompts are batched by length to waste little on padding. Returns counts and throughput.
    Under torchrun every rank calls it with the same arguments and makes its own shards (see the module
    docstring); rank 0 prepares the folder and writes the manifest, and the counts are the whole run's.
    """
    out_dir = Path(out_dir)
    rank, world = distributed.rank(), distributed.world_size()
    if rank == 0:
        _prepare_folder(out_dir, settings, max_new_tokens=max_new_tokens, shard_size=shard_size,
                        temperature=temperature, feature_dtype=feature_dtype, seed=seed, prompts=prompts)
    distributed.barrier()  # the folder is ready (cleared or resumed) before any rank writes a shard
    fdtype = resolve_dtype(feature_dtype)
    stop = set(stop_ids)
    shards, reused, gen_tokens, gen_seconds = [], 0, 0, 0.0
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    for index in range(n_shards):
        name = f"shard_{index:05d}.safetensors"
        shards.append(name)
        if index % world != rank:  # another rank's shard
            continue
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
    # the whole run's counts; these collectives also wait until every rank's shards are on disk
    reused, gen_tokens = (int(n) for n in distributed.sum_numbers(reused, gen_tokens))
    (gen_seconds,) = distributed.max_numbers(gen_seconds)  # the ranks generate side by side
    if rank != 0:
        return {"shards_reused": reused, "generated_tokens_this_run": gen_tokens}
    summary = summarize(out_dir, shards)
    # the manifest holds only what the shards determine, so the same sequences give the same folder hash
    # (DVC then skips the stages downstream of an unchanged re-distillation); this run's counts and speed are
    # returned for the metrics
    (out_dir / MANIFEST).write_text(json.dumps({"shards": shards, **summary}, indent=2))
    return {**summary, "shards_reused": reused, "generated_tokens_this_run": gen_tokens,
            "generation_tokens_per_s": gen_tokens / gen_seconds if gen_seconds else 0.0}


def shard_prompts(n_prompts: int, shard_size: int, rank: int | None = None, world: int | None = None) -> int:
    """How many of `n_prompts` prompts `rank` (default: this process) distils: those of its shards."""
    rank = distributed.rank() if rank is None else rank
    world = distributed.world_size() if world is None else world
    n_shards = (n_prompts + shard_size - 1) // shard_size
    return sum(min(shard_size, n_prompts - i * shard_size) for i in range(rank, n_shards, world))


def _prepare_folder(out_dir: Path, settings: dict | None, *, max_new_tokens: int, shard_size: int,
                    temperature: float, feature_dtype: str, seed: int, prompts: list[list[int]]) -> None:
    """The output folder made ready: cleared when its shards were made with other settings (else they are
    kept for resuming), the settings written, stale partial shards and the old manifest removed."""
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
