"""Losslessness of the speculative engine on tiny random targets (float64, where it must be exact)."""

import random

import pytest
import torch

import drelay.decoding.generate as generate_mod
from drelay.decoding.generate import ContextTooLongError, SpeculativeDecoder, ar_generate, speculative_generate
from drelay.models.drafter import BlockDrafter
from drelay.models.repair import DraftBlock, RepairMethod
from tests.conftest import make_tiny_target

PROMPTS = [[1, 5, 7, 9, 3], [1, 40, 41, 42], [1, 17], [1, 88, 3, 3, 3, 60, 22, 11, 71]]


class GreedyStandIn(RepairMethod):
    """A repair method that proposes the target's own greedy continuation (known in advance), with
    one position corrupted per block at a random place, so every acceptance length occurs."""

    name = "greedy-stand-in"

    def __init__(self, prompt_len: int, continuation: list[int], vocab_size: int, corrupt: bool, seed: int = 0):
        super().__init__()
        self.prompt_len, self.continuation, self.vocab_size = prompt_len, continuation, vocab_size
        self.corrupt, self.rng = corrupt, random.Random(seed)

    def select(self, block: DraftBlock) -> torch.Tensor:
        n = block.pool_ids.shape[1]
        first = int(block.anchor_pos[0]) + 1 - self.prompt_len  # index of draft 1 in the continuation
        tokens = [self.continuation[j] if j < len(self.continuation) else 0 for j in range(first, first + n)]
        if self.corrupt:
            bad = self.rng.randrange(n + 1)  # n means: no corruption, the whole block is right
            if bad < n:
                tokens[bad] = (tokens[bad] + 1) % self.vocab_size
        return torch.tensor([tokens], device=block.pool_ids.device)


@pytest.mark.parametrize("block_size", [2, 3, 5, 8])
def test_untrained_drafter_is_lossless(tiny_target, block_size):
    drafter = BlockDrafter.for_target(tiny_target, block_size=block_size)
    for prompt in PROMPTS:
        expected = ar_generate(tiny_target, prompt, 48).tokens
        got = speculative_generate(tiny_target, drafter, prompt, 48)
        assert got.tokens == expected
        assert got.stats.new_tokens == 48 and got.stats.steps >= 1


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_perfect_and_corrupted_drafts_are_lossless_at_every_accept_length(tiny_target, block_size):
    drafter = BlockDrafter.for_target(tiny_target, block_size=block_size)
    for i, prompt in enumerate(PROMPTS):
        expected = ar_generate(tiny_target, prompt, 64).tokens
        perfect = GreedyStandIn(len(prompt), expected, 96, corrupt=False)
        got = speculative_generate(tiny_target, drafter, prompt, 64, method=perfect)
        assert got.tokens == expected
        # every block fully accepted (+ bonus) except possibly the last one, cut at max_new_tokens
        assert all(a == block_size - 1 for a in got.stats.accept_lengths)
        assert got.stats.tau == pytest.approx(block_size)

        corrupted = GreedyStandIn(len(prompt), expected, 96, corrupt=True, seed=i)
        got = speculative_generate(tiny_target, drafter, prompt, 64, method=corrupted)
        assert got.tokens == expected
        seen = set(got.stats.accept_lengths)
        if block_size <= 4:  # enough steps to see the cache cropped by every amount
            assert seen == set(range(block_size)), seen


@pytest.mark.parametrize("verify_size", [2, 5])
def test_checking_fewer_drafts_than_the_block_is_lossless_and_accepts_at_most_those(tiny_target, verify_size):
    drafter = BlockDrafter.for_target(tiny_target, block_size=8)
    for i, prompt in enumerate(PROMPTS):
        expected = ar_generate(tiny_target, prompt, 64).tokens
        perfect = GreedyStandIn(len(prompt), expected, 96, corrupt=False)
        got = speculative_generate(tiny_target, drafter, prompt, 64, method=perfect, verify_size=verify_size)
        assert got.tokens == expected
        assert all(a == verify_size - 1 for a in got.stats.accept_lengths[:-1])  # a full check every step
        corrupted = GreedyStandIn(len(prompt), expected, 96, corrupt=True, seed=i)
        got = speculative_generate(tiny_target, drafter, prompt, 64, method=corrupted, verify_size=verify_size)
        assert got.tokens == expected and max(got.stats.accept_lengths) <= verify_size - 1
    with pytest.raises(ValueError, match="verify_size must be in"):
        speculative_generate(tiny_target, drafter, PROMPTS[0], 8, verify_size=9)


def test_stop_token_inside_a_block(tiny_target):
    prompt = PROMPTS[0]
    full = ar_generate(tiny_target, prompt, 64).tokens
    # a token whose first occurrence is well inside the output, not at a block boundary
    stop_at = next(j for j in range(9, 60) if full[j] not in full[:j] and j % 8 not in (0, 7))
    stop = full[stop_at]
    drafter = BlockDrafter.for_target(tiny_target, block_size=8)
    expected = ar_generate(tiny_target, prompt, 64, stop_token_ids=[stop]).tokens
    assert expected == full[: stop_at + 1]
    got = speculative_generate(tiny_target, drafter, prompt, 64, stop_token_ids=[stop],
                               method=GreedyStandIn(len(prompt), full, 96, corrupt=False))
    assert got.tokens == expected


def test_float32_with_the_few_row_linear_rule_is_lossless(monkeypatch):
    """fp32 on CPU with the opt-in rule on: target and drafter run their few-row products as (W @ x^T)^T
    (`drelay.models.cpu_linear`); 1-row decode steps and 8-row verifications still agree."""
    from drelay.models import cpu_linear
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", 256)
    target = make_tiny_target(dtype=torch.float32)
    assert "forward" in vars(target.lm_head)  # the rule is on
    drafter = BlockDrafter.for_target(target, block_size=8)
    for i, prompt in enumerate(PROMPTS):
        expected = ar_generate(target, prompt, 48).tokens
        assert speculative_generate(target, drafter, prompt, 48).tokens == expected
        corrupted = GreedyStandIn(len(prompt), expected, 96, corrupt=True, seed=i)
        assert speculative_generate(target, drafter, prompt, 48, method=corrupted).tokens == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accepted_tokens_are_the_argmax_of_the_verification_logits(dtype):
    target = make_tiny_target(dtype=dtype)
    prompt = PROMPTS[0]
    drafter = BlockDrafter.for_target(target, block_size=5)
    continuation = ar_generate(target, prompt, 80).tokens
    decoder = SpeculativeDecoder(target, drafter, GreedyStandIn(len(prompt), continuation, 96, corrupt=True))
    state = decoder.start(prompt)
    lengths = []
    for _ in range(20):
        record = decoder.step(state)
        argmax = record.target_logits[0].argmax(-1)  # (B,)
        a = record.accept_len
        assert record.draft_tokens[0, :a].tolist() == argmax[:a].tolist()
        if a < 4:
            assert record.draft_tokens[0, a] != argmax[a]
        assert record.next_token == argmax[a]
        lengths.append(a)
    assert max(lengths) > 0  # the check above ran on real acceptances


def test_bad_decoder_settings_are_clear_errors(tiny_target):
    drafter = BlockDrafter.for_target(tiny_target, block_size=4)
    for kwargs, message in ((dict(block_size=5), r"block_size must be in \[2, 4\]"), (dict(block_size=1), "block_size"),
                            (dict(pool_size=0), "pool_size must be >= 1"), (dict(temperature=-0.5), "temperature")):
        with pytest.raises(ValueError, match=message):
            SpeculativeDecoder(tiny_target, drafter, **kwargs)


def test_context_too_long_is_a_clear_error():
    target = make_tiny_target(max_positions=32)
    drafter = BlockDrafter.for_target(target, block_size=4)
    with pytest.raises(ContextTooLongError, match="exceeds the target's context of 32"):
        speculative_generate(target, drafter, list(range(1, 30)), 8)
    with pytest.raises(ContextTooLongError):
        ar_generate(target, list(range(1, 40)), 1)


# ----------------------------------------------------------------------------- sampling (T > 0)
# 800 runs: the rule with a missing residual (the power check below) gave 50-62 at 400 runs (3 seeds) and
# its excess over the 15 degrees of freedom grows with the runs, so it stays far above the threshold at 800.
VOCAB, TEMPERATURE, RUNS = 16, 0.8, 800
CHI2_CRIT = 37.70  # chi-square, 15 degrees of freedom, p = 0.001


@torch.no_grad()
def exact_marginals(target, prompt):
    """Exact distributions of new tokens 2 and 3 by enumerating every prefix."""
    def next_probs(prefixes):
        logits = target.model(torch.tensor(prefixes)).logits[:, -1].double()
        return torch.softmax(logits / TEMPERATURE, dim=-1)
    p1 = next_probs([prompt])[0]  # (V,)
    p2_given_1 = next_probs([prompt + [a] for a in range(VOCAB)])  # (V, V)
    joint12 = p1[:, None] * p2_given_1
    p3_given_12 = next_probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    p3 = (joint12.reshape(-1, 1) * p3_given_12).sum(0)
    return joint12.sum(0), p3


def chi2(samples, probs):
    """Pearson statistic with cells of expected count < 5 merged into one."""
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs * len(samples)
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def sample_runs(target, drafter, prompt, repair, seed=0):
    gen = torch.Generator().manual_seed(seed)
    second, third = [], []
    for _ in range(RUNS):
        out = speculative_generate(target, drafter, prompt, 3, method=repair, block_size=3,
                                   temperature=TEMPERATURE, generator=gen)
        second.append(out.tokens[1])
        third.append(out.tokens[2])
    return second, third


@pytest.fixture(scope="module")
def sampling_setup():
    target = make_tiny_target(vocab_size=VOCAB, init=0.5, seed=3)
    prompt = [1, 5, 7]
    drafter = BlockDrafter.for_target(target, block_size=3)
    greedy = ar_generate(target, prompt, 4).tokens
    return target, prompt, drafter, greedy, exact_marginals(target, prompt)


@pytest.mark.parametrize("drafts", ["untrained", "greedy"])
def test_speculative_sampling_matches_the_target_distribution(sampling_setup, drafts):
    target, prompt, drafter, greedy, (p2, p3) = sampling_setup
    repair = None if drafts == "untrained" else GreedyStandIn(len(prompt), greedy, VOCAB, corrupt=False)
    second, third = sample_runs(target, drafter, prompt, repair)
    assert chi2(second, p2) < CHI2_CRIT
    assert chi2(third, p3) < CHI2_CRIT


def test_the_sampling_check_catches_a_missing_residual(sampling_setup, monkeypatch):
    """Power check: the same statistic rejects a rule that resamples from p (not the residual)."""
    target, prompt, drafter, greedy, (p2, p3) = sampling_setup

    def biased(draft_tokens, probs, generator=None, rule="residual"):
        p_draft = probs[:, :-1].gather(-1, draft_tokens[..., None]).squeeze(-1)
        u = torch.rand(p_draft.shape, generator=generator, dtype=probs.dtype)
        accept_len = (u < p_draft).long().cumprod(1).sum(1)
        rows = torch.arange(probs.shape[0])
        return accept_len, torch.multinomial(probs[rows, accept_len], 1, generator=generator).squeeze(1)

    monkeypatch.setattr(generate_mod, "rejection_accept", biased)
    repair = GreedyStandIn(len(prompt), greedy, VOCAB, corrupt=False)
    second, third = sample_runs(target, drafter, prompt, repair)
    assert max(chi2(second, p2), chi2(third, p3)) > CHI2_CRIT
