"""The engine with every kernel on (DRELAY_KERNELS=triton, interpreted) decodes exactly the tokens of the
torch path: greedy with a DRelay repair (relay_select, lm_head_topk without logits, verify), greedy
without repair, and sampling with the residual rule from the same generator seed."""

import pytest
import torch

from drelay.decoding.generate import ar_generate, speculative_generate
from drelay.models.drafter import BlockDrafter
from drelay.models.relay import DRelay
from tests.conftest import make_tiny_target
from tests.models.test_relay import as_if_trained

PROMPTS = [[1, 5, 7, 9, 3], [1, 20, 21]]


@pytest.fixture(scope="module")
def models():
    target = make_tiny_target(vocab_size=24, init=0.3, seed=2)  # float64
    drafter = BlockDrafter.for_target(target, block_size=4)
    torch.manual_seed(0)
    relay = as_if_trained(DRelay.for_drafter(drafter, reader_dim=32, reader_heads=4, pool_size=4))
    return target, drafter, relay


def _decode(models, mode, kernels, repair, temperature=0.0, seed=0):
    target, drafter, relay = models
    kernels(mode)
    drafter.attach(target), relay.attach(target.embed_tokens)  # models choose their ops when attached
    gen = torch.Generator().manual_seed(seed)
    return [speculative_generate(target, drafter, prompt, 16, method=relay if repair else None, pool_size=4,
                                 temperature=temperature, generator=gen) for prompt in PROMPTS]


@pytest.mark.parametrize("repair", [True, False])
def test_greedy_decoding_is_unchanged(models, kernels, repair):
    reference = _decode(models, "reference", kernels, repair)
    fused = _decode(models, "triton", kernels, repair)
    for prompt, ref, got in zip(PROMPTS, reference, fused):
        assert got.tokens == ref.tokens == ar_generate(models[0], prompt, 16).tokens
        assert got.stats.accept_lengths == ref.stats.accept_lengths


def test_sampled_decoding_is_unchanged(models, kernels):
    for seed in (0, 1):
        reference = _decode(models, "reference", kernels, True, temperature=0.9, seed=seed)
        fused = _decode(models, "triton", kernels, True, temperature=0.9, seed=seed)
        assert [r.tokens for r in fused] == [r.tokens for r in reference]
        assert [r.stats.accept_lengths for r in fused] == [r.stats.accept_lengths for r in reference]
