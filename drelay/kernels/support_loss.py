"""support_loss: training's vocabulary-sized terms (DFlash CE + the top-k support hinge + the detached
candidate pool) from the normed hidden states and the LM head, without the [N x V] logits (spec:
`support_loss_ref`; Liger-style fused linear cross-entropy, chunked over the vocabulary).

forward : the fused `lm_head_topk` pass with k+1 candidates gives lse, the pool and the hinge's
          threshold z_(k) (the k-th largest logit other than the label); z_y is one dot product a row.
backward: dL/dz = a·softmax(z) - (a + h)·1[y] + h·1[(k)] per row (a: the row's CE weight, h: the
          hinge's sigmoid), rebuilt one vocabulary chunk at a time: logits chunk (torch matmul),
          gradient in place (`_support_grad_kernel`), dx += dz @ W_chunk, dW_chunk = dz^T x.
Memory: O(N·chunk) instead of O(N·V) (see benchmarks/kernels.py --memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from drelay.kernels.launch import check, interpreting, pow2
from drelay.kernels.lm_head_topk import lm_head_topk_logits
from drelay.data.records import IGNORE
from drelay.kernels.reference import mean_denominator, position_weights

CUDA_CHUNK = 8192  # vocabulary columns per backward step on CUDA: N x 8192 fp32 logits at a time


@triton.jit
def _support_grad_kernel(z, lse, softmax_coef, label, label_coef, rival, rival_coef, N, C, v0,
                         BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """z (N, C) logits of vocabulary ids v0..v0+C-1 -> dL/dz in place."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols[None, :] < C)
    ptr = z + rows[:, None].to(tl.int64) * C + cols[None, :]
    logits = tl.load(ptr, mask=ok, other=0.0)
    grad = tl.load(softmax_coef + rows, mask=row_ok, other=0.0)[:, None] * \
        tl.exp(logits - tl.load(lse + rows, mask=row_ok, other=0.0)[:, None])
    ids = v0 + cols[None, :]
    grad += tl.where(ids == tl.load(label + rows, mask=row_ok, other=-1)[:, None],
                     tl.load(label_coef + rows, mask=row_ok, other=0.0)[:, None], 0.0)
    grad += tl.where(ids == tl.load(rival + rows, mask=row_ok, other=-1)[:, None],
                     tl.load(rival_coef + rows, mask=row_ok, other=0.0)[:, None], 0.0)
    tl.store(ptr, grad, mask=ok)


class _SupportLoss(torch.autograd.Function):
    """(N, H) rows: ce, hinge (scalars, differentiable in hidden and weight), pool_ids, pool_logprobs."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, hinge_weights, k: int, hinge_margin: float, chunk: int):
        vals, ids, lse = lm_head_topk_logits(hidden, weight, k + 1)  # (N, k+1) sorted, (N,)
        valid = labels != IGNORE
        y = labels.clamp(min=0)
        z_y = (hidden.float() * weight[y].float()).sum(-1)  # (N,)
        # the k-th largest competitor: column k when the label is among the top k, else column k-1
        col = torch.where((ids[:, :k] == y[:, None]).any(-1), k, k - 1)[:, None]
        z_rival, rival = vals.gather(1, col).squeeze(1), ids.gather(1, col).squeeze(1)
        w = row_weights * valid
        hw = hinge_weights * valid
        w_sum, hw_sum = mean_denominator(w.sum(), 1e-8), mean_denominator(hw.sum(), 1e-8)
        ce = ((lse - z_y) * w).sum() / w_sum
        gap = z_rival - z_y + hinge_margin
        hinge = (F.softplus(gap) * hw).sum() / hw_sum
        ctx.save_for_backward(hidden, weight, y, rival, lse, w / w_sum, torch.sigmoid(gap) * hw / hw_sum)
        ctx.chunk = chunk
        pool_ids, pool_logprobs = ids[:, :k], vals[:, :k] - lse[:, None]
        ctx.mark_non_differentiable(pool_ids, pool_logprobs)
        return ce, hinge, pool_ids, pool_logprobs

    @staticmethod
    def backward(ctx, grad_ce, grad_hinge, _ids, _logprobs):
        hidden, weight, y, rival, lse, ce_coef, hinge_coef = ctx.saved_tensors
        softmax_coef = (ce_coef * grad_ce).float().contiguous()
        rival_coef = (hinge_coef * grad_hinge).float().contiguous()
        label_coef = (-softmax_coef - rival_coef).contiguous()
        y, rival, lse = y.int().contiguous(), rival.int().contiguous(), lse.contiguous()
        N, V = hidden.shape[0], weight.shape[0]
        want_x, want_w = ctx.needs_input_grad[:2]
        grad_x = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_x else None
        grad_w = torch.empty_like(weight) if want_w else None
        block_n, block_c = (pow2(N), pow2(ctx.chunk)) if interpreting() else (32, 256)
        for v0 in range(0, V, ctx.chunk):
            w_chunk = weight[v0: v0 + ctx.chunk]
            z = (hidden @ w_chunk.T).float().contiguous()  # (N, C): the only vocabulary-sized buffer
            C = z.shape[1]
            grid = (triton.cdiv(N, block_n), triton.cdiv(C, block_c))
            _support_grad_kernel[grid](z, lse, softmax_coef, y, label_coef, rival, rival_coef, N, C, v0,
                                       BLOCK_N=block_n, BLOCK_C=block_c)
            if want_x:
                grad_x += z @ w_chunk.float()
            if want_w:
                grad_w[v0: v0 + ctx.chunk] = (z.T @ hidden.float()).to(weight.dtype)
        return (grad_x.to(hidden.dtype) if want_x else None), grad_w, None, None, None, None, None, None


def support_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, k: int, gamma: float,
                 hinge_margin: float = 1.0, hinge_gamma: float | None = None, chunk_size: int | None = None):
    """Triton `support_loss_ref`: ce, hinge (scalars), pool_ids (..., n, k) int64, pool_logprobs (..., n, k).

    chunk_size: vocabulary columns per backward step (default 8192 on CUDA: N x 8192 fp32 logits)."""
    if hidden.dim() < 2:
        raise ValueError(f"hidden must have shape (..., n, H), got {tuple(hidden.shape)}")
    check("labels", labels, tuple(hidden.shape[:-1]), device=hidden.device)
    V = weight.shape[0]
    if not 1 <= k < V:
        raise ValueError(f"k must be in [1, V-1={V - 1}], got {k}")
    chunk = chunk_size or (256 if interpreting() else CUDA_CHUNK)
    n = labels.shape[-1]
    row_weights = position_weights(n, gamma, labels.device).expand(labels.shape).reshape(-1)
    hinge_weights = (torch.ones_like(row_weights) if hinge_gamma is None
                     else position_weights(n, hinge_gamma, labels.device).expand(labels.shape).reshape(-1))
    ce, hinge, pool_ids, pool_logprobs = _SupportLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                            labels.reshape(-1), row_weights, hinge_weights, k,
                                                            hinge_margin, chunk)
    lead = labels.shape
    return ce, hinge, pool_ids.view(*lead, k), pool_logprobs.view(*lead, k)
