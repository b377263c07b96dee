"""Training losses. DFlash: position-decayed cross-entropy over the block (DESIGN §1.6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drelay.training.data import IGNORE


def position_weights(num_positions: int, gamma: float, device=None) -> torch.Tensor:
    """w_i = exp(-(i-1)/gamma) for block positions i = 1..B-1: early positions matter most,
    because a miss there discards everything after it."""
    return torch.exp(-torch.arange(num_positions, device=device, dtype=torch.float32) / gamma)


def dflash_ce(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (..., B-1, V), labels (..., B-1) -> (weighted mean CE, per-position CE (..., B-1))."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE,
                         reduction="none").view(labels.shape)
    weights = position_weights(labels.shape[-1], gamma, labels.device) * (labels != IGNORE)
    return (ce * weights).sum() / weights.sum().clamp(min=1e-8), ce


@torch.no_grad()
def hit_rates(logits: torch.Tensor, labels: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Per-position top-1 accuracy and top-k hit rate (the label inside the pool): (B-1,) each."""
    valid = (labels != IGNORE).float()
    topk = logits.topk(k, dim=-1).indices  # (..., B-1, k)
    top1 = (topk[..., 0] == labels).float() * valid
    in_pool = (topk == labels[..., None]).any(-1).float() * valid
    dims = tuple(range(labels.dim() - 1))
    count = valid.sum(dims).clamp(min=1)
    return {"top1": top1.sum(dims) / count, "topk": in_pool.sum(dims) / count, "count": valid.sum(dims)}
