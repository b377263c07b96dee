"""Pure-torch definitions of DRelay's ops: the spec every Triton kernel is tested against, and the code
the CPU runs. Training imports its vocabulary-sized losses from here; the acceptance rules are in `acceptance.py`.

Every fused op `<op>_ref` has a Triton twin `drelay/kernels/<op>.py:<op>` with the same signature
and outputs; `drelay.kernels.ops.kernel_ops(device)` picks one set of them once (DRELAY_KERNELS).
Imports only torch and drelay.data.records: importing the spec loads no model library.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from drelay.data.records import IGNORE
from drelay.kernels.acceptance import greedy_accept, residual_accept, target_probs  # noqa: F401 (the spec)


# ----------------------------------------------------------------------------- acceptance rules
# greedy_accept, target_probs and residual_accept live in `acceptance.py` (the verify-only stages' dependency).


# ------------------------------------------------------------------------------------ losses
# Every loss here is a weighted mean over a batch, numerator / denominator. Under data parallelism each
# rank holds a slice of the global batch and DDP averages the ranks' gradients, so a rank's mean must
# divide by the GLOBAL denominator (times the number of ranks): then the average of the ranks'
# gradients is the gradient of the global batch's mean, exactly as one process computes it.
_BATCH_SHARD: ContextVar[tuple[int, Callable[[torch.Tensor], torch.Tensor]] | None] = ContextVar(
    "drelay_batch_shard", default=None)


@contextmanager
def batch_shard(world_size: int, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside the block the batch means (`mean_denominator`) are those of a global batch split over
    `world_size` ranks; `sum_over_ranks(t)` sums a tensor over them (an all-reduce)."""
    token = _BATCH_SHARD.set((world_size, sum_over_ranks))
    try:
        yield
    finally:
        _BATCH_SHARD.reset(token)


def mean_denominator(total_weight: torch.Tensor, floor: float) -> torch.Tensor:
    """The denominator of a batch mean: `total_weight.clamp(min=floor)`; inside `batch_shard`, the total
    over every rank, clamped, divided by the world size (see the comment above)."""
    shard = _BATCH_SHARD.get()
    if shard is None:
        return total_weight.clamp(min=floor)
    world, sum_over_ranks = shard
    return sum_over_ranks(total_weight.detach()).clamp(min=floor) / world


def position_weights(num_positions: int, gamma: float, device=None) -> torch.Tensor:
    """w_i = exp(-(i-1)/gamma) for block positions i = 1..B-1: early positions matter most,
    because a miss there discards everything after it."""
    return torch.exp(-torch.arange(num_positions, device=device, dtype=torch.float32) / gamma)


def dflash_ce(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (..., B-1, V), labels (..., B-1) -> (weighted mean CE, per-position CE (..., B-1))."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE,
                         reduction="none").view(labels.shape)
    weights = position_weights(labels.shape[-1], gamma, labels.device) * (labels != IGNORE)
    return (ce * weights).sum() / mean_denominator(weights.sum(), 1e-8), ce


def support_hinge(logits: torch.Tensor, labels: torch.Tensor, k: int, hinge_margin: float = 1.0,
                  gamma: float | None = None) -> torch.Tensor:
    """mean softplus(z_(k) - z_y + hinge_margin): z_(k) is the k-th largest logit among the competitors
    (the label excluded), so z_y > z_(k) means y is inside the top-k pool. logits (..., n, V), labels
    (..., n). gamma: the mean weighted by position, exp(-(i-1)/gamma) as the CE (None: plain mean)."""
    valid = labels != IGNORE
    if gamma is not None:
        valid = position_weights(labels.shape[-1], gamma, labels.device) * valid
    y = labels.clamp(min=0)[..., None]  # (..., 1)
    z = logits.float()
    z_y = z.gather(-1, y).squeeze(-1)
    competitors = z.scatter(-1, y, float("-inf"))  # (..., V) without the label
    z_k = competitors.topk(k, dim=-1).values[..., k - 1]
    loss = F.softplus(z_k - z_y + hinge_margin) * valid
    return loss.sum() / mean_denominator(valid.sum(), 1 if gamma is None else 1e-8)


def pool_index(pool_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pool_ids (..., k), labels (...) -> (index of the label in the pool (0 where absent), in_pool);
    IGNORE labels are never in the pool."""
    match = pool_ids == labels[..., None]  # (..., k)
    return match.long().argmax(-1), match.any(-1) & (labels != IGNORE)


# ------------------------------------------------------------------------------- relay_select
@dataclass(frozen=True)
class SelectorWeights:
    """The GRU causal selector's weights as plain tensors (d = reader width, R = bilinear rank)."""

    w_hh: torch.Tensor  # (3d, d) GRU hidden-to-gates weight (r, z, n stacked, as nn.GRU)
    b_hh: torch.Tensor  # (3d,)
    norm_weight: torch.Tensor  # (d,) LayerNorm on the GRU state -> r_i
    norm_bias: torch.Tensor  # (d,)
    norm_eps: float
    w_prefix: torch.Tensor  # (d, d) the r half of the score MLP's first layer
    w_out: torch.Tensor  # (1, d) score MLP's last layer
    b_out: torch.Tensor  # (1,)
    prefix_proj: torch.Tensor | None  # (R, d) bilinear prefix factor, None when R = 0

    def to(self, dtype: torch.dtype) -> "SelectorWeights":
        """The same weights in `dtype` (a calibrated selector walks in float32)."""
        cast = {f.name: getattr(self, f.name).to(dtype) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **cast)


def keep_or_replace(sigma: torch.Tensor, repair_margin: float) -> torch.Tensor:
    """σ (b, k) -> the chosen pool index (b,): the native 0 unless the best alternative beats it by > repair_margin (δ)."""
    j = torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
    if sigma.shape[1] > 1:
        best, alt = sigma[:, 1:].max(-1)
        j = torch.where(best - sigma[:, 0] > repair_margin, alt + 1, j)
    return j


def _finite_logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """log Σ exp over `dim` (removed) of a finite x: max-shifted, without torch.logsumexp's ±inf masking
    (~18 vs ~30 µs on a (1, 2, 8, 8) tensor on CPU, where the lattice's small steps are bound by op count)."""
    m = x.amax(dim, keepdim=True)
    return (x - m).exp_().sum(dim).log_() + m.squeeze(dim)


def lattice_messages(unary: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Forward and backward messages of the transition lattice (DESIGN §1.3) per candidate, float32.

    unary (N, n, k): each candidate's own score (the drafter's log-prob); table (N, n, k, k): T[:, i, p, c]
    = L_i(pool_{i-1,p}, pool_{i,c}), every row of position 0 the anchor's. With
        α_0(c) = u_0(c) + T_0(·, c),  α_i(c) = u_i(c) + logsumexp_p (α_{i-1}(p) + T_i(p, c))
        β_{n-1}(c) = 0,               β_i(c) = logsumexp_q (T_{i+1}(c, q) + u_{i+1}(q) + β_{i+1}(q))
    returns (N, n, k, 3): α, β and α + β, each log-normalised over the k candidates of a position (the
    lattice's filtered, backward and smoothed log-marginals), clamped at -30; float32 (float64 inputs: float64).
    The two recursions run side by side, one logsumexp per step for both (step s: α_{s+1} over T_{s+1}^T and
    β_{n-2-s} over T_{n-1-s}), and one for the three normalisations: on CPU the block's cost is the op count.
    The inputs are finite (clamped log-probs, a bilinear table), so `_finite_logsumexp` skips torch's ±inf handling.
    """
    dtype = torch.float64 if unary.dtype == torch.float64 else torch.float32
    u, t = unary.to(dtype), table.to(dtype)
    n = u.shape[1]
    alpha, beta = [u[:, 0] + t[:, 0, 0]], [torch.zeros_like(u[:, -1])]  # beta from the last position back
    if n > 1:
        mats = torch.stack([t[:, 1:].transpose(-1, -2), t[:, 1:].flip(1)], dim=2)  # (N, n-1, 2, k, k)
        later = u[:, 1:].flip(1)  # (N, n-1, k): u_{n-1}, ..., u_1
        for s in range(n - 1):
            v = torch.stack([alpha[-1], later[:, s] + beta[-1]], dim=1)  # (N, 2, k)
            out = _finite_logsumexp(mats[:, s] + v[:, :, None, :], -1)  # (N, 2, k)
            alpha.append(u[:, s + 1] + out[:, 0])
            beta.append(out[:, 1])
    a, b = torch.stack(alpha, 1), torch.stack(beta[::-1], 1)  # (N, n, k)
    x = torch.stack([a, b, a + b], -1)  # (N, n, k, 3)
    return (x - _finite_logsumexp(x, -2)[..., None, :]).clamp_(min=-30.0)


def relay_select_ref(start_gates: torch.Tensor, cand_gates: torch.Tensor, cand_hidden: torch.Tensor,
                     weights: SelectorWeights, cand_factor: torch.Tensor | None = None,
                     logprobs: torch.Tensor | None = None, repair_margin: float = 0.0,
                     transition: torch.Tensor | None = None):
    """DRelay's sequential selection of one block (DESIGN §1.4), batch rows independent.

    start_gates (b, 3d): GRU input gates W_i x + b_i of the anchor's prefix input.
    cand_gates (b, n, k, 3d): the same for every candidate, fed to the GRU if that candidate is chosen.
    cand_hidden (b, n, k, d): the candidate half of the score MLP's first layer (bias included).
    cand_factor (b, n, k, R): bilinear candidate factor; logprobs (b, n, k): the drafter's term (clamped
    log-probs, calibrated or not; added when the score is residual); transition (b, n, k, k): the lattice
    T[:, i, p, j] = L_i(pool_{i-1,p}, c_{i,j}) (position 1 reads row p = 1, the anchor's).  For i = 1..n,
    with h_0 = 0, x_1 = the anchor's gates and j*_0 = 1:

        h_i = GRU(x_i, h_{i-1});  r_i = LayerNorm(h_i)
        σ_{i,j} = w_out·GELU(cand_hidden_{i,j} + W_prefix r_i) + b_out + <c_{i,j}, P r_i>/√R + s_{i,j} + T_{i, j*_{i-1}, j}
        j*_i = argmax_{j>1} σ_{i,j} if that beats σ_{i,1} by more than `repair_margin` (δ), else 1;  x_{i+1} = cand_gates_{i,j*}

    Returns choice (b, n) (0-based pool index) and σ (b, n, k).
    """
    b, n, k = cand_hidden.shape[:3]
    w = weights
    width = w.w_hh.shape[1]
    # σ's r side in one product per step, [W_prefix; P / √R] r, and its r-free terms b_out + s, added once a step
    w_r = w.w_prefix if cand_factor is None else torch.cat([w.w_prefix, w.prefix_proj / cand_factor.shape[-1] ** 0.5])
    base = w.b_out if logprobs is None else logprobs + w.b_out  # (1,) or (b, n, k)
    rows = torch.arange(b, device=cand_hidden.device)
    gi, h = start_gates, None  # (b, 3d); h_0 = 0
    choices, scores = [], []
    j = torch.zeros(b, dtype=torch.long, device=cand_hidden.device)  # position 1 reads the anchor's row
    for i in range(n):
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = (w.b_hh if h is None else F.linear(h, w.w_hh, w.b_hh)).chunk(3, -1)  # W_hh·0 + b_hh at i = 1
        reset, update = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        cand = torch.tanh(i_n + reset * h_n)
        h = (1 - update) * cand if h is None else torch.lerp(cand, h, update)  # (1 - z) n + z h
        r = F.layer_norm(h, (width,), w.norm_weight, w.norm_bias, w.norm_eps)  # (b, d)
        rr = F.linear(r, w_r)  # (b, d [+ R])
        sigma = F.gelu(cand_hidden[:, i] + rr[:, None, :width]) @ w.w_out[0]  # (b, k)
        if cand_factor is not None:
            sigma = sigma + (cand_factor[:, i] @ rr[:, width:, None])[..., 0]
        sigma = sigma + (base if logprobs is None else base[:, i])
        if transition is not None:
            sigma = sigma + transition[rows, i, j]  # row j*_{i-1}
        j = keep_or_replace(sigma, repair_margin)
        choices.append(j)
        scores.append(sigma)
        gi = cand_gates[rows, i, j]  # (b, 3d)
    return torch.stack(choices, dim=1), torch.stack(scores, dim=1)


# ------------------------------------------------------------------------------------- verify
def verify_ref(draft_tokens: torch.Tensor, target_logits: torch.Tensor, temperature: float = 0.0,
               accept_uniforms: torch.Tensor | None = None, noise: torch.Tensor | None = None):
    """Acceptance of one verified block (DESIGN §1.5): draft_tokens (b, n), target_logits (b, n+1, V)
    -> accept_len (b,), next_token (b,).

    T = 0: the longest prefix equal to the target's argmax, then the argmax after it.
    T > 0: the lossless residual rule with its randomness given: accept d_i while
    accept_uniforms[i] < p_T(d_i); the next token is argmax_x p'(x) / noise(x) over the row after the
    prefix, p' = p_T with a rejected d_i removed and noise (b, V) ~ Exp(1), which is a draw from p'
    (the draw torch.multinomial makes).  `drelay.decoding.verify.residual_noise` draws them.
    """
    if temperature == 0:
        return greedy_accept(draft_tokens, target_logits)
    return residual_accept(draft_tokens, target_probs(target_logits, temperature), accept_uniforms, noise)


# ------------------------------------------------------------------------------- lm_head_topk
def candidate_pool(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., n, V) logits -> pool_ids, pool_logprobs (..., n, k): top-k of log_softmax in fp32,
    sorted by log-prob, so column 0 is the native top-1 choice (DESIGN §1.2)."""
    pool_logprobs, pool_ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return pool_ids, pool_logprobs


def lm_head_topk_ref(hidden: torch.Tensor, weight: torch.Tensor, k: int):
    """The drafter's candidate pool straight from its (normed) hidden states: hidden (..., H), the
    LM head's weight (V, H) -> pool_ids, pool_logprobs (..., k) as `candidate_pool(hidden @ W^T, k)`,
    and the log-softmax normaliser lse (...,) (s_{i,j} = z_{i,j} - lse_i)."""
    logits = F.linear(hidden, weight)  # (..., V): what the fused kernel never materialises
    pool_ids, pool_logprobs = candidate_pool(logits, k)
    return pool_ids, pool_logprobs, torch.logsumexp(logits.float(), dim=-1)


# ------------------------------------------------------------------------------- support_loss
def support_loss_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, k: int, gamma: float,
                     hinge_margin: float = 1.0, hinge_gamma: float | None = None):
    """Training's vocabulary-sized terms from the (normed) hidden states: hidden (..., n, H), the LM
    head's weight (V, H), labels (..., n) -> `dflash_ce` (position-weighted mean CE), `support_hinge`
    (mean softplus(z_(k) - z_y + hinge_margin), weighted by position with hinge_gamma) and the detached
    candidate pool (..., n, k) of the same logits."""
    logits = F.linear(hidden, weight)  # (..., n, V)
    ce, _ = dflash_ce(logits, labels, gamma)
    hinge = support_hinge(logits, labels, k, hinge_margin, hinge_gamma)
    pool_ids, pool_logprobs = candidate_pool(logits.detach(), k)
    return ce, hinge, pool_ids, pool_logprobs
