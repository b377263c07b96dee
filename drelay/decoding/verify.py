"""Verification at decoding time (DESIGN §1.5): the randomness of the lossless rules and DFlash's
"sample and match" option. The acceptance maths itself is the kernels' spec
(`drelay.kernels.acceptance`: greedy_accept, residual_accept, target_probs).
"""

from __future__ import annotations

import torch

from drelay.kernels.acceptance import residual_accept, target_probs

SAMPLING_RULES = ("residual", "match")


def rejection_accept(draft_tokens: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None = None,
                     rule: str = "residual"):
    """Lossless verification of a deterministic (point-mass) draft at T > 0.

    draft_tokens (b, n), probs (b, n+1, V) = p_T at each row -> accept_len (b,), next_token (b,).

    residual (default): accept d_i with probability p(d_i); at the first rejection sample from
      p with d_i removed and renormalised (`residual_accept`, its draws made here).
    match (DFlash): sample x_i ~ p at every row and accept while x_i == d_i; the first mismatch x_i
      is the correction. For a point-mass draft this is the same distribution, drawn differently.
    """
    if rule not in SAMPLING_RULES:
        raise ValueError(f"unknown sampling rule {rule!r}; expected one of {SAMPLING_RULES}")
    if rule == "match":
        b, n = draft_tokens.shape
        rows = torch.arange(b, device=probs.device)
        samples = torch.multinomial(probs.reshape(b * (n + 1), -1), 1, generator=generator).view(b, n + 1)
        accept_len = (samples[:, :-1] == draft_tokens).long().cumprod(dim=1).sum(dim=1)
        return accept_len, samples[rows, accept_len]

    uniforms, noise = residual_noise(draft_tokens.shape, probs.shape[-1], generator, probs.device, probs.dtype)
    return residual_accept(draft_tokens, probs, uniforms, noise)


def residual_noise(draft_shape, vocab_size: int, generator: torch.Generator | None = None, device=None,
                   dtype: torch.dtype = torch.float64):
    """The randomness of the residual rule, in the order it is drawn: acceptance uniforms (b, n) and
    Exp(1) noise (b, V) for the one draw from the residual, in p's dtype. torch.multinomial draws one sample
    as argmax(p / q) with q ~ Exp(1) of p's shape, so these are exactly the draws it would make."""
    uniforms = torch.rand(draft_shape, generator=generator, dtype=dtype, device=device)
    noise = torch.empty(draft_shape[0], vocab_size, dtype=dtype, device=device)
    return uniforms, noise.exponential_(1, generator=generator)


def sample_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """(b, V) logits -> (b,) tokens: argmax at T=0, else a draw from softmax(logits/T)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(target_probs(logits, temperature), 1, generator=generator).squeeze(1)
