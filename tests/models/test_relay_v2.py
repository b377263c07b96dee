"""DRelay v2's parts (DESIGN §1.3-§1.6) one by one: the lattice table agrees with its teacher-forced
term, the messages are the lattice's exact forward/backward log-marginals, the beam never finds a path
worse than the greedy walk, a calibrated σ is float32 on a bf16 relay, co-adaptation reaches the
backbone's logits, ω stops at the first true token outside the pool, and `drelay-lite` is the same
method with every part off."""

import itertools
import math
import random

import pytest
import torch

from drelay.config import DRelayLiteSettings, DRelaySettings, JointConfig, load_params, to_dict
from drelay.data.records import make_batch
from drelay.kernels.reference import candidate_pool, dflash_ce, lattice_messages
from drelay.models.drafter import OUT_OF_VOCAB, BlockDrafter
from drelay.models.methods import create_method
from drelay.models.relay import DRelay, DRelayLite, Lattice
from drelay.models.relay_loss import prefix_weights, reachable_positions
from drelay.models.repair import DraftBlock
from drelay.training.distill import generate_batch
from drelay.training.trainer import block_hidden
from tests.conftest import make_tiny_target
from tests.models.test_relay import V, _block, _relay

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_lattice_table_holds_the_teacher_forced_term_of_every_pool_predecessor():
    relay, block = _relay(variant="v2"), _block()
    table = relay.lattice.table(block.anchor_ids, block.pool_ids, block.hidden)  # (b, n, k, k)
    b, n, k = block.pool_ids.shape
    for p in range(k):  # predecessor: the anchor at position 1, candidate p of position i-1 after it
        prev = torch.cat([block.anchor_ids[:, None], block.pool_ids[:, :-1, p]], dim=1)
        forced = relay.lattice.forced(prev, block.hidden, block.pool_ids)  # (b, n, k)
        torch.testing.assert_close(table[:, 1:, p], forced[:, 1:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(table[:, 0, p], forced[:, 0], rtol=1e-12, atol=1e-12)  # every row: the anchor
    assert float(table.detach().abs().max()) > 0.1


def test_messages_are_the_exact_log_marginals_of_the_lattice():
    gen = torch.Generator().manual_seed(0)
    N, n, k = 2, 4, 3
    unary = torch.randn(N, n, k, generator=gen, dtype=torch.float64)
    table = torch.randn(N, n, k, k, generator=gen, dtype=torch.float64)
    table[:, 0] = table[:, 0, :1]  # position 0: every row is the anchor's
    got = lattice_messages(unary, table)  # (N, n, k, 3)
    # brute force: every path c_0..c_{n-1}, weight exp(Σ u_i(c_i) + T_i(c_{i-1}, c_i))
    for row in range(N):
        marginal = torch.zeros(n, k, dtype=torch.float64)
        for path in itertools.product(range(k), repeat=n):
            score = sum(unary[row, i, c] + table[row, i, path[i - 1] if i else 0, c] for i, c in enumerate(path))
            for i, c in enumerate(path):
                marginal[i, c] += math.exp(score)
        smoothed = (marginal / marginal.sum(-1, keepdim=True)).log()
        torch.testing.assert_close(got[row, ..., 2], smoothed, rtol=1e-10, atol=1e-10)
        # the forward message at the last position is the last position's marginal
        torch.testing.assert_close(got[row, -1, :, 0], smoothed[-1], rtol=1e-10, atol=1e-10)
    assert got.dtype == torch.float64


def _path_value(relay, block, tokens, repair_margin=0.0):
    """Σ_i Π_{m<=i} π_m of a path under the relay's own π (σ fed that path, the native given δ)."""
    sigma, _ = relay.score(block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids, tokens)
    sigma = sigma.clone()
    sigma[..., 0] += repair_margin
    j = (block.pool_ids == tokens[..., None]).long().argmax(-1)
    pi = torch.softmax(sigma, -1).gather(-1, j[..., None]).squeeze(-1)
    return pi.cumprod(-1).sum(-1)


@pytest.mark.parametrize("prefix_model", ["gru", "attn"])
def test_the_beam_finds_a_path_at_least_as_good_as_the_greedy_walk(prefix_model):
    block = _block(b=8, seed=3)
    greedy = _relay(prefix_model, variant="v2")
    assert torch.equal(_relay(prefix_model, variant="v2", beam_width=1).select(block), greedy.select(block))
    beam = _relay(prefix_model, variant="v2", beam_width=3)
    tokens, sigma = beam.select(block, return_scores=True)
    assert bool((block.pool_ids == tokens[..., None]).any(-1).all())  # every choice from its pool
    sigma_of_path, _ = beam.score(block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids, tokens)
    torch.testing.assert_close(sigma, sigma_of_path, rtol=1e-9, atol=1e-9)  # σ along the chosen path
    greedy_tokens = greedy.select(block)
    v_beam, v_greedy = _path_value(beam, block, tokens), _path_value(beam, block, greedy_tokens)
    assert bool((v_beam >= v_greedy - 1e-9).all()) and bool((v_beam > v_greedy + 1e-6).any())


def test_a_calibrated_sigma_is_float32_on_a_bf16_relay():
    block = _block()
    for variant, dtype in (("v2", torch.float32), ("lite", torch.bfloat16)):
        relay = _relay(variant=variant).to(torch.bfloat16)
        relay.attach(torch.nn.Embedding(V, 16).to(torch.bfloat16).requires_grad_(False))
        bf16 = type(block)(block.anchor_ids, block.anchor_pos, block.hidden.to(torch.bfloat16), None,
                           block.pool_ids, block.pool_logprobs.float())
        _, sigma = relay.select(bf16, return_scores=True)
        assert sigma.dtype == dtype


def _joint(settings, seed=0):
    target = make_tiny_target(vocab_size=48, dtype=torch.float32, seed=4)
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=4)
    relay = DRelay.create(drafter, settings, pool_size=4, seed=seed)
    seqs = generate_batch(target, [[1, 5, 7, 9], [1, 20, 21, 30]], 10, set())
    batch = make_batch(seqs, 3, 4, random.Random(0))
    return drafter, relay, batch


@pytest.mark.parametrize("coadapt", [False, True])
def test_co_adaptation_lets_the_repair_loss_shape_the_backbones_logits(coadapt):
    """With only the repair loss (no CE, no support), the drafter's final norm (which only the logits
    read) gets a gradient exactly when s inside σ keeps its gradient. At the start every other term of
    σ is zero (the MLP's last layer, S), so without co-adaptation the backbone learns nothing from the
    repair loss at all (diagnosis 3 of the v2 issue)."""
    settings = DRelaySettings(reader_dim=32, reader_heads=4, coadapt=coadapt, lambda_support=0.0,
                              ce_weight_final=0.0, lattice_ce=0.0)
    drafter, relay, batch = _joint(settings)
    loss, terms = relay.joint_loss(drafter, block_hidden(drafter, batch), batch.labels, batch.anchor_ids, gamma=4.0,
                                   progress=1.0)  # w_ce = ce_weight_final = 0
    torch.testing.assert_close(loss, terms["repair"], rtol=1e-6, atol=1e-6)
    loss.backward()
    for param in (drafter.norm.weight, drafter.fc.weight):
        assert (param.grad is not None and float(param.grad.abs().sum()) > 0) == coadapt


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_the_vocabulary_wide_lattice_ce_trains_rows_of_tokens_outside_every_pool(weight):
    """σ reads the lattice over the pools only, so the repair loss reaches just the successor rows S[c] of pool
    tokens; the lattice CE (softmax over all V of z + L) reaches every row, as DSpark's bigram is trained. Its
    value is the position-weighted CE of z + L, which at the start (S = 0) is the drafter's own CE."""
    settings = DRelaySettings(reader_dim=32, reader_heads=4, lattice_ce=weight)
    drafter, relay, batch = _joint(settings)
    hidden = block_hidden(drafter, batch)
    loss, terms = relay.joint_loss(drafter, hidden, batch.labels, batch.anchor_ids, gamma=4.0, progress=0.0)
    loss.backward()
    pool_ids, _ = candidate_pool(drafter.logits(hidden).detach(), relay.config.pool_size)
    outside = torch.ones(relay.config.vocab_size, dtype=torch.bool)
    outside[pool_ids.flatten()] = False
    grad = relay.lattice.successor.grad[outside].abs().sum(-1)  # (tokens in no pool,)
    assert bool(outside.any())
    if weight:
        assert bool((grad > 0).all())
        ce, _ = dflash_ce(drafter.logits(hidden), batch.labels, 4.0)
        torch.testing.assert_close(terms["lattice_ce"], ce.detach(), rtol=1e-5, atol=1e-5)
    else:
        assert float(grad.sum()) == 0.0 and "lattice_ce" not in terms


@pytest.mark.parametrize("coadapt", [False, True])
def test_a_coadapted_lattice_ce_trains_the_backbones_logits(coadapt):
    """lattice_coadapt: the lattice CE's z keeps its gradient, so with every other term off the drafter's final
    norm (read only by the logits) learns from it; detached (the default), only the lattice and h do."""
    settings = DRelaySettings(reader_dim=32, reader_heads=4, coadapt=False, lambda_support=0.0, lambda_repair=0.0,
                              ce_weight_final=0.0, lattice_coadapt=coadapt)
    drafter, relay, batch = _joint(settings)
    loss, terms = relay.joint_loss(drafter, block_hidden(drafter, batch), batch.labels, batch.anchor_ids, gamma=4.0,
                                   progress=1.0)
    torch.testing.assert_close(loss, terms["lattice_ce"])
    loss.backward()
    grad = drafter.norm.weight.grad
    assert (grad is not None and float(grad.abs().sum()) > 0) == coadapt
    assert float(relay.lattice.successor.grad.abs().sum()) > 0


def test_a_bigram_lattice_holds_a_term_of_the_tokens_alone_that_the_hidden_state_modulates():
    """lattice_bigram: with W_h zeroed, L_i(p, c) is the plain low-rank bigram <P[p], S[c]>/√r (W_h's bias starts
    at 1), the same at every position whatever h_i; the bias-free lattice is zero there. Every lattice term
    (teacher-forced, over the pools, over the vocabulary) is the same function."""
    torch.manual_seed(0)
    N, n, k, H, r = 2, 3, 4, 16, 8
    for bigram in (False, True):
        lattice = Lattice(V, H, r, bigram)
        torch.nn.init.normal_(lattice.successor)
        torch.nn.init.zeros_(lattice.hidden_proj.weight)
        prev, hidden = torch.randint(0, V, (N, n)), torch.randn(N, n, H)
        full = lattice.vocabulary(prev, hidden)  # (N, n, V)
        expected = lattice.predecessor[prev] @ lattice.successor.T / r ** 0.5 if bigram else torch.zeros(N, n, V)
        torch.testing.assert_close(full, expected)
        pool = torch.randint(0, V, (N, n, k))
        torch.testing.assert_close(lattice.forced(prev, hidden, pool), full.gather(-1, pool))
        anchor = torch.randint(0, V, (N,))
        table = lattice.table(anchor, pool, hidden)  # (N, n, k, k): row p = pool_{i-1, p}
        torch.testing.assert_close(table[:, 1:, 2], lattice.forced(pool[:, :-1, 2], hidden[:, 1:], pool[:, 1:]))
    assert Lattice(V, H, r, True).hidden_proj.bias.eq(1).all()


def test_a_lattice_pool_is_the_top_k_of_the_corrected_logits_after_its_own_natives():
    """lattice_pool: with S = 0 the pool is exactly the drafter's (ids and log-probs); with a trained lattice the
    pool reaches tokens outside z's top-k, its s stays log_softmax(z), inference builds each position's pool
    after the previous position's lattice native, and teacher-forcing those natives gives the same pools.
    joint_loss trains on the pools after the true tokens; select returns tokens of its own pools."""
    settings = DRelaySettings(reader_dim=32, reader_heads=4, lattice_rank=8, lattice_pool=True, lattice_bigram=True)
    drafter, relay, batch = _joint(settings)
    assert relay.needs_logits and relay.config.lattice_pool
    hidden = block_hidden(drafter, batch)  # (b, nA, n, H)
    b, nA, n, H = hidden.shape
    logits = drafter.logits(hidden).detach().reshape(b * nA, n, -1)
    hidden, anchors = hidden.detach().reshape(b * nA, n, H), batch.anchor_ids.reshape(-1)
    with torch.no_grad():
        plain_ids, plain_lp = candidate_pool(logits, relay.config.pool_size)
        ids, lp = relay.lattice_pool(logits, hidden, anchors)
        assert torch.equal(ids, plain_ids) and torch.allclose(lp, plain_lp)
        torch.nn.init.normal_(relay.lattice.successor, std=10.0)
        ids, lp = relay.lattice_pool(logits, hidden, anchors)
        assert not bool((ids[..., :, None] == plain_ids[..., None, :]).any(-1).all())  # tokens outside z's top-k
        torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, ids))
        forced, _ = relay.lattice_pool(logits, hidden, anchors, prefix_ids=ids[..., 0])
        assert torch.equal(forced, ids)
    loss, terms = relay.joint_loss(drafter, block_hidden(drafter, batch), batch.labels, batch.anchor_ids, gamma=4.0,
                                   progress=0.0)
    loss.backward()
    assert bool(torch.isfinite(loss)) and float(relay.lattice.successor.grad.abs().sum()) > 0
    block = DraftBlock(anchors, anchors * 0, hidden, logits, plain_ids, plain_lp)
    tokens = relay.select(block)
    assert bool((ids == tokens[..., None]).any(-1).all())  # every choice is from the relay's own pool
    with pytest.raises(Exception, match="logits"):
        relay.select(DraftBlock(anchors, anchors * 0, hidden, None, plain_ids, plain_lp))


def test_a_lattice_pool_over_a_draft_vocabulary_is_the_pool_over_all_ids():
    """narrow_logits: the lattice pool over the draft vocabulary's columns (block.logit_ids) is the pool over all V
    whose other ids have the OUT_OF_VOCAB logit, teacher-forced and walked, and select picks the same tokens."""
    settings = DRelaySettings(reader_dim=32, reader_heads=4, lattice_rank=8, lattice_pool=True, lattice_bigram=True)
    drafter, relay, batch = _joint(settings)
    assert relay.narrow_logits
    torch.nn.init.normal_(relay.lattice.successor, std=10.0)
    hidden = block_hidden(drafter, batch).detach()
    b, nA, n, H = hidden.shape
    hidden, anchors = hidden.reshape(b * nA, n, H), batch.anchor_ids.reshape(-1)
    vocab = relay.config.vocab_size
    vocab_ids = torch.randperm(vocab)[: vocab // 2].sort().values
    narrow = drafter.logits(hidden).detach()[..., vocab_ids]
    wide = torch.full((*narrow.shape[:-1], vocab), OUT_OF_VOCAB).index_copy(-1, vocab_ids, narrow)
    with torch.no_grad():
        for prefix in (None, batch.labels.reshape(-1, n)):
            ids_w, lp_w = relay.lattice_pool(wide, hidden, anchors, prefix)
            ids_n, lp_n = relay.lattice_pool(narrow, hidden, anchors, prefix, ids=vocab_ids)
            assert torch.equal(ids_w, ids_n) and bool(torch.isin(ids_n, vocab_ids).all())
            torch.testing.assert_close(lp_w, lp_n)
        pool_ids, pool_lp = candidate_pool(narrow, relay.config.pool_size)
        tokens_w = relay.select(DraftBlock(anchors, anchors * 0, hidden, wide, vocab_ids[pool_ids], pool_lp))
        tokens_n = relay.select(DraftBlock(anchors, anchors * 0, hidden, narrow, vocab_ids[pool_ids], pool_lp,
                                           logit_ids=vocab_ids))
    assert torch.equal(tokens_w, tokens_n)


def test_the_ce_weight_falls_to_its_final_value_over_training():
    drafter, relay, batch = _joint(DRelaySettings(reader_dim=32, reader_heads=4, ce_weight_final=0.25, lattice_ce=0.0))
    hidden = block_hidden(drafter, batch)
    totals = {}
    for progress in (0.0, 1.0):
        loss, terms = relay.joint_loss(drafter, hidden, batch.labels, batch.anchor_ids, gamma=4.0, progress=progress)
        totals[progress] = float(loss - 0.1 * terms["support"] - terms["repair"]) / float(terms["ce"])
    assert totals[0.0] == pytest.approx(1.0, rel=1e-4) and totals[1.0] == pytest.approx(0.25, rel=1e-4)


def test_omega_stops_at_the_first_true_token_outside_the_pool():
    pi = torch.tensor([[0.9, 0.0, 0.8, 0.7], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    in_pool = pi > 0
    block = prefix_weights(pi, eps=0.01)  # drelay-lite: renormalised per block
    reach = prefix_weights(pi, eps=0.01, normalize=False, reachable=reachable_positions(in_pool))
    assert torch.equal(reach[0, 2:], torch.zeros(2, dtype=torch.float64))  # after the miss: nothing to repair
    assert float(block[0, 2:].sum()) > 0  # ... which the per-block renormalisation weighs again
    expected = torch.tensor([0.5 + 0.25 + 0.125 + 0.0625, 0.25 + 0.125 + 0.0625, 0.125 + 0.0625, 0.0625])
    torch.testing.assert_close(reach[1], expected.double())  # Σ_{n>=i} Π_{m<=n} π_m, as is
    assert block.sum(-1).tolist() == pytest.approx([4.0, 4.0])


def test_drelay_lite_is_drelay_with_every_v2_part_off(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("joint:\n  methods: [drelay, drelay-lite]\n  drelay-lite:\n    reader_dim: 32\n")
    joint = load_params(params, ["joint.drelay-lite.lattice_rank=16"]).joint
    lite = joint.settings("drelay-lite")
    assert isinstance(lite, DRelayLiteSettings) and lite.reader_dim == 32 and lite.lattice_rank == 16
    assert to_dict(joint)["drelay-lite"]["lattice_rank"] == 16
    defaults = DRelayLiteSettings()
    assert (defaults.token_rank, defaults.lattice_rank, defaults.calibrate, defaults.coadapt, defaults.omega) == \
        (0, 0, False, False, "block") and min(defaults.repair_margins) >= 0
    assert min(DRelaySettings().repair_margins) < 0  # v2's δ grid reaches below 0
    target = make_tiny_target(vocab_size=48, dtype=torch.float32, seed=4)
    drafter = BlockDrafter.for_target(target, block_size=4)
    method = create_method("drelay-lite", drafter, JointConfig().settings("drelay-lite"), 4, seed=0)
    assert isinstance(method, DRelayLite) and method.lattice is None and method.reader.tokens is None
    v2 = create_method("drelay", drafter, JointConfig().settings("drelay"), 4, seed=0)
    assert v2.lattice is not None and v2.reader.tokens is not None and v2.config.calibrate
    with pytest.raises(Exception, match="lattice_messages"):
        DRelaySettings(lattice_rank=0)


def test_a_first_lattice_pool_replaces_only_position_1s_candidates():
    """lattice_pool_first: position 1's pool is lattice_pool's (after the anchor), every later pool the drafter's;
    joint_loss trains through it and select picks position 1's token from that pool."""
    settings = DRelaySettings(reader_dim=32, reader_heads=4, lattice_rank=8, lattice_pool_first=True, lattice_bigram=True)
    drafter, relay, batch = _joint(settings)
    assert relay.needs_logits and relay.narrow_logits
    torch.nn.init.normal_(relay.lattice.successor, std=10.0)
    hidden = block_hidden(drafter, batch).detach()
    b, nA, n, H = hidden.shape
    hidden, anchors = hidden.reshape(b * nA, n, H), batch.anchor_ids.reshape(-1)
    logits = drafter.logits(hidden).detach()
    plain_ids, plain_lp = candidate_pool(logits, relay.config.pool_size)
    full_ids, full_lp = relay.lattice_pool(logits, hidden, anchors)
    ids, lp = relay.with_first_lattice_pool(logits, hidden, anchors, plain_ids, plain_lp)
    assert torch.equal(ids[:, 0], full_ids[:, 0]) and torch.equal(ids[:, 1:], plain_ids[:, 1:])
    torch.testing.assert_close(lp[:, 0], full_lp[:, 0])
    assert not torch.equal(ids[:, 0], plain_ids[:, 0])
    loss, _ = relay.joint_loss(drafter, block_hidden(drafter, batch), batch.labels, batch.anchor_ids, gamma=4.0,
                               progress=0.0)
    loss.backward()
    assert bool(torch.isfinite(loss)) and float(relay.lattice.successor.grad.abs().sum()) > 0
    tokens = relay.select(DraftBlock(anchors, anchors * 0, hidden, logits, plain_ids, plain_lp))
    assert bool((ids[:, 0] == tokens[:, :1]).any(-1).all())
