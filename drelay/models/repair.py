"""The one repair-method interface (DESIGN §1.2-§1.7): what the engine, replay, evaluation, joint
training and the CLI call, whatever the method.

A repair method sees one drafted block (`DraftBlock`: the drafter's hidden states, logits and top-k
pool) and returns the draft tokens to verify. Every method implements the same few calls:

    create(drafter, settings, pool_size, seed)  a fresh method for a drafter (settings: joint.<name>)
    save(folder) / load(folder, embed_tokens)   its weights, if it has any (`folder_name`)
    joint_loss(drafter, hidden, labels, ...)    teacher-forced scores and the method's whole joint loss
    select(block)                               sequential repair of one block: the engine's hook
    prepare_inference()                         build what grad-free selects reuse, before a timed decode
    tune(score)                                 settings chosen on held-out replay after training (δ)

`dflash` (the native top-1, no head) and `oracle` (the true token whenever it is in the pool, for
analysis) are methods like the trained ones; drelay/models/methods.py holds the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

import torch
from torch import nn

from drelay.data.records import IGNORE
from drelay.kernels.reference import dflash_ce

if TYPE_CHECKING:
    from drelay.models.drafter import BlockDrafter


@dataclass
class DraftBlock:
    """What a repair method sees for one block. Positions i = 1..B-1 are the drafted ones."""

    anchor_ids: torch.Tensor  # (b,) last committed token
    anchor_pos: torch.Tensor  # (b,) its position; draft i sits at anchor_pos + i
    hidden: torch.Tensor  # (b, B-1, H) drafter hidden h_i
    logits: torch.Tensor | None  # (b, B-1, V) drafter logits z_i; None for a method with needs_logits = False
    pool_ids: torch.Tensor  # (b, B-1, k) top-k candidates, column 0 = native top-1
    pool_logprobs: torch.Tensor  # (b, B-1, k) their log-probabilities under softmax(z_i)
    truth: torch.Tensor | None = None  # (b, B-1) the target's tokens where known (replay, a live
    # reference), negative elsewhere; only analysis methods (needs_truth) read it
    checked: int | None = None  # the target verifies drafts 1..checked only (decode.verify_size - 1; None: all):
    # a method may stop its left-to-right walk there and leave the later drafts at the native top-1
    logit_ids: torch.Tensor | None = None  # (C,) sorted token id of each column of `logits` when they cover
    # only the drafter's draft vocabulary (a method with narrow_logits); None: column j is token j

    def walk_length(self) -> int:
        """How many positions a left-to-right selector must walk: the checked ones (at least one, at most all)."""
        n = self.pool_ids.shape[-2]
        return n if self.checked is None else max(1, min(n, self.checked))


Repair = Callable[[DraftBlock], torch.Tensor]  # DraftBlock -> draft tokens (b, B-1)
Score = Callable[[Repair], float]  # a repair hook -> its held-out replay τ (what `tune` maximises)


class RepairMethod(nn.Module):
    """The interface; see the module docstring. Subclasses set the class attributes below."""

    name: ClassVar[str] = ""
    folder_name: ClassVar[str | None] = None  # its weights' folder under <joint.out_dir>/<name>; None: none
    needs_logits: ClassVar[bool] = True  # select reads block.logits (False: the pool only)
    narrow_logits: ClassVar[bool] = False  # select also takes block.logits over the draft vocabulary only
    needs_truth: ClassVar[bool] = False  # select reads block.truth (analysis only: the oracle)
    trainable: ClassVar[bool] = True  # has a joint objective (a train@<name> stage)
    repairs: ClassVar[bool] = True  # False: select always returns the native top-1 (dflash)

    @classmethod
    def create(cls, drafter: BlockDrafter, settings, pool_size: int, seed: int) -> "RepairMethod":
        """A fresh method for `drafter` (its device and dtype, bound to its embedding), initial weights
        fixed by `seed` without touching the caller's RNG; `settings` is its joint.<name> section."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls._create(drafter, settings, pool_size)

    @classmethod
    def _create(cls, drafter: BlockDrafter, settings, pool_size: int) -> "RepairMethod":
        return cls()

    @classmethod
    def load(cls, path: str | Path, embed_tokens: nn.Module | None = None) -> "RepairMethod":
        """The saved method under `path` (a method without weights needs no folder)."""
        return cls()

    def save(self, path: str | Path) -> Path:
        return Path(path)

    def joint_loss(self, drafter: BlockDrafter, hidden: torch.Tensor, labels: torch.Tensor,
                   anchor_ids: torch.Tensor, *, gamma: float, progress: float
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The method's whole joint loss on teacher-forced blocks and its terms (detached; "loss" and
        "ce", the plain DFlash CE of z, always among them). hidden (..., n, H): the drafter's h_i;
        labels (..., n) the true tokens (IGNORE padding); anchor_ids (...); progress in [0, 1]: the
        share of training done (schedules). It runs under the caller's mixed precision (the trainer's
        `mixed_precision`). The base: the backbone's DFlash CE alone."""
        ce, _ = dflash_ce(*drafter.scored_logits(hidden, labels, IGNORE), gamma)
        return ce, {"loss": ce.detach(), "ce": ce.detach()}

    @torch.no_grad()
    def select(self, block: DraftBlock) -> torch.Tensor:
        """Draft tokens (b, n) for one block; the base keeps the native top-1."""
        return block.pool_ids[..., 0]

    def forward(self, block: DraftBlock) -> torch.Tensor:
        """The engine's repair hook."""
        return self.select(block)

    def prepare_inference(self) -> None:
        """Build what grad-free `select` calls reuse (e.g. tables over the vocabulary) now, so that a timed
        decode does not pay for it on its first step; the live decoders call it before their timer. The base
        has nothing to build."""

    def tune(self, score: Score) -> dict[float, float]:
        """After training: choose inference settings by held-out replay τ; {candidate: τ} ({} if none)."""
        return {}

    def method_state(self) -> dict:
        """Settings outside the weights that a checkpoint must keep (e.g. the chosen δ)."""
        return {}

    def load_method_state(self, state: dict) -> None:
        pass

    def eval_metrics(self) -> dict[str, float]:
        """Numbers the evaluation hook reports beside the replay statistics (e.g. δ)."""
        return {}


class Native(RepairMethod):
    """dflash: the drafter's native top-1 at every position; trained with its CE alone."""

    name = "dflash"
    needs_logits = False
    repairs = False


class Oracle(RepairMethod):
    """The true token whenever it is in the pool, else the native (analysis only: the upper bound of
    any repair). Needs the truth: replay's labels, or a live reference (the target's own output)."""

    name = "oracle"
    needs_logits = False
    needs_truth = True
    trainable = False

    def joint_loss(self, *args, **kwargs):
        raise ValueError("the oracle is not trained: it reads the true tokens")

    @torch.no_grad()
    def select(self, block: DraftBlock) -> torch.Tensor:
        if block.truth is None:
            raise ValueError("the oracle needs the true tokens (block.truth): replay, or a live reference")
        native = block.pool_ids[..., 0]
        in_pool = (block.pool_ids == block.truth[..., None]).any(-1)
        return torch.where(in_pool, block.truth, native)
