"""Pure, batched acceptance rules for one verified block (DESIGN §1.5).

A block is verified by one target forward over [anchor, d_1..d_n]; row i of the target's output
(i = 0..n) is the distribution of the token after d_i (after the anchor for i = 0). So d_i is
checked against row i-1, and the token committed after the accepted prefix of length a comes from
row a: a correction when a < n, a bonus when every draft token was accepted.
"""

from __future__ import annotations

import torch

SAMPLING_RULES = ("residual", "match")


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification.

    draft_tokens (b, n), target_logits (b, n+1, V) -> accept_len (b,), next_token (b,).
    accept_len counts the leading draft tokens equal to the target's argmax; next_token is the
    target's argmax after that prefix, so the output equals plain greedy decoding.
    """
    target_tokens = target_logits.argmax(dim=-1)  # (b, n+1)
    accept_len = (draft_tokens == target_tokens[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    next_token = target_tokens.gather(1, accept_len[:, None]).squeeze(1)
    return accept_len, next_token


def target_probs(target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64, so acceptance and residuals are not distorted by rounding."""
    return torch.softmax(target_logits.double() / temperature, dim=-1)


def rejection_accept(draft_tokens: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None = None,
                     rule: str = "residual"):
    """Lossless verification of a deterministic (point-mass) draft at T > 0.

    draft_tokens (b, n), probs (b, n+1, V) = p_T at each row -> accept_len (b,), next_token (b,).

    residual (default): accept d_i with probability p(d_i); at the first rejection sample from
      p with d_i removed and renormalised, i.e. from (p - q)+ for the point mass q = 1[d_i].
      Then P(out = d_i) = p(d_i) and P(out = x) = (1 - p(d_i)) p(x) / (1 - p(d_i)) = p(x): exact.
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


def residual_accept(draft_tokens: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor):
    """The residual rule with its randomness given (see `rejection_accept` and `residual_noise`):
    draft_tokens (b, n), probs (b, n+1, V), uniforms (b, n), noise (b, V) -> accept_len, next_token (b,)."""
    b, n = draft_tokens.shape
    rows = torch.arange(b, device=probs.device)
    p_draft = probs[:, :-1].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (b, n)
    accept_len = (uniforms < p_draft).long().cumprod(dim=1).sum(dim=1)
    next_probs = probs[rows, accept_len].clone()  # (b, V): row after the accepted prefix
    rejected = accept_len < n
    if rejected.any():
        rejected_tokens = draft_tokens[rows[rejected], accept_len[rejected]]
        next_probs[rows[rejected], rejected_tokens] = 0.0
    mass = next_probs.sum(dim=-1, keepdim=True)
    # A rejected token that held all the mass cannot be rejected except through rounding; keep p then.
    next_probs = torch.where(mass > 0, next_probs, probs[rows, accept_len])
    next_token = (next_probs / noise).argmax(dim=-1)  # a draw from next_probs (as torch.multinomial)
    return accept_len, next_token


def sample_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """(b, V) logits -> (b,) tokens: argmax at T=0, else a draw from softmax(logits/T)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(target_probs(logits, temperature), 1, generator=generator).squeeze(1)
