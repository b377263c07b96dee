"""The drafter's draft vocabulary (drafter.draft_vocab): only N token ids scored, outputs unchanged."""

import math
import random

import pytest
import torch

from drelay.config import DrafterConfig, JointConfig, TrainConfig
from drelay.data.records import IGNORE, make_batch, response_token_counts, split_sequences
from drelay.decoding.generate import ar_generate, speculative_generate
from drelay.decoding.replay import replay
from drelay.kernels.reference import candidate_pool, dflash_ce
from drelay.models.drafter import OUT_OF_VOCAB, BlockDrafter, DrafterError, draft_vocabulary
from drelay.models.methods import TRAINABLE, create_method
from drelay.training.distill import generate_batch
from drelay.training.trainer import block_hidden, scorable, train_dflash
from tests.conftest import make_tiny_target

VOCAB = 48
KEEP = [0, 2, 3, 5, 8, 13, 21, 30, 34, 40, 44, 47]  # 12 of 48 ids, the stop token (2) among them


def _pair(block_size=4):
    """A full-vocabulary drafter and one with the draft vocabulary KEEP, same weights."""
    target = make_tiny_target(vocab_size=VOCAB, dtype=torch.float32, init=0.3, seed=3)
    torch.manual_seed(0)
    full = BlockDrafter.for_target(target, block_size=block_size)
    narrow = BlockDrafter.for_target(target, vocab_ids=torch.tensor(KEEP[::-1]), block_size=block_size)
    narrow.load_state_dict({**full.state_dict(), "vocab_ids": narrow.vocab_ids})
    return target, full, narrow


def test_draft_vocabulary_keeps_the_always_ids_then_the_most_frequent_then_the_lowest_ids():
    counts = torch.zeros(10, dtype=torch.long)
    counts[7], counts[4], counts[9] = 5, 5, 2
    assert draft_vocabulary(counts, 3, always=[8]).tolist() == [4, 7, 8]  # 8 always; 4 and 7 tie: both in
    assert draft_vocabulary(counts, 4).tolist() == [0, 4, 7, 9]  # then the unseen ids by id: 0
    assert draft_vocabulary(counts, 10).tolist() == list(range(10))
    with pytest.raises(ValueError, match="draft vocabulary size 11"):
        draft_vocabulary(counts, 11)
    with pytest.raises(ValueError, match="draft_vocab"):
        DrafterConfig(draft_vocab=-1)


def test_logits_equal_the_full_heads_on_the_kept_ids_and_nothing_else_is_ever_drafted():
    target, full, narrow = _pair()
    assert narrow.vocab_ids.tolist() == KEEP and narrow.head_weight().shape == (len(KEEP), target.hidden_size)
    hidden = torch.randn(3, 5, target.hidden_size)
    z_full, z = full.logits(hidden), narrow.logits(hidden)
    torch.testing.assert_close(z[..., KEEP], z_full[..., KEEP])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[KEEP] = False
    assert (z[..., outside] == OUT_OF_VOCAB).all()
    logits, pool_ids, pool_logprobs = narrow.pool(hidden, 4)
    assert torch.isin(pool_ids, torch.tensor(KEEP)).all()
    # the pool's log-probabilities: a softmax over the kept ids alone
    expected = torch.log_softmax(z_full[..., KEEP], -1).topk(4, dim=-1).values
    torch.testing.assert_close(pool_logprobs, expected)
    # taken over the N kept ids, the pool is the one over the V-wide logits; those are made only when asked
    wide_ids, wide_logprobs = candidate_pool(z, 4)
    assert torch.equal(pool_ids, wide_ids) and torch.equal(logits, z)
    torch.testing.assert_close(pool_logprobs, wide_logprobs, rtol=0, atol=1e-6)
    no_logits, ids_again, _ = narrow.pool(hidden, 4, with_logits=False)
    assert no_logits is None and torch.equal(ids_again, pool_ids)


def test_the_narrow_cross_entropy_equals_the_wide_one_and_ignores_ids_it_cannot_draft():
    target, _, narrow = _pair()
    hidden = torch.randn(2, 2, 3, target.hidden_size, requires_grad=True)
    labels = torch.tensor([[[5, 6, IGNORE], [47, 1, 2]], [[13, 21, 30], [9, 9, 9]]])
    kept = narrow.drafts_only_vocab(labels, IGNORE)
    assert kept.tolist() == [[[5, IGNORE, IGNORE], [47, IGNORE, 2]], [[13, 21, 30], [IGNORE] * 3]]
    wide, _ = dflash_ce(narrow.logits(hidden), kept, gamma=4.0)
    logits, rows = narrow.scored_logits(hidden, kept, IGNORE)
    assert logits.shape[-1] == len(KEEP) and rows[0, 0, 0] == KEEP.index(5)
    narrow_ce, _ = dflash_ce(logits, rows, gamma=4.0)
    torch.testing.assert_close(narrow_ce, wide)
    assert torch.isfinite(wide)
    (grad_wide,) = torch.autograd.grad(wide, hidden)
    (grad_narrow,) = torch.autograd.grad(narrow_ce, hidden)
    torch.testing.assert_close(grad_narrow, grad_wide)


def test_the_lattice_ce_over_the_draft_vocabulary_equals_the_vocabulary_wide_one():
    """DRelay's lattice CE with a draft vocabulary normalises over its ids only: the ids the drafter never scores
    have z = OUT_OF_VOCAB and add nothing, so value and gradients (hidden, P, S) equal the whole-vocabulary CE."""
    from drelay.config import DRelaySettings
    from drelay.models.relay import DRelay

    target, _, narrow = _pair()
    relay = DRelay.create(narrow, DRelaySettings(reader_dim=32, reader_heads=4), pool_size=4, seed=0)
    torch.nn.init.normal_(relay.lattice.successor, std=0.5)  # S starts at 0: give the bigram term a value
    hidden = torch.randn(2, 3, target.hidden_size, requires_grad=True)
    labels = narrow.drafts_only_vocab(torch.tensor([[5, 13, 47], [21, 9, 2]]), IGNORE)  # 9: not draftable
    anchors = torch.tensor([3, 40])
    logits = narrow.logits(hidden)
    wide_ce = relay.lattice_ce(hidden, logits, labels, anchors, 4.0)  # softmax over all 48 ids
    narrow_ce = relay.lattice_ce(hidden, logits, labels, anchors, 4.0, narrow)  # over the 12 draft ids
    assert torch.isfinite(wide_ce)
    torch.testing.assert_close(narrow_ce, wide_ce)
    params = [hidden, relay.lattice.successor, relay.lattice.predecessor]
    wide_grads = torch.autograd.grad(wide_ce, params, retain_graph=True)
    for g_wide, g_narrow in zip(wide_grads, torch.autograd.grad(narrow_ce, params)):
        torch.testing.assert_close(g_narrow, g_wide)


def test_the_draft_vocabulary_is_saved_and_loaded_with_the_drafter(tmp_path):
    target, _, narrow = _pair()
    narrow.save(tmp_path / "d")
    loaded = BlockDrafter.load(tmp_path / "d", target)
    assert loaded.config.draft_vocab_size == len(KEEP) and loaded.vocab_ids.tolist() == KEEP
    hidden = torch.randn(2, 3, target.hidden_size)
    torch.testing.assert_close(loaded.logits(hidden), narrow.logits(hidden))
    with pytest.raises(DrafterError, match="distinct ids"):
        BlockDrafter.for_target(target, vocab_ids=torch.tensor([1, 1, 2]))


def test_decoding_with_a_draft_vocabulary_stays_lossless_and_replay_matches_live():
    target, _, narrow = _pair()
    prompts = [[1, 5, 7, 9, 3], [1, 20, 21], [1, 17, 18, 19, 20]]
    for prompt in prompts:
        ar = ar_generate(target, prompt, 24)
        spec = speculative_generate(target, narrow, prompt, 24)
        assert spec.tokens == ar.tokens
    seqs = generate_batch(target, prompts, 24, set())
    stats = replay(narrow, seqs, pool_size=4)
    for prompt, lengths in zip(prompts, stats.accept_lengths):
        live = speculative_generate(target, narrow, prompt, 24).stats.accept_lengths
        assert lengths[:-1] == live[: len(lengths) - 1]


def test_training_with_a_draft_vocabulary_counts_only_what_it_can_draft(tmp_path):
    target = make_tiny_target(vocab_size=24, dtype=torch.float32, seed=2, init=0.12)
    target.set_layer_ids([1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 24, (4,), generator=gen).tolist() for _ in range(48)]
    train, val = split_sequences(generate_batch(target, prompts, 24, set()), 0.25, seed=0)
    counts = response_token_counts(train, target.vocab_size)
    assert int(counts.sum()) == sum(s.response_len for s in train)
    seen = int((counts > 0).sum())
    vocab_ids = draft_vocabulary(counts, seen - 2)  # two seen ids left out: labels the drafter cannot score
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, vocab_ids=vocab_ids, block_size=4).float()
    batch = scorable(make_batch(train[:4], 4, 4, random.Random(0)), drafter)
    assert not torch.isin(batch.labels, torch.tensor([i for i in range(24) if i not in vocab_ids.tolist()])).any()
    cfg = TrainConfig(max_steps=60, blocks_per_step=32, anchors_per_sequence=4, lr=3e-3, warmup_steps=2,
                      eval_every=10, checkpoint_every=30, patience=0, out_dir=str(tmp_path / "drafter"),
                      checkpoint_dir=str(tmp_path / "ckpt"))
    result = train_dflash(drafter, train, val, cfg, pool_size=4, seed=0)
    assert all(torch.isfinite(torch.tensor(h["val_loss"])) for h in result.history)
    assert min(h["val_loss"] for h in result.history) < result.history[0]["val_loss"] - 0.1


@pytest.mark.parametrize("name", TRAINABLE)
def test_every_method_trains_and_decodes_on_a_drafter_with_a_draft_vocabulary(name):
    target, _, narrow = _pair()
    narrow = narrow.float()
    method = create_method(name, narrow, JointConfig().settings(name), 4, seed=0)
    prompts = [[1, 5, 7, 9, 3], [1, 20, 21]]
    batch = scorable(make_batch(generate_batch(target, prompts, 16, set()), 3, 4, random.Random(0)), narrow)
    narrow.zero_grad()
    loss, terms = method.joint_loss(narrow, block_hidden(narrow, batch), batch.labels, batch.anchor_ids,
                                    gamma=4.0, progress=0.5)
    loss.backward()
    assert all(math.isfinite(float(v)) for v in terms.values()) and float(terms["ce"]) > 0
    assert float(narrow.fc.weight.grad.norm()) > 0
    with torch.no_grad():  # a trained-looking method: random weights moved off the "keep" start
        for p in method.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    method.eval()
    for prompt in prompts:
        spec = speculative_generate(target, narrow, prompt, 20, method=method, pool_size=4)
        assert spec.tokens == ar_generate(target, prompt, 20).tokens


@pytest.mark.parametrize("name", ["dflash2", "domino", "dspark"])
def test_replay_and_the_engine_hand_a_head_the_draft_vocabularys_logits_with_the_same_outcome(name):
    """A head (narrow_logits) gets the logits over the N draft ids and their ids (block.logit_ids); a plain
    hook wrapping the same head gets them V-wide. Both repair every block the same way."""
    target, _, narrow = _pair()
    method = create_method(name, narrow.float(), JointConfig().settings(name), 4, seed=0)
    with torch.no_grad():  # trained-looking: off the native start
        for p in method.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    seen = []

    def wide_hook(block):
        seen.append(block.logits.shape[-1])
        return method.select(block)

    seqs = generate_batch(target, [[1, 5, 7, 9, 3], [1, 20, 21]], 20, set())
    wide = replay(narrow, seqs, pool_size=4, repair=wide_hook)
    narrow_stats = replay(narrow, seqs, pool_size=4, repair=method)
    assert set(seen) == {VOCAB} and narrow_stats.accept_lengths == wide.accept_lengths
    assert narrow_stats.replaced_at.sum() > 0 and torch.equal(narrow_stats.replaced_at, wide.replaced_at)
    engine = []
    original = method.select
    method.select = lambda block, **kw: engine.append(block.logit_ids) or original(block, **kw)
    speculative_generate(target, narrow, [1, 5, 7, 9, 3], 12, method=method, pool_size=4)
    assert engine and all(torch.equal(ids, narrow.vocab_ids) for ids in engine)


def test_a_relay_on_a_draft_vocabulary_has_a_table_row_per_draft_id_plus_one_and_scores_as_a_wide_one(tmp_path):
    """DRelay's token tables and lattice on a drafter with N draft ids have N + 1 rows: one per draft id, one shared
    by every other id (an anchor or a predecessor outside the vocabulary). A V-wide relay whose rows copy them
    (every outside id the shared row) gives the same joint loss, terms and choices, and the compact rows' gradients
    are the wide rows' summed by the row they read; saved and loaded, the relay keeps its row map."""
    from drelay.config import DRelaySettings
    from drelay.models.relay import DRelay
    from drelay.models.repair import DraftBlock

    target, full, narrow = _pair()
    settings = DRelaySettings(reader_dim=32, reader_heads=4, token_rank=8, lattice_rank=16)
    compact = DRelay.create(narrow, settings, pool_size=4, seed=0)
    wide = DRelay.create(full, settings, pool_size=4, seed=0)
    n = len(KEEP)
    rows = compact.lattice.index.row_of
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[KEEP] = False
    assert compact.config.table_rows == n + 1 and wide.config.table_rows == 0
    assert rows[KEEP].tolist() == list(range(n)) and set(rows[outside].tolist()) == {n}
    tables = ("lattice.predecessor", "lattice.successor", "reader.tokens.table.weight",
              "selector.tokens.table.weight")
    state = compact.state_dict()
    assert all(state[name].shape[0] == n + 1 for name in tables) and wide.state_dict()[tables[0]].shape[0] == VOCAB
    for name in tables:
        torch.nn.init.normal_(state[name], std=0.5)  # S and the token tables start at 0: give them values
    wide.load_state_dict({k: (v[rows] if k in tables else v) for k, v in state.items() if not k.endswith("row_of")})

    hidden = torch.randn(2, 3, target.hidden_size)
    labels = narrow.drafts_only_vocab(torch.tensor([[5, 13, 47], [21, 9, 2]]), IGNORE)
    anchors = torch.tensor([9, 40])  # 9: outside the draft vocabulary, its lattice row is the shared one
    losses = {}
    for name, relay in (("compact", compact), ("wide", wide)):
        loss, terms = relay.joint_loss(narrow, hidden, labels, anchors, gamma=4.0, progress=0.5)
        grads = torch.autograd.grad(loss, [dict(relay.named_parameters())[t] for t in tables])
        losses[name] = (loss, terms, grads)
    torch.testing.assert_close(losses["compact"][0], losses["wide"][0])
    for key, value in losses["wide"][1].items():
        torch.testing.assert_close(losses["compact"][1][key], value)
    for g_compact, g_wide in zip(losses["compact"][2], losses["wide"][2]):
        torch.testing.assert_close(g_compact, torch.zeros_like(g_compact).index_add_(0, rows, g_wide))
    assert losses["compact"][2][0][n].abs().sum() > 0  # the shared row learned from the outside anchor

    with torch.no_grad():
        _, pool_ids, pool_logprobs = narrow.pool(hidden, 4)
        block = DraftBlock(anchors, anchors * 0, hidden, None, pool_ids, pool_logprobs)
        chosen = compact.select(block)
        torch.testing.assert_close(chosen, wide.select(block))
        compact.save(tmp_path / "relay")
        loaded = DRelay.load(tmp_path / "relay", target.embed_tokens)
        assert loaded.lattice.index.row_of.tolist() == rows.tolist()
        torch.testing.assert_close(loaded.select(block), chosen)
