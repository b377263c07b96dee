"""The lossless acceptance rules (DESIGN §1.5), split from `reference.py` so that the stages which only
verify (prepare_data's written prompts, distill) depend on this file and not on the drafter's and selector's
ops: a change to a training loss or to the lattice re-runs training, not the target's distillation.
`reference.py` re-exports them (the kernels' spec, `verify_ref`). Imports only torch.
"""

from __future__ import annotations

import torch


# ----------------------------------------------------------------------------- acceptance rules
# A block is verified by one target forward over [anchor, d_1..d_n]; row i of the target's output
# (i = 0..n) is the distribution of the token after d_i (after the anchor for i = 0). So d_i is
# checked against row i-1, and the token committed after the accepted prefix of length a comes from
# row a: a correction when a < n, a bonus when every draft token was accepted (DESIGN §1.5).
def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification: draft_tokens (b, n), target_logits (b, n+1, V) -> accept_len (b,), next_token (b,).

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


def residual_accept(draft_tokens: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor):
    """The lossless residual rule for a point-mass draft at T > 0, its randomness given:
    draft_tokens (b, n), probs (b, n+1, V) = p_T per row, uniforms (b, n), noise (b, V) ~ Exp(1)
    -> accept_len, next_token (b,).

    Accept d_i while uniforms[i] < p(d_i); at the first rejection draw from p with d_i removed and
    renormalised ((p - q)+ for the point mass q = 1[d_i]): P(out = d_i) = p(d_i) and
    P(out = x) = (1 - p(d_i)) p(x) / (1 - p(d_i)) = p(x), exact. The draw is argmax p'(x) / noise(x),
    which is how torch.multinomial draws one sample.
    """
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
