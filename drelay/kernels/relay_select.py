"""relay_select: DRelay's whole sequential selection of a block (GRU prefix state, candidate scores,
keep-or-replace with the repair margin δ) in one launch, one program per batch row (spec: `relay_select_ref`).

The torch loop pays B-1 steps of ~15 small ops each (~200 launches per block on CUDA); here each
program walks the block itself. The GRU state lives in a two-slot scratch row in global memory
(slot i%2 read, slot (i+1)%2 written, a barrier between), because Triton cannot index a register
vector: matrix-vector products read the whole state, the gate update works BLOCK_ROWS units at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drelay.kernels.launch import check, compute_dtype, interpreting, pow2
from drelay.kernels.reference import SelectorWeights


@triton.jit
def _matvec(w, rows, row_ok, cols, col_ok, ld, x, ACC: tl.constexpr):
    """(W[rows, cols] @ x[cols]) for a row-major W with leading dimension ld -> (len(rows),)."""
    tile = tl.load(w + rows[:, None] * ld + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    return tl.sum(tile.to(ACC) * x[None, :], axis=1)


@triton.jit
def _relay_select_kernel(start_gates, cand_gates, cand_hidden, cand_factor, logprobs, transition,
                         w_hh, b_hh, norm_w, norm_b, w_prefix, w_out, b_out, prefix_proj,
                         state, choice_out, sigma_out,
                         n, k, d, rank, repair_margin, eps, bilinear_scale,
                         BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BLOCK_RANK: tl.constexpr, HAS_BILINEAR: tl.constexpr, HAS_LOGPROBS: tl.constexpr,
                         HAS_TRANSITION: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < d
    cands = tl.arange(0, BLOCK_K)
    cand_ok = cands < k
    scratch = state + row * 2 * BLOCK_D
    tl.store(scratch + cols, tl.zeros([BLOCK_D], ACC))  # h_0 = 0 in slot 0
    tl.debug_barrier()
    gates = start_gates + row * 3 * d  # input gates of the token fed next (the anchor first)
    j = tl.zeros([], tl.int64)  # the previous choice (the anchor's lattice row at the first position)
    for i in range(n):
        old = scratch + (i % 2) * BLOCK_D
        new = scratch + ((i + 1) % 2) * BLOCK_D
        h = tl.load(old + cols, mask=col_ok, other=0.0)  # (BLOCK_D,)
        # GRU: h' = (1 - z) * tanh(i_n + r * (W_hn h + b_hn)) + z * h, r/z = sigmoid(i + W_h h + b_h)
        for u0 in range(0, d, BLOCK_ROWS):
            units = u0 + tl.arange(0, BLOCK_ROWS)
            ok = units < d
            h_r = _matvec(w_hh, units, ok, cols, col_ok, d, h, ACC) + tl.load(b_hh + units, mask=ok).to(ACC)
            h_z = _matvec(w_hh, d + units, ok, cols, col_ok, d, h, ACC) + tl.load(b_hh + d + units, mask=ok).to(ACC)
            h_n = _matvec(w_hh, 2 * d + units, ok, cols, col_ok, d, h, ACC) + tl.load(b_hh + 2 * d + units, mask=ok).to(ACC)
            reset = tl.sigmoid(tl.load(gates + units, mask=ok).to(ACC) + h_r)
            update = tl.sigmoid(tl.load(gates + d + units, mask=ok).to(ACC) + h_z)
            cand = 2 * tl.sigmoid(2 * (tl.load(gates + 2 * d + units, mask=ok).to(ACC) + reset * h_n)) - 1  # tanh
            h_unit = tl.load(old + units, mask=ok, other=0.0)
            tl.store(new + units, (1 - update) * cand + update * h_unit, mask=ok)
        tl.debug_barrier()
        # r_i = LayerNorm(h_i)
        h = tl.load(new + cols, mask=col_ok, other=0.0)
        mean = tl.sum(h, axis=0) / d
        diff = tl.where(col_ok, h - mean, 0.0)
        var = tl.sum(diff * diff, axis=0) / d
        r = diff / tl.sqrt(var + eps) * tl.load(norm_w + cols, mask=col_ok, other=0.0).to(ACC) \
            + tl.load(norm_b + cols, mask=col_ok, other=0.0).to(ACC)
        # σ_{i,j} = w_out·GELU(cand_hidden_{i,j} + W_prefix r) + b_out [+ <c_{i,j}, P r>/√R] [+ s_{i,j}]
        first = (row * n + i) * k  # flat index of candidate (row, i, 0)
        sigma = tl.zeros([BLOCK_K], ACC) + tl.load(b_out).to(ACC)
        for u0 in range(0, d, BLOCK_ROWS):
            units = u0 + tl.arange(0, BLOCK_ROWS)
            ok = units < d
            pre = _matvec(w_prefix, units, ok, cols, col_ok, d, r, ACC)  # (BLOCK_ROWS,)
            both = cand_ok[:, None] & ok[None, :]
            pre = tl.load(cand_hidden + (first + cands[:, None]) * d + units[None, :], mask=both, other=0.0).to(ACC) \
                + pre[None, :]
            gelu = 0.5 * pre * (1 + tl.math.erf(pre * 0.7071067811865476))
            w = tl.load(w_out + units, mask=ok, other=0.0).to(ACC)
            sigma += tl.sum(tl.where(both, gelu * w[None, :], 0.0), axis=1)
        if HAS_BILINEAR:
            ranks = tl.arange(0, BLOCK_RANK)
            rank_ok = ranks < rank
            q = _matvec(prefix_proj, ranks, rank_ok, cols, col_ok, d, r, ACC)  # (BLOCK_RANK,)
            c = tl.load(cand_factor + (first + cands[:, None]) * rank + ranks[None, :],
                        mask=cand_ok[:, None] & rank_ok[None, :], other=0.0).to(ACC)
            sigma += tl.sum(c * q[None, :], axis=1) * bilinear_scale
        if HAS_LOGPROBS:
            sigma += tl.load(logprobs + first + cands, mask=cand_ok, other=0.0).to(ACC)
        if HAS_TRANSITION:  # the lattice row of the previous choice: T[row, i, j*_{i-1}, :]
            sigma += tl.load(transition + (first + j) * k + cands, mask=cand_ok, other=0.0).to(ACC)
        tl.store(sigma_out + first + cands, sigma, mask=cand_ok)
        # keep the native (j = 0) unless the best alternative beats it by more than the repair margin δ
        alternatives = tl.where(cand_ok & (cands > 0), sigma, float("-inf"))
        best = tl.max(alternatives, axis=0)
        native = tl.sum(tl.where(cands == 0, sigma, 0.0), axis=0)
        j = tl.where(best - native > repair_margin, tl.argmax(alternatives, axis=0), 0)
        tl.store(choice_out + row * n + i, j.to(tl.int64))
        gates = cand_gates + (first + j) * 3 * d


def relay_select(start_gates: torch.Tensor, cand_gates: torch.Tensor, cand_hidden: torch.Tensor,
                 weights: SelectorWeights, cand_factor: torch.Tensor | None = None,
                 logprobs: torch.Tensor | None = None, repair_margin: float = 0.0,
                 transition: torch.Tensor | None = None):
    """Triton `relay_select_ref`: choice (b, n) int64 and σ (b, n, k)."""
    check("cand_hidden", cand_hidden, (None, None, None, None))
    b, n, k, d = cand_hidden.shape
    dtype, device = cand_hidden.dtype, cand_hidden.device
    check("start_gates", start_gates, (b, 3 * d), dtype, device)
    check("cand_gates", cand_gates, (b, n, k, 3 * d), dtype, device)
    check("weights.w_hh", weights.w_hh, (3 * d, d), dtype, device)
    check("weights.b_hh", weights.b_hh, (3 * d,), dtype, device)
    check("weights.norm_weight", weights.norm_weight, (d,), dtype, device)
    check("weights.norm_bias", weights.norm_bias, (d,), dtype, device)
    check("weights.w_prefix", weights.w_prefix, (d, d), dtype, device)
    check("weights.w_out", weights.w_out, (1, d), dtype, device)
    check("weights.b_out", weights.b_out, (1,), dtype, device)
    rank = 0
    if cand_factor is not None:
        rank = cand_factor.shape[-1]
        check("cand_factor", cand_factor, (b, n, k, rank), dtype, device)
        check("weights.prefix_proj", weights.prefix_proj, (rank, d), dtype, device)
    if logprobs is not None:
        check("logprobs", logprobs, (b, n, k), dtype, device)
    if transition is not None:
        check("transition", transition, (b, n, k, k), dtype, device)
    block_d = pow2(d)
    choice = torch.empty(b, n, dtype=torch.long, device=device)
    sigma = torch.empty(b, n, k, dtype=dtype, device=device)
    scratch = torch.empty(b, 2, block_d, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                          device=device)
    dummy = cand_hidden  # stands in for absent optional pointers (never read)
    # Interpreter: one row chunk (fewer interpreted ops). CUDA: 32 rows x d columns per tile keeps a
    # tile at 64 fp32 registers per thread for d = 256 with 4 warps.
    rows = block_d if interpreting() else min(block_d, 32)
    _relay_select_kernel[(b,)](
        start_gates.contiguous(), cand_gates.contiguous(), cand_hidden.contiguous(),
        dummy if cand_factor is None else cand_factor.contiguous(),
        dummy if logprobs is None else logprobs.contiguous(),
        dummy if transition is None else transition.contiguous(),
        weights.w_hh.contiguous(), weights.b_hh.contiguous(), weights.norm_weight.contiguous(),
        weights.norm_bias.contiguous(), weights.w_prefix.contiguous(), weights.w_out.contiguous(),
        weights.b_out.contiguous(), dummy if weights.prefix_proj is None else weights.prefix_proj.contiguous(),
        scratch, choice, sigma, n, k, d, rank, float(repair_margin), float(weights.norm_eps),
        1.0 / rank ** 0.5 if rank else 0.0,
        BLOCK_D=block_d, BLOCK_K=pow2(k), BLOCK_ROWS=rows, BLOCK_RANK=pow2(rank),
        HAS_BILINEAR=rank > 0, HAS_LOGPROBS=logprobs is not None, HAS_TRANSITION=transition is not None,
        ACC=compute_dtype(dtype),
        num_warps=4,
    )
    return choice, sigma
