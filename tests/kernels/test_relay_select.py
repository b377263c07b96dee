"""relay_select: the Triton walk over a block equals the torch loop (choices exactly, σ to tolerance) on
odd shapes, with and without the bilinear term, the residual log-probs and the lattice; and DRelay.select
through it (paper-literal and v2)."""

import pytest
import torch

from drelay.kernels.reference import SelectorWeights, relay_select_ref
from drelay.kernels.relay_select import relay_select
from tests.kernels.conftest import close
from tests.models.test_relay import _block, _relay


def _inputs(b, n, k, d, rank, dtype, device, seed, residual=True, lattice=False):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype, device=device)

    weights = SelectorWeights(rnd(3 * d, d, scale=0.3), rnd(3 * d, scale=0.1), rnd(d), rnd(d), 1e-5,
                              rnd(d, d, scale=0.3), rnd(1, d), rnd(1), rnd(rank, d, scale=0.3) if rank else None)
    args = (rnd(b, 3 * d), rnd(b, n, k, 3 * d), rnd(b, n, k, d), weights, rnd(b, n, k, rank) if rank else None,
            rnd(b, n, k) if residual else None)
    return args if not lattice else args + (0.0, rnd(b, n, k, k, scale=2.0))  # repair margin, transition


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b, n, k, d, rank, residual, lattice", [(3, 5, 5, 24, 7, True, False),
                                                                (2, 7, 3, 19, 0, False, False),
                                                                (1, 1, 1, 8, 2, True, False),
                                                                (3, 6, 4, 16, 4, True, True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_reference(device, dtype, b, n, k, d, rank, residual, lattice, seed):
    args = _inputs(b, n, k, d, rank, dtype, device, seed, residual, lattice)
    extra = {"transition": args[-1]} if lattice else {}
    args = args[:6]
    for repair_margin in (0.0, 0.4, -0.3):
        choice, sigma = relay_select(*args, repair_margin=repair_margin, **extra)
        ref_choice, ref_sigma = relay_select_ref(*args, repair_margin=repair_margin, **extra)
        assert choice.dtype == torch.long and choice.shape == (b, n) and sigma.shape == (b, n, k)
        close(sigma, ref_sigma)
        assert torch.equal(choice, ref_choice)
    if k > 1:  # the inputs make the decisions non-trivial: some positions replace the native
        assert bool((relay_select_ref(*args, repair_margin=0.0, **extra)[0] > 0).any())
    if lattice:  # and the lattice row follows the previous choice: σ differs without it
        assert not torch.allclose(relay_select_ref(*args)[1], relay_select_ref(*args, **extra)[1])


def test_a_large_repair_margin_keeps_every_native(device):
    args = _inputs(2, 4, 4, 16, 4, torch.float32, device, seed=3)
    choice, _ = relay_select(*args, repair_margin=1e9)
    assert not bool(choice.any())


def test_launcher_names_the_bad_argument(device):
    start, cand_gates, cand_hidden, weights, factor, logprobs = _inputs(2, 3, 4, 8, 2, torch.float32, device, 0)
    with pytest.raises(ValueError, match=r"cand_gates must have shape \(2, 3, 4, 24\)"):
        relay_select(start, cand_gates[..., :-1], cand_hidden, weights, factor, logprobs)
    with pytest.raises(ValueError, match="logprobs must be torch.float32"):
        relay_select(start, cand_gates, cand_hidden, weights, factor, logprobs.double())
    with pytest.raises(ValueError, match=r"weights.prefix_proj must have shape \(3, 8\)"):
        relay_select(start, cand_gates, cand_hidden, weights, torch.cat([factor, factor[..., :1]], -1), logprobs)


@pytest.mark.parametrize("bilinear_rank, residual, variant", [(64, True, "lite"), (0, False, "lite"),
                                                              (64, True, "v2")])
def test_drelay_select_through_the_kernel(kernels, bilinear_rank, residual, variant):
    relay = _relay("gru", bilinear_rank=bilinear_rank, residual=residual, variant=variant)  # float64
    for seed in (1, 2):
        block = _block(seed=seed)
        kernels("reference")
        relay.attach(relay.shared.embed_tokens)  # the ops are chosen when the relay is attached
        tokens, sigma = relay.select(block, return_scores=True)
        kernels("triton")
        relay.attach(relay.shared.embed_tokens)
        got_tokens, got_sigma = relay.select(block, return_scores=True)
        assert torch.equal(got_tokens, tokens)
        close(got_sigma, sigma)
        assert bool((tokens != block.pool_ids[..., 0]).any())  # the relay repaired something
