"""A tiny random target with SmolLM2's tokenizer (chat template, stop tokens) and an untrained B=4
drafter, shared by the evaluation tests of a session."""

import pytest
import torch

from drelay.models.drafter import BlockDrafter
from drelay.models.target import Target, make_tiny_random_target


@pytest.fixture(scope="session")
def chat_target_and_drafter(tmp_path_factory):
    path = make_tiny_random_target(tmp_path_factory.mktemp("target") / "tiny", seed=3)
    target = Target.load(path, dtype="float32")
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=4).float()
    return target, drafter
