"""DRelay's joint objective (DESIGN §1.6) past the backbone's CE: candidate support (logit hinge + the
reader's per-candidate BCE) and the repair loss (selector CE over the pool, weighted by each position's
share of the accepted prefix). Every function takes any leading dims, e.g. (b, nA, B-1) or (b, B-1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drelay.data.records import IGNORE
from drelay.config import OMEGA_MODES
from drelay.kernels.reference import dflash_ce, mean_denominator, pool_index, support_hinge


def reader_bce(support_logits: torch.Tensor, pool_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """BCE of the reader's "c_{i,j} is correct" head, mean over every candidate of valid positions."""
    target = (pool_ids == labels[..., None]).to(support_logits.dtype)  # (..., k)
    valid = (labels != IGNORE)[..., None].expand_as(target).to(support_logits.dtype)
    bce = F.binary_cross_entropy_with_logits(support_logits, target, reduction="none")
    return (bce * valid).sum() / mean_denominator(valid.sum(), 1)


@torch.no_grad()
def prefix_weights(pi: torch.Tensor, eps: float = 1e-2, valid: torch.Tensor | None = None,
                   normalize: bool = True, reachable: torch.Tensor | None = None) -> torch.Tensor:
    """ω over the last dim (the block's positions) from π (..., n), the selector's probability of
    the true token (0 if outside the pool).

    With π floored at eps, E[accepted length] = Σ_n Π_{m<=n} π_m and ω_i = dE/dlog π_i =
    Σ_{n>=i} Π_{m<=n} π_m. Invalid positions (past the sequence end) have π = 0 (no floor) and
    ω = 0. normalize (drelay-lite): per block, ω is rescaled to mean 1 over its valid positions (Σ ω =
    #valid), so each block weighs like plain CE over its positions and only the shape within the block
    comes from ω; that gives a block whose first true token is outside the pool its weight back.
    reachable (..., n) (v2): ω times 0 where an earlier true token is outside the pool (no repair can
    reach past it), the renormalisation then over the reachable positions only. Without any
    renormalisation (normalize=False: the exact gradient of the expected accepted length) a block's
    weight is its own Σ Π π, which lets the selector give up on hard blocks: measured on the joint
    test's phrase data, held-out selector accuracy rose to 0.79 by step 50 and fell to 0.61 (below the
    native's 0.69) by step 100, while the weighted repair loss kept falling. Computed in float64: Π of
    15 floored π would underflow float32.
    """
    dtype = pi.dtype
    valid = torch.ones_like(pi, dtype=torch.bool) if valid is None else valid
    pi = torch.where(valid, pi.double().clamp(min=eps), 0.0)
    reach = pi.cumprod(-1)  # (..., n): Π_{m<=n} π_m
    omega = reach.flip(-1).cumsum(-1).flip(-1)  # (..., n): Σ_{n>=i}
    if reachable is not None:
        omega = omega * reachable
        valid = valid & (reachable > 0)
    if normalize:
        count = valid.sum(-1, keepdim=True)
        omega = omega * count / omega.sum(-1, keepdim=True).clamp(min=1e-300)
    return omega.to(dtype)


def reachable_positions(in_pool: torch.Tensor) -> torch.Tensor:
    """(..., n) bool -> (..., n): 1 where every earlier position's true token is in its pool."""
    ones = torch.ones_like(in_pool[..., :1], dtype=torch.float64)
    return torch.cat([ones, in_pool[..., :-1].double().cumprod(-1)], dim=-1)


def repair_loss(sigma: torch.Tensor, pool_ids: torch.Tensor, labels: torch.Tensor,
                omega: torch.Tensor, repair_weight: float = 1.0) -> torch.Tensor:
    """ω-weighted CE of softmax(σ_{i,·}) against the pool index of y_i, over positions whose y_i
    is in the pool: Σ ω·CE / Σ ω (a weighted mean). Repair cases (y_i in the pool but not the native)
    weigh repair_weight times more. sigma, pool_ids (..., k); labels, omega (...)."""
    index, in_pool = pool_index(pool_ids, labels)
    ce = -torch.log_softmax(sigma.float(), dim=-1).gather(-1, index[..., None]).squeeze(-1)
    w = omega.float() * in_pool
    if repair_weight != 1.0:
        w = w * torch.where(index > 0, repair_weight, 1.0)
    return (ce * w).sum() / mean_denominator(w.sum(), 1e-8)


def drelay_loss(logits: torch.Tensor, labels: torch.Tensor, sigma: torch.Tensor, support_logits: torch.Tensor,
                pool_ids: torch.Tensor, *, gamma: float, lambda_support: float = 1.0, lambda_repair: float = 1.0,
                hinge_margin: float = 1.0, eps: float = 1e-2, hinge_gamma: float | None = None,
                **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = w_ce·L_ce + λ_s·(hinge + reader BCE) + λ_r·L_repair (DESIGN §1.6) and every term, detached.

    logits (..., n, V); labels (..., n); sigma, support_logits, pool_ids (..., n, k) from
    `DRelay.score` on the pool of these logits. π (for ω) is the detached softmax(σ) of the true token.
    hinge_gamma: the hinge weighted by position; options: `drelay_loss_from_terms`'s.
    """
    ce, _ = dflash_ce(logits, labels, gamma)
    hinge = support_hinge(logits, labels, pool_ids.shape[-1], hinge_margin, hinge_gamma)
    return drelay_loss_from_terms(ce, hinge, labels, sigma, support_logits, pool_ids, lambda_support=lambda_support,
                                  lambda_repair=lambda_repair, eps=eps, **options)


def drelay_loss_from_terms(ce: torch.Tensor, hinge: torch.Tensor, labels: torch.Tensor, sigma: torch.Tensor,
                           support_logits: torch.Tensor, pool_ids: torch.Tensor, *, lambda_support: float = 1.0,
                           lambda_repair: float = 1.0, eps: float = 1e-2, ce_weight: float = 1.0,
                           repair_weight: float = 1.0, omega: str = "block", positions: int = 0
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`drelay_loss` with its vocabulary-sized terms (`dflash_ce`, `support_hinge`) already computed, e.g.
    by the fused support_loss kernel, which never materialises the logits. ce_weight: w_ce (the CE
    schedule's value now); repair_weight: see `repair_loss`; omega: "block" (renormalised per block,
    drelay-lite), "reach" (x reachability, renormalised over the reachable positions) or "expected"
    (x reachability, not renormalised: see `prefix_weights`); positions: the repair CE over the first
    `positions` positions of each block only (0: all)."""
    bce = reader_bce(support_logits, pool_ids, labels)
    index, in_pool = pool_index(pool_ids, labels)
    pi = torch.softmax(sigma.detach().float(), -1).gather(-1, index[..., None]).squeeze(-1) * in_pool
    if omega not in OMEGA_MODES:
        raise ValueError(f"omega must be one of {', '.join(OMEGA_MODES)}, got {omega!r}")
    valid = labels != IGNORE
    if positions:
        valid = valid & (torch.arange(labels.shape[-1], device=labels.device) < positions)
    weights = prefix_weights(pi, eps, valid=valid, normalize=omega != "expected",
                             reachable=None if omega == "block" else reachable_positions(in_pool))
    repair = repair_loss(sigma, pool_ids, labels, weights, repair_weight)
    support = hinge + bce
    loss = ce_weight * ce + lambda_support * support + lambda_repair * repair
    terms = {"loss": loss, "ce": ce, "support": support, "hinge": hinge, "reader_bce": bce, "repair": repair,
             "selector_acc": ((sigma.argmax(-1) == index) & in_pool).sum() / mean_denominator(in_pool.sum(), 1),
             "native_acc": ((index == 0) & in_pool).sum() / mean_denominator(in_pool.sum(), 1)}  # the same, for the top-1
    return loss, {name: t.detach() for name, t in terms.items()}
