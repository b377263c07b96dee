"""Compare a method's output with plain AR decoding and classify the first divergence.

In exact arithmetic a lossless decoder at T=0 reproduces AR greedy decoding token for token. In
low precision a multi-token verification forward rounds differently from a 1-token decode step, so
the two can part where the target's top-2 logits are (nearly) tied; any other divergence is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drelay.models.target import Target

# Relative top-2 logit gap under which two continuations count as a near-tie, by dtype: a few
# units of the rounding the forward accumulates (bf16 keeps 8 mantissa bits; fp32 24).
NEAR_TIE_RELATIVE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass
class LosslessReport:
    identical: bool
    compared: int  # tokens compared (the shorter output)
    divergence: int | None = None  # index of the first differing new token
    reference_token: int | None = None  # AR's token there
    method_token: int | None = None
    top2_gap: float | None = None  # target's top1 - top2 logit after the common prefix
    near_tie: bool | None = None

    @property
    def is_bug(self) -> bool:
        """A divergence that rounding cannot explain."""
        return not self.identical and not self.near_tie

    def describe(self) -> str:
        if self.identical:
            return f"identical: {self.compared} tokens match AR decoding"
        kind = "a near-tie of the target's top-2 logits" if self.near_tie else "NOT a near-tie"
        return (f"diverged at new token {self.divergence}: AR {self.reference_token} vs "
                f"{self.method_token}; top-2 logit gap {self.top2_gap:.3g}, {kind}")


def near_tie_tolerance(top1_logit: float, dtype: torch.dtype) -> float:
    return NEAR_TIE_RELATIVE.get(dtype, 1e-4) * max(1.0, abs(top1_logit))


@torch.inference_mode()
def compare_to_ar(target: Target, prompt_ids: list[int], reference: list[int], tokens: list[int]) -> LosslessReport:
    """reference: AR greedy tokens; tokens: the method's. Lengths may differ (stop/limit)."""
    compared = min(len(reference), len(tokens))
    first = next((i for i in range(compared) if reference[i] != tokens[i]), None)
    if first is None:
        identical = len(reference) == len(tokens)
        return LosslessReport(identical, compared, None if identical else compared, near_tie=None if identical else False)
    prefix = torch.tensor([prompt_ids + reference[:first]], device=target.device)
    logits = target.forward(prefix, logits_to_keep=1, capture=False).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    near_tie = gap <= near_tie_tolerance(float(top2[0]), target.dtype)
    return LosslessReport(False, compared, first, reference[first], tokens[first], gap, near_tie)
