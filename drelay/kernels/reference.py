"""Pure-torch definitions of DRelay's fused ops (the spec) and the one dispatch point.

Every op here has a Triton twin in `drelay/kernels/<op>.py` with the same signature and outputs;
`kernel(op, *tensors)` picks one of the two:

    DRELAY_KERNELS=auto       (default) Triton when every tensor is on CUDA, else this reference
    DRELAY_KERNELS=triton     always Triton (on CPU only under TRITON_INTERPRET=1: the tests)
    DRELAY_KERNELS=reference  always the reference (benchmarks, bisecting a kernel bug)

On CPU `auto` is the reference, so CPU numbers are exactly what the plain torch code computes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from drelay.decoding.verify import greedy_accept, residual_accept, target_probs
from drelay.training.losses import dflash_ce, support_hinge

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "DRELAY_KERNELS"
OPS = ("relay_select", "verify", "lm_head_topk", "support_loss")


# ------------------------------------------------------------------------------------- dispatch
def backend() -> str:
    """The DRELAY_KERNELS setting, checked."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {BACKENDS}")
    return mode


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1, read when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    """Whether triton can be imported (looked up once: the dispatch runs several times per decoding step)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the ops on these tensors take the Triton path (see the module docstring)."""
    mode = backend()
    on_cuda = all(t.is_cuda for t in tensors)
    if mode == "reference":
        return False
    if mode == "triton":
        if not (on_cuda or interpreting()):
            raise RuntimeError(f"{ENV_VAR}=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                               f"triton is imported (CPU interpreter)")
        return True
    return on_cuda and triton_installed()


def kernel(op: str, *tensors: torch.Tensor) -> Callable:
    """The implementation of `op` for these tensors: the Triton launcher or `<op>_ref`."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; expected one of {OPS}")
    if use_triton(*tensors):
        return getattr(importlib.import_module(f"drelay.kernels.{op}"), op)
    return globals()[f"{op}_ref"]


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


def keep_or_replace(sigma: torch.Tensor, margin: float) -> torch.Tensor:
    """σ (b, k) -> the chosen pool index (b,): the native 0 unless the best alternative beats it by > margin."""
    j = torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
    if sigma.shape[1] > 1:
        best, alt = sigma[:, 1:].max(-1)
        j = torch.where(best - sigma[:, 0] > margin, alt + 1, j)
    return j


def relay_select_ref(start_gates: torch.Tensor, cand_gates: torch.Tensor, cand_hidden: torch.Tensor,
                     weights: SelectorWeights, cand_factor: torch.Tensor | None = None,
                     logprobs: torch.Tensor | None = None, margin: float = 0.0):
    """DRelay's sequential selection of one block (DESIGN §1.4), batch rows independent.

    start_gates (b, 3d): GRU input gates W_i x + b_i of the anchor's prefix input.
    cand_gates (b, n, k, 3d): the same for every candidate, fed to the GRU if that candidate is chosen.
    cand_hidden (b, n, k, d): the candidate half of the score MLP's first layer (bias included).
    cand_factor (b, n, k, R): bilinear candidate factor; logprobs (b, n, k): clamped drafter log-probs
    (added when the score is residual).  For i = 1..n, with h_0 = 0 and x_1 = the anchor's gates:

        h_i = GRU(x_i, h_{i-1});  r_i = LayerNorm(h_i)
        σ_{i,j} = w_out·GELU(cand_hidden_{i,j} + W_prefix r_i) + b_out + <c_{i,j}, P r_i>/√R + s_{i,j}
        j*_i = argmax_{j>1} σ_{i,j} if that beats σ_{i,1} by more than `margin`, else 1;  x_{i+1} = cand_gates_{i,j*}

    Returns choice (b, n) (0-based pool index) and σ (b, n, k).
    """
    n = cand_hidden.shape[1]
    w = weights
    width = w.w_hh.shape[1]
    gi = start_gates[:, None]  # (b, 1, 3d)
    h = torch.zeros_like(gi[..., :width])  # (b, 1, d)
    choices, scores = [], []
    for i in range(n):
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = F.linear(h, w.w_hh, w.b_hh).chunk(3, -1)
        reset, update = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        h = (1 - update) * torch.tanh(i_n + reset * h_n) + update * h
        r = F.layer_norm(h, (width,), w.norm_weight, w.norm_bias, w.norm_eps)  # (b, 1, d)
        pre = cand_hidden[:, i: i + 1] + F.linear(r, w.w_prefix)[:, :, None]  # (b, 1, k, d)
        sigma = F.linear(F.gelu(pre), w.w_out, w.b_out).squeeze(-1)  # (b, 1, k)
        if cand_factor is not None:
            rank = cand_factor.shape[-1]
            sigma = sigma + (cand_factor[:, i: i + 1] * F.linear(r, w.prefix_proj)[:, :, None]).sum(-1) / rank ** 0.5
        if logprobs is not None:
            sigma = sigma + logprobs[:, i: i + 1]
        sigma = sigma[:, 0]  # (b, k)
        j = keep_or_replace(sigma, margin)
        choices.append(j)
        scores.append(sigma)
        gi = cand_gates[:, i].gather(1, j[:, None, None].expand(-1, 1, cand_gates.shape[-1]))  # (b, 1, 3d)
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
    (the draw torch.multinomial makes).  `rejection_accept` draws exactly these from its generator.
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
                     margin: float = 1.0):
    """Training's vocabulary-sized terms from the (normed) hidden states: hidden (..., n, H), the LM
    head's weight (V, H), labels (..., n) -> `dflash_ce` (position-weighted mean CE), `support_hinge`
    (mean softplus(z_(k) - z_y + margin)) and the detached candidate pool (..., n, k) of the same logits."""
    logits = F.linear(hidden, weight)  # (..., n, V)
    ce, _ = dflash_ce(logits, labels, gamma)
    hinge = support_hinge(logits, labels, k, margin)
    pool_ids, pool_logprobs = candidate_pool(logits.detach(), k)
    return ce, hinge, pool_ids, pool_logprobs
