"""A test's repair hook as a repair method (drelay/models/repair.py): what the engine, replay and the
evaluation grid take."""

from __future__ import annotations

from typing import Callable

import torch

from drelay.models.repair import DraftBlock, RepairMethod


class Hook(RepairMethod):
    """Proposes fn(block); `repairs` says whether it may differ from the native top-1."""

    name = "hook"

    def __init__(self, fn: Callable[[DraftBlock], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def select(self, block: DraftBlock) -> torch.Tensor:
        return self.fn(block)
