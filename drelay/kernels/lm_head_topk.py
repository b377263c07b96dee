"""lm_head_topk: the drafter's LM head fused with a streaming top-k over the vocabulary (spec:
`lm_head_topk_ref`): the candidate pool and the log-softmax normaliser without the [N x V] logits.

Grid (row blocks, vocabulary splits). A program computes BLOCK_M x BLOCK_V logit tiles of its split
(tl.dot over H), folds each into a running top-k (k rounds of "take the largest, lowest index first,
remove it" over the tile and the running set) and a running max / Σexp. It writes k candidates and
(max, Σexp) per row and split; a few-kB torch merge (top-k of splits x k, log-sum-exp) finishes.
Splitting the vocabulary is what fills the GPU: a block has only B-1 = 15 positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drelay.kernels.launch import check, compute_dtype, interpreting, pow2


@triton.jit
def _lm_head_topk_kernel(x, w, part_vals, part_ids, part_max, part_sum, N, H, V, span, splits,
                         K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, split = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    slots = tl.arange(0, BLOCK_K)
    top_vals = tl.full([BLOCK_M, BLOCK_K], float("-inf"), ACC)
    top_ids = tl.full([BLOCK_M, BLOCK_K], 2147483647, tl.int32)
    run_max = tl.full([BLOCK_M], float("-inf"), ACC)
    run_sum = tl.zeros([BLOCK_M], ACC)
    start = split * span
    for v0 in range(start, tl.minimum(start + span, V), BLOCK_V):
        vocab = v0 + tl.arange(0, BLOCK_V)
        vocab_ok = vocab < V
        z = tl.zeros([BLOCK_M, BLOCK_V], ACC)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < H
            xt = tl.load(x + rows[:, None] * H + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            wt = tl.load(w + vocab[None, :].to(tl.int64) * H + hs[:, None], mask=vocab_ok[None, :] & h_ok[:, None],
                         other=0.0)  # (BLOCK_H, BLOCK_V) = W^T tile
            z = tl.dot(xt, wt, z, input_precision=PRECISION, out_dtype=ACC)
        z = tl.where(vocab_ok[None, :], z, float("-inf"))
        # running log-sum-exp parts
        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
        run_max = new_max
        # merge the tile into the running top-k: K rounds of taking the largest (lowest id on ties)
        tile_ids = tl.broadcast_to(vocab[None, :], [BLOCK_M, BLOCK_V])
        merged_vals = tl.full([BLOCK_M, BLOCK_K], float("-inf"), ACC)
        merged_ids = tl.full([BLOCK_M, BLOCK_K], 2147483647, tl.int32)
        for slot in tl.static_range(K):
            best = tl.maximum(tl.max(z, axis=1), tl.max(top_vals, axis=1))  # (BLOCK_M,)
            best_id = tl.minimum(tl.min(tl.where(z == best[:, None], tile_ids, 2147483647), axis=1),
                                 tl.min(tl.where(top_vals == best[:, None], top_ids, 2147483647), axis=1))
            merged_vals = tl.where(slots[None, :] == slot, best[:, None], merged_vals)
            merged_ids = tl.where(slots[None, :] == slot, best_id[:, None], merged_ids)
            z = tl.where(tile_ids == best_id[:, None], float("-inf"), z)
            top_vals = tl.where(top_ids == best_id[:, None], float("-inf"), top_vals)
        top_vals, top_ids = merged_vals, merged_ids
    out = (rows[:, None] * splits + split) * K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < K)
    tl.store(part_vals + out, top_vals, mask=keep)
    tl.store(part_ids + out, top_ids, mask=keep)
    tl.store(part_max + rows * splits + split, run_max, mask=row_ok)
    tl.store(part_sum + rows * splits + split, run_sum, mask=row_ok)


def launch_config(N: int, H: int, V: int, interpreted: bool):
    """BLOCK_M, BLOCK_H, BLOCK_V, vocabulary splits and the split's span (a multiple of BLOCK_V).

    Interpreter: big tiles, two splits (each interpreted op costs the same whatever its size).
    CUDA: 16 x 128 logits per tile (tl.dot's minimum M is 16), 64-wide steps over H, and ~4 tiles per
    program, so a 152K vocabulary makes ~300 programs for the H200's 132 SMs."""
    block_m, block_h, block_v = (pow2(N, 16), pow2(H, 16), 128) if interpreted else (16, 64, 128)
    tiles = triton.cdiv(V, block_v)
    splits = 2 if interpreted else max(1, tiles // 4)
    span = triton.cdiv(tiles, splits) * block_v
    return block_m, block_h, block_v, triton.cdiv(V, span), span


def lm_head_topk_logits(hidden: torch.Tensor, weight: torch.Tensor, k: int):
    """The fused pass on (N, H) rows: top-k logits (N, k) fp32 sorted descending, their ids (N, k) int64
    and lse (N,) fp32. `lm_head_topk` and `support_loss` share it."""
    check("hidden", hidden, (None, None))
    N, H = hidden.shape
    check("weight", weight, (None, H), hidden.dtype, hidden.device)
    V = weight.shape[0]
    if not 1 <= k <= V:
        raise ValueError(f"k must be in [1, V={V}], got {k}")
    block_m, block_h, block_v, splits, span = launch_config(N, H, V, interpreting())
    device = hidden.device
    part_vals = torch.empty(N, splits, k, dtype=torch.float32, device=device)
    part_ids = torch.empty(N, splits, k, dtype=torch.int32, device=device)
    part_max = torch.empty(N, splits, dtype=torch.float32, device=device)
    part_sum = torch.empty(N, splits, dtype=torch.float32, device=device)
    grid = (triton.cdiv(N, block_m), splits)
    _lm_head_topk_kernel[grid](hidden.contiguous(), weight.contiguous(), part_vals, part_ids, part_max, part_sum,
                               N, H, V, span, splits, K=k, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_V=block_v,
                               BLOCK_K=pow2(k), ACC=compute_dtype(hidden.dtype),
                               # fp32/fp64 inputs: exact products (tf32 would reorder near-tied candidates)
                               PRECISION="ieee" if hidden.dtype in (torch.float32, torch.float64) else "tf32",
                               num_warps=4)
    # merge the splits: (N, splits * k) candidates -> top k; log-sum-exp of the per-split parts
    vals, where = part_vals.view(N, -1).topk(k, dim=-1)
    ids = part_ids.view(N, -1).gather(1, where).long()
    top = part_max.max(dim=1).values
    lse = top + torch.log((part_sum * torch.exp(part_max - top[:, None])).sum(dim=1))
    return vals, ids, lse


def lm_head_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int):
    """Triton `lm_head_topk_ref`: pool_ids (..., k) int64, pool_logprobs (..., k) fp32, lse (...,) fp32."""
    if hidden.dim() < 1:
        raise ValueError(f"hidden must have shape (..., H), got {tuple(hidden.shape)}")
    lead = hidden.shape[:-1]
    vals, ids, lse = lm_head_topk_logits(hidden.reshape(-1, hidden.shape[-1]), weight, k)
    return ids.view(*lead, k), (vals - lse[:, None]).view(*lead, k), lse.view(lead)
