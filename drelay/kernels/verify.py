"""verify: acceptance of one verified block straight from the target's logits, one program per batch
row (spec: `verify_ref`).

Greedy (T = 0): row i's argmax is computed only while the prefix still matches (rows after the
first mismatch are never read), then the argmax after the prefix is the next token.
Sampling (T > 0, the residual rule): each row's softmax normaliser in one streaming pass (float64,
as `target_probs`), d_i accepted while u_i < p(d_i), then one pass over the row after the prefix
for argmax_x p'(x) / q(x), the draw from the residual p' with the given Exp(1) noise q.
No [b, n+1, V] probability tensor is materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drelay.kernels.launch import check, compute_dtype, interpreting


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr, ACC: tl.constexpr):
    """First index of the row's maximum, streamed over the vocabulary (ties go to the lower index)."""
    best = tl.full([], float("-inf"), ACC)
    best_idx = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(ACC)
        m = tl.max(x, axis=0)
        take = m > best
        best_idx = tl.where(take, tl.argmax(x, axis=0) + v0, best_idx)
        best = tl.where(take, m, best)
    return best_idx


@triton.jit
def _row_softmax_stats(row_ptr, V, temperature, BLOCK_V: tl.constexpr):
    """max and Σ exp(x - max) of x = logits / T over the row (float64, online rescaling)."""
    m = tl.full([], float("-inf"), tl.float64)
    s = tl.full([], 0.0, tl.float64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float64) / temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, s


@triton.jit
def _verify_kernel(draft, logits, temperature_ptr, accept_u, noise, accept_out, next_out, n, V,
                   SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    rows = logits + row.to(tl.int64) * (n + 1) * V
    accept = row * 0  # accepted draft tokens so far (int32 scalar)
    token = row * 0  # the last row's pick: the next token once the loop ends
    if SAMPLE:
        temperature = tl.load(temperature_ptr)
        m_last = tl.full([], 0.0, tl.float64)
        s_last = tl.full([], 1.0, tl.float64)
    for i in range(n + 1):
        if accept == i:  # rows after the first rejection are never read
            d = tl.load(draft + row * n + i, mask=i < n, other=-1).to(tl.int32)
            if SAMPLE:
                m, s = _row_softmax_stats(rows + i * V, V, temperature, BLOCK_V)
                x_d = tl.load(rows + i * V + tl.maximum(d, 0)).to(tl.float64) / temperature
                u = tl.load(accept_u + row * n + i, mask=i < n, other=2.0)
                hit = (i < n) & (u < tl.exp(x_d - m) / s)
                m_last = m
                s_last = s
                token = d
            else:
                token = _row_argmax(rows + i * V, V, BLOCK_V, ACC)
                hit = token == d
            accept = tl.where(hit, accept + 1, accept)
    if SAMPLE:
        # draw from p after the prefix, without the rejected token (token = d_a, or -1 after a full accept)
        last = rows + accept * V
        best = tl.full([], -1.0, tl.float64)
        best_idx = tl.full([], 0, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            ok = offs < V
            x = tl.load(last + offs, mask=ok, other=0.0).to(tl.float64) / temperature
            p = tl.where(offs == token, 0.0, tl.exp(x - m_last) / s_last)
            ratio = tl.where(ok, p / tl.load(noise + row * V + offs, mask=ok, other=1.0), -1.0)
            m = tl.max(ratio, axis=0)
            take = m > best
            best_idx = tl.where(take, tl.argmax(ratio, axis=0) + v0, best_idx)
            best = tl.where(take, m, best)
        # no mass left besides the rejected token (only through rounding): p itself, whose draw is that token
        token = tl.where(best > 0, best_idx, token)
    tl.store(accept_out + row, accept.to(tl.int64))
    tl.store(next_out + row, token.to(tl.int64))


def verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor, temperature: float = 0.0,
           accept_uniforms: torch.Tensor | None = None, noise: torch.Tensor | None = None):
    """Triton `verify_ref`: accept_len (b,), next_token (b,) int64."""
    check("draft_tokens", draft_tokens, (None, None))
    b, n = draft_tokens.shape
    check("target_logits", target_logits, (b, n + 1, None), device=draft_tokens.device)
    V = target_logits.shape[-1]
    device = target_logits.device
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sample = temperature > 0
    if sample:
        check("accept_uniforms", accept_uniforms, (b, n), device=device)
        check("noise", noise, (b, V), device=device)
    accept_len = torch.empty(b, dtype=torch.long, device=device)
    next_token = torch.empty(b, dtype=torch.long, device=device)
    temp = torch.tensor([temperature if sample else 1.0], dtype=torch.float64, device=device)
    _verify_kernel[(b,)](
        draft_tokens.contiguous(), target_logits.contiguous(), temp,
        accept_uniforms.double().contiguous() if sample else temp,
        noise.double().contiguous() if sample else temp,
        accept_len, next_token, n, V,
        SAMPLE=sample, ACC=compute_dtype(target_logits.dtype),
        # CUDA: 4K-wide chunks stream a 152K-vocab row in ~40 steps; the interpreter likes fewer, wider ones
        BLOCK_V=min(triton.next_power_of_2(V), 8192 if interpreting() else 4096),
        num_warps=8,
    )
    return accept_len, next_token
