"""verify: the fused acceptance equals the torch rules exactly (greedy, and the residual rule fed the
same draws), at every acceptance length, and the residual draws are the ones `rejection_accept` makes."""

import pytest
import torch

from drelay.decoding.verify import rejection_accept, residual_noise
from drelay.kernels.reference import target_probs
from drelay.kernels.reference import verify_ref
from drelay.kernels.verify import verify


def _block(b, n, V, seed, device, peaked=False):
    """Logits (b, n+1, V) and drafts (b, n): row r's draft follows the target's argmax up to position r
    (r = n: the whole block), so every acceptance length 0..n occurs at T = 0."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n + 1, V, generator=gen) * 3
    greedy = logits.argmax(-1)[:, :-1]
    if peaked:  # most of the mass on the greedy token: long accepted prefixes at T > 0 too
        logits.scatter_add_(-1, logits.argmax(-1, keepdim=True), torch.full((b, n + 1, 1), 12.0))
    draft = greedy.clone()
    for r in range(b):
        if r % (n + 1) < n:
            draft[r, r % (n + 1)] = (draft[r, r % (n + 1)] + 1 + r) % V
    return draft.to(device), logits.to(device)


@pytest.mark.parametrize("b, n, V", [(7, 6, 1000), (3, 1, 37), (5, 4, 8193)])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_matches_reference_at_every_accept_length(device, b, n, V, seed):
    draft, logits = _block(b, n, V, seed, device)
    accept_len, next_token = verify(draft, logits)
    ref_len, ref_next = verify_ref(draft, logits)
    assert torch.equal(accept_len, ref_len) and torch.equal(next_token, ref_next)
    assert accept_len.tolist() == [min(r % (n + 1), n) for r in range(b)]


@pytest.mark.parametrize("temperature", [0.6, 1.3])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_residual_rule_matches_reference_given_the_same_draws(device, temperature, peaked, seed):
    b, n, V = 6, 5, 777
    draft, logits = _block(b, n, V, seed, device, peaked)
    gen = torch.Generator(device=device).manual_seed(seed)
    uniforms, noise = residual_noise(draft.shape, V, gen, device)
    accept_len, next_token = verify(draft, logits, temperature, uniforms, noise)
    ref_len, ref_next = verify_ref(draft, logits, temperature, uniforms, noise)
    assert torch.equal(accept_len, ref_len) and torch.equal(next_token, ref_next)
    if peaked:
        assert bool((accept_len > 0).any())


def test_the_draws_are_the_ones_rejection_accept_makes():
    """verify_ref fed residual_noise from a generator = rejection_accept with a twin generator: the kernel
    path consumes exactly the randomness the torch path does, so both give the same tokens."""
    draft, logits = _block(6, 5, 300, 0, torch.device("cpu"), peaked=True)
    for seed in range(5):
        probs = target_probs(logits, 0.8)
        expected = rejection_accept(draft, probs, torch.Generator().manual_seed(seed))
        uniforms, noise = residual_noise(draft.shape, 300, torch.Generator().manual_seed(seed))
        got = verify_ref(draft, logits, 0.8, uniforms, noise)
        assert all(torch.equal(a, e) for a, e in zip(got, expected))


def test_a_rejected_token_holding_all_the_mass_is_kept(device):
    """p(d) = 1 up to rounding: rejection only through a uniform of 1, and then p itself is sampled."""
    logits = torch.full((1, 2, 50), -1e4, device=device)
    logits[0, :, 7] = 0.0
    draft = torch.tensor([[7]], device=device)
    uniforms = torch.ones(1, 1, dtype=torch.float64, device=device)  # u = 1 is never < p: reject
    noise = torch.ones(1, 50, dtype=torch.float64, device=device)
    for impl in (verify, verify_ref):
        accept_len, next_token = impl(draft, logits, 1.0, uniforms, noise)
        assert accept_len.tolist() == [0] and next_token.tolist() == [7]


def test_greedy_separates_logits_that_only_float64_tells_apart(device):
    """float64 logits are compared in float64: a 1e-12 lead is a lead (fp32 would tie it to index 0)."""
    logits = torch.zeros(1, 2, 40, dtype=torch.float64, device=device)
    logits[0, :, 0], logits[0, :, 29] = 1.0, 1.0 + 1e-12
    draft = torch.tensor([[29]], device=device)
    for impl in (verify, verify_ref):
        accept_len, next_token = impl(draft, logits)
        assert accept_len.tolist() == [1] and next_token.tolist() == [29]


def test_launcher_names_the_bad_argument(device):
    draft, logits = _block(2, 3, 20, 0, device)
    with pytest.raises(ValueError, match=r"target_logits must have shape \(2, 4, \*\)"):
        verify(draft, logits[:, :-1])
    with pytest.raises(ValueError, match="accept_uniforms is required"):
        verify(draft, logits, 0.7)
    with pytest.raises(ValueError, match=r"noise must have shape \(2, 20\)"):
        verify(draft, logits, 0.7, torch.rand(2, 3, device=device), torch.rand(2, 19, device=device))
