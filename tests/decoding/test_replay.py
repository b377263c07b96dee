"""Replay (teacher-forced decode simulation) against live decoding on the same sequences."""

import pytest
import torch

from drelay.decoding.generate import speculative_generate
from drelay.decoding.replay import precompute_blocks, replay
from drelay.models.drafter import BlockDrafter
from drelay.models.repair import Oracle
from drelay.training.distill import generate_batch
from tests.conftest import make_tiny_target

PROMPTS = [[1, 5, 7, 9, 3], [1, 20, 21], [1, 17, 18, 19, 20], [1, 8, 6]]


def _setup(block_size=4, vocab_size=24):
    # a small vocabulary so an untrained drafter's guesses are sometimes right
    target = make_tiny_target(vocab_size=vocab_size, init=0.3, seed=2)
    drafter = BlockDrafter.for_target(target, block_size=block_size)
    seqs = generate_batch(target, PROMPTS, 40, set())
    return target, drafter, seqs


def test_replay_reproduces_live_acceptance_lengths():
    target, drafter, seqs = _setup()
    stats = replay(drafter, seqs, pool_size=4, batch_size=3)
    assert len(stats.accept_lengths) == len(PROMPTS)
    total_accepted = 0
    for prompt, lengths in zip(PROMPTS, stats.accept_lengths):
        live = speculative_generate(target, drafter, prompt, 40).stats.accept_lengths
        # identical step by step; only the last step may differ (live drafts past the end)
        assert lengths[:-1] == live[: len(lengths) - 1]
        total_accepted += sum(lengths)
    assert total_accepted > 0  # the comparison covered real acceptances


@pytest.mark.parametrize("verify_size", [2, 3])
def test_checking_fewer_drafts_replays_like_the_live_engine(verify_size):
    """verify_size < B: the whole block is drafted (and repaired), the target checks its first verify_size - 1
    drafts; replay stops acceptance there exactly as the engine does, and positions past it are never reached."""
    target, drafter, seqs = _setup()
    stats = replay(drafter, seqs, pool_size=4, batch_size=3, verify_size=verify_size)
    assert max(max(lengths) for lengths in stats.accept_lengths) <= verify_size - 1
    assert stats.reached[verify_size - 1:].sum() == 0 and stats.reached[: verify_size - 1].sum() > 0
    for prompt, lengths in zip(PROMPTS, stats.accept_lengths):
        live = speculative_generate(target, drafter, prompt, 40, verify_size=verify_size).stats.accept_lengths
        assert lengths[:-1] == live[: len(lengths) - 1]
    whole = replay(drafter, seqs, pool_size=4, batch_size=3)
    assert replay(drafter, seqs, pool_size=4, batch_size=3, verify_size=4).accept_lengths == whole.accept_lengths
    with pytest.raises(ValueError, match="verify_size must be in"):
        replay(drafter, seqs, pool_size=4, verify_size=5)


def test_oracle_bounds_native_and_stats_are_consistent():
    _, drafter, seqs = _setup()
    native = replay(drafter, seqs, pool_size=4)
    oracle = replay(drafter, seqs, pool_size=4, repair=Oracle())
    assert oracle.tau >= native.tau
    assert native.replaced == 0 and native.harmed == 0
    assert oracle.harmed == 0 and oracle.replaced == oracle.replaced_right  # the oracle is never wrong
    s = native.summary("dflash_")
    assert 0 <= s["dflash_pool_hit"] <= 1 and s["dflash_accept_pos1"] <= s["dflash_pool_hit_pos1"] + 1e-9
    # any repair plugs in: a method that always proposes token 0 accepts only where 0 is right
    zeros = replay(drafter, seqs, pool_size=4, repair=lambda block: torch.zeros_like(block.pool_ids[..., 0]))
    assert zeros.replaced > 0 and zeros.tau >= 1.0


def test_per_position_repair_statistics_add_up_and_merge():
    _, drafter, seqs = _setup()

    def second_choice_at_first_position(block):  # a "repair" that always swaps position 1
        draft = block.pool_ids[..., 0].clone()
        draft[:, 0] = block.pool_ids[:, 0, 1]
        return draft

    stats = replay(drafter, seqs, pool_size=4, repair=second_choice_at_first_position)
    s = stats.summary()
    reached = stats.reached
    assert stats.replaced_at[0] == reached[0] > 0 and stats.replaced_at[1:].sum() == 0  # only position 1 swaps
    assert s["replace_rate_pos1"] == 1.0 and s["replace_rate_pos2"] == 0.0
    assert s["replace_rate"] == stats.replaced / stats.positions == pytest.approx(float(reached[0] / reached.sum()))
    assert s["harm_rate_pos1"] == float(stats.harmed_at[0] / reached[0])
    assert s["repair_precision_pos1"] == float(stats.replaced_right_at[0] / stats.replaced_at[0])
    assert stats.harmed + stats.replaced_right <= stats.replaced  # right and harmful replacements are disjoint
    # two halves replayed apart and merged are the whole
    a, b = replay(drafter, seqs[:2], pool_size=4), replay(drafter, seqs[2:], pool_size=4)
    whole, merged = replay(drafter, seqs, pool_size=4), a.merge(b)
    assert merged.taus == whole.taus and merged.steps == whole.steps
    assert torch.equal(merged.accepted_at, whole.accepted_at) and torch.equal(merged.pool_hit, whole.pool_hit)
    assert merged.summary() == whole.summary()


def test_precomputed_blocks_replay_exactly_as_the_drafter_pass_they_replace():
    """δ tuning replays the same sequences once per δ: the drafter's block at every anchor is computed once
    (several anchors per pass) and each replay only runs the hook. Same statistics, step by step, for the
    native, the oracle and a hook that reads the pool; blocks of other sequences are refused."""
    _, drafter, seqs = _setup()
    drafter = drafter.double()  # exact: a pass over 3 anchors and a pass over 1 round the same in float64
    blocks = precompute_blocks(drafter, seqs, pool_size=4, batch_size=3, anchors_per_pass=3)

    def second_choice(block):
        assert block.logits is None or block.logits.shape[-1] == 24
        return torch.where(block.pool_logprobs[..., 1] > -1.5, block.pool_ids[..., 1], block.pool_ids[..., 0])

    for repair in (None, Oracle(), second_choice):
        plain = replay(drafter, seqs, pool_size=4, repair=repair, batch_size=2)
        cached = replay(drafter, seqs, pool_size=4, repair=repair, batch_size=2, blocks=blocks)
        assert cached.accept_lengths == plain.accept_lengths and cached.taus == plain.taus
        assert torch.equal(cached.replaced_at, plain.replaced_at)
    assert sum(map(sum, plain.accept_lengths)) > 0 and plain.replaced > 0  # a real comparison
    with pytest.raises(ValueError, match="other sequences"):
        replay(drafter, seqs[:2], pool_size=4, blocks=blocks)
    with pytest.raises(ValueError, match="pool size"):
        replay(drafter, seqs, pool_size=3, blocks=blocks)


def test_anchors_drafted_together_walk_like_one_block_per_step():
    """Replay drafts several anchors' blocks per pass and walks their acceptance lengths: the same statistics,
    step by step, as one anchor per pass (the loop's own order), for any batch of sequences; `max_steps` stops
    each sequence's walk there."""
    _, drafter, seqs = _setup()
    drafter = drafter.double()  # exact: passes of different sizes round the same in float64
    one = replay(drafter, seqs, pool_size=4, batch_size=1, anchors_per_pass=1, repair=Oracle())
    for per_pass, batch in ((3, 2), (8, 4), (64, 3)):
        many = replay(drafter, seqs, pool_size=4, batch_size=batch, anchors_per_pass=per_pass, repair=Oracle())
        assert many.accept_lengths == one.accept_lengths and many.taus == one.taus and many.steps == one.steps
        for name in ("accepted_at", "reached", "pool_hit", "replaced_at", "replaced_right_at", "harmed_at"):
            assert torch.equal(getattr(many, name), getattr(one, name)), name
    assert one.replaced > 0 and sum(map(sum, one.accept_lengths)) > 0
    short = replay(drafter, seqs, pool_size=4, max_steps=2, repair=Oracle())
    assert short.accept_lengths == [lengths[:2] for lengths in one.accept_lengths] and short.steps == 2 * len(seqs)
