"""DRelay reader + selector: parallel training pass = sequential inference pass, causality of the
selector, globality of the reader, the decision rule, save/load, and the engine hook (lossless)."""

import json

import pytest
import torch
from torch import nn

from drelay.models.repair import DraftBlock
from drelay.decoding.generate import ar_generate, speculative_generate
from drelay.decoding.replay import replay
from drelay.models.drafter import BlockDrafter
from drelay.models.relay import DRelay, RelayConfig, RelayError
from drelay.kernels.reference import candidate_pool
from drelay.data.records import IGNORE
from drelay.training.distill import generate_batch
from tests.conftest import make_tiny_target
from tests.methods import Hook

V, H = 40, 16


pytestmark = pytest.mark.usefixtures("one_thread")


# DRelay v2's parts (DESIGN §1.3-§1.4) on top of the paper-literal relay: every test of this module runs
# on both where the variant is a parameter
V2 = dict(vocab_size=V, token_rank=8, lattice_rank=8, lattice_messages=True, anchor_token=True, calibrate=True)
VARIANTS = {"lite": {}, "v2": V2}


def as_if_trained(relay: DRelay) -> DRelay:
    """A residual relay starts as the drafter's own ranking (zero last layer, zero tables and lattice
    successor, unit scale); random weights there stand in for a trained one, so its decisions depend on
    the reader, the prefix and (v2) the lattice."""
    torch.manual_seed(1)
    nn.init.normal_(relay.selector.score_mlp[-1].weight, std=1.0)
    if relay.config.bilinear_rank:
        nn.init.normal_(relay.selector.prefix_proj.weight, std=0.2)
    for table in (relay.reader.tokens, relay.selector.tokens):
        if table is not None:
            nn.init.normal_(table.table.weight, std=0.5)
    if relay.lattice is not None:
        nn.init.normal_(relay.lattice.successor, std=0.3)
    if relay.config.calibrate:
        nn.init.uniform_(relay.selector.scale, 0.5, 1.5)
        nn.init.normal_(relay.selector.native_bias, std=0.3)
    return relay


def _relay(prefix_model="gru", block_size=6, pool_size=4, trained=True, variant="lite", reader_layers=2,
           **kw) -> DRelay:
    torch.manual_seed(0)
    cfg = RelayConfig(hidden_size=H, block_size=block_size, pool_size=pool_size, reader_dim=32,
                      reader_layers=reader_layers, reader_heads=4, prefix_model=prefix_model, **VARIANTS[variant], **kw)
    embed = nn.Embedding(V, H).double().requires_grad_(False)
    relay = DRelay(cfg).double().attach(embed)
    return as_if_trained(relay) if trained else relay


def _block(b=4, n=5, k=4, seed=1) -> DraftBlock:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n, V, generator=gen, dtype=torch.float64) * 2
    pool_ids, pool_logprobs = candidate_pool(logits, k)
    hidden = torch.randn(b, n, H, generator=gen, dtype=torch.float64)
    anchor = torch.randint(0, V, (b,), generator=gen)
    return DraftBlock(anchor, torch.zeros(b, dtype=torch.long), hidden, logits, pool_ids, pool_logprobs)


def _true_tokens(block: DraftBlock, seed=2) -> torch.Tensor:
    """Some true tokens inside the pool at a random rank, some outside it, one row padded at the end."""
    gen = torch.Generator().manual_seed(seed)
    b, n, k = block.pool_ids.shape
    ranks = torch.randint(0, k, (b, n, 1), generator=gen)
    labels = block.pool_ids.gather(-1, ranks).squeeze(-1)
    outside = torch.rand(b, n, generator=gen) < 0.3
    labels = torch.where(outside, torch.randint(0, V, (b, n), generator=gen), labels)
    labels[0, -2:] = IGNORE
    return labels


def test_candidate_pool_is_sorted_top_k_of_log_softmax():
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids, logprobs = candidate_pool(logits, 5)
    assert ids.shape == logprobs.shape == (2, 3, 5) and logprobs.dtype == torch.float32
    # column 0 holds a maximal logit (bf16 can tie, so compare values, not indices)
    assert torch.equal(logits.float().gather(-1, ids[..., :1]).squeeze(-1), logits.float().max(-1).values)
    assert bool((logprobs[..., :-1] >= logprobs[..., 1:]).all())
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids)
    torch.testing.assert_close(logprobs, ref)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layers", [0, 2])
def test_a_read_of_the_first_positions_is_the_whole_reads_there_and_still_sees_the_whole_block(variant, layers):
    """A walk that stops early (DraftBlock.checked) reads only the features it walks: every candidate is
    still read, and the last layer computes only the wanted tokens' outputs."""
    relay, block = _relay(variant=variant, reader_layers=layers), _block()
    args = (block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids)
    g, support, g_anchor, table = relay.read(*args)
    for positions in (1, 3, 5):
        g_p, support_p, g_anchor_p, table_p = relay.read(*args, positions=positions)
        assert g_p.shape == (4, positions, 4, 32) and support_p.shape == (4, positions, 4)
        assert torch.allclose(g_p, g[:, :positions]) and torch.allclose(support_p, support[:, :positions])
        assert (g_anchor is None and g_anchor_p is None) or torch.allclose(g_anchor_p, g_anchor)
        assert (table is None and table_p is None) or torch.equal(table_p, table)
    if layers:  # a later position's candidate still moves the first position's features
        pool_ids = block.pool_ids.clone()
        pool_ids[:, -1, 2] = (pool_ids[:, -1, 2] + 1) % V
        moved = relay.read(block.hidden, pool_ids, block.pool_logprobs, block.anchor_ids, positions=1)[0]
        assert not torch.allclose(moved, g[:, :1])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("prefix_model", ["gru", "attn"])
def test_parallel_score_equals_sequential_select(prefix_model, variant):
    relay, block = _relay(prefix_model, variant=variant), _block()
    labels = _true_tokens(block)
    in_pool = (block.pool_ids == labels[..., None]).any(-1)
    assert bool(in_pool.any()) and bool((~in_pool & (labels != IGNORE)).any())  # both feature paths run
    sigma, support = relay.score(block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids, labels)
    assert sigma.shape == support.shape == block.pool_ids.shape
    _, seq_sigma = relay.select(block, return_scores=True, prefix_ids=labels)  # teacher-forced sequential run
    torch.testing.assert_close(sigma, seq_sigma, rtol=1e-10, atol=1e-10)

    # unforced: the sequential run on its own choices = the parallel run fed those choices
    tokens, own_sigma = relay.select(block, return_scores=True)
    assert bool((tokens != block.pool_ids[..., 0]).any())  # the untrained relay does replace
    sigma2, _ = relay.score(block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids, tokens)
    torch.testing.assert_close(sigma2, own_sigma, rtol=1e-10, atol=1e-10)

    # extra leading dims (b, nA, n, ...) give the same numbers as the flat batch
    lead = lambda t: t.reshape(2, 2, *t.shape[1:])  # noqa: E731
    sigma3, _ = relay.score(lead(block.hidden), lead(block.pool_ids), lead(block.pool_logprobs),
                            lead(block.anchor_ids), lead(labels))
    torch.testing.assert_close(sigma3.reshape(sigma.shape), sigma, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prefix_model", ["gru", "attn"])
def test_selector_is_causal_given_reader_features(prefix_model):
    relay = _relay(prefix_model)
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(3, 5, 4, 32, generator=gen, dtype=torch.float64)  # (N, n, k, d)
    inputs = torch.randn(3, 5, 32, generator=gen, dtype=torch.float64)  # prefix inputs of ŷ_0..ŷ_4
    lp = -torch.rand(3, 5, 4, generator=gen, dtype=torch.float64)  # the candidates' log-probs
    base = relay.selector(g, inputs, lp)
    # random, not a constant shift: LayerNorm would ignore that
    noise = lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype)  # noqa: E731
    p = 2  # change everything the selector sees from position p on: σ at 0-based < p must not move
    g2, inputs2, lp2 = g.clone(), inputs.clone(), lp.clone()
    g2[:, p:] += noise(g2[:, p:])
    lp2[:, p:] += noise(lp2[:, p:])
    inputs2[:, p + 1:] += noise(inputs2[:, p + 1:])  # ŷ_{p+1}.. feed σ_{p+2}..
    changed = relay.selector(g2, inputs2, lp2)
    torch.testing.assert_close(changed[:, :p], base[:, :p], rtol=0, atol=0)
    assert not torch.allclose(changed[:, p], base[:, p])
    inputs3 = inputs.clone()
    inputs3[:, p] += noise(inputs3[:, p])  # ŷ_p is read by r_{p+1}, i.e. σ at 0-based p, and nothing earlier
    changed = relay.selector(g, inputs3, lp)
    torch.testing.assert_close(changed[:, :p], base[:, :p], rtol=0, atol=0)
    assert not torch.allclose(changed[:, p], base[:, p])


@pytest.mark.parametrize("variant", VARIANTS)
def test_reader_sees_the_whole_block(variant):
    relay, block = _relay(variant=variant), _block()
    pool_ids = block.pool_ids.clone()
    pool_ids[:, -1, 2] = (pool_ids[:, -1, 2] + 1) % V  # a later position's candidate changes
    g = relay.read(block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids)[0]
    g2 = relay.read(block.hidden, pool_ids, block.pool_logprobs, block.anchor_ids)[0]
    assert not torch.allclose(g[:, 0], g2[:, 0])  # ... and position 1's reader features move
    labels = block.pool_ids[..., 0]
    sigma, _ = relay.score(block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids, labels)
    sigma2, _ = relay.score(block.hidden, pool_ids, block.pool_logprobs, block.anchor_ids, labels)
    assert not torch.allclose(sigma[:, 0], sigma2[:, 0])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("prefix_model", ["gru", "attn"])
def test_an_untrained_relay_scores_the_drafters_log_probs_and_keeps_every_native(prefix_model, variant):
    block = _block()
    relay = _relay(prefix_model, trained=False, variant=variant)
    tokens, sigma = relay.select(block, return_scores=True)
    torch.testing.assert_close(sigma, block.pool_logprobs.to(sigma.dtype))
    assert torch.equal(tokens, block.pool_ids[..., 0])
    plain = _relay(prefix_model, trained=False, residual=False)  # the ablation: σ = MLP([g; r]) alone
    assert not torch.allclose(plain.select(block, return_scores=True)[1], block.pool_logprobs.double())


@pytest.mark.parametrize("variant", VARIANTS)
def test_decision_keeps_the_native_unless_an_alternative_wins_by_the_repair_margin(variant):
    relay, block = _relay(variant=variant), _block(b=8)
    tokens, sigma = relay.select(block, return_scores=True)
    gain, alt = sigma[..., 1:].max(-1)
    j = torch.where(gain - sigma[..., 0] > 0.0, alt + 1, 0)
    assert torch.equal(tokens, block.pool_ids.gather(-1, j[..., None]).squeeze(-1))
    assert bool((j > 0).any()) and bool((j == 0).any())
    assert torch.equal(relay.select(block, repair_margin=1e9), block.pool_ids[..., 0])
    # at the first position (no prefix of choices yet) a wider margin replaces a subset, strictly fewer
    first_gain = (gain - sigma[..., 0])[:, 0]
    wide = relay.select(block, repair_margin=float(first_gain[first_gain > 0].min()))
    native = block.pool_ids[..., 0]
    assert bool(((wide != native)[:, 0] <= (tokens != native)[:, 0]).all())
    assert (wide != native)[:, 0].sum() < (tokens != native)[:, 0].sum()


def test_save_load_keeps_the_repair_margin_and_never_saves_the_embedding(tmp_path):
    relay = _relay(repair_margin=0.25)
    assert not any("embed" in k and "proj" not in k for k in relay.state_dict())
    assert all(V not in v.shape for v in relay.state_dict().values())
    relay.save(tmp_path / "relay")
    loaded = DRelay.load(tmp_path / "relay", relay.shared.embed_tokens)
    assert loaded.config == relay.config and loaded.config.repair_margin == 0.25
    block = _block()
    assert torch.equal(loaded.select(block), relay.select(block))
    with pytest.raises(RelayError, match="missing"):
        DRelay.load(tmp_path / "nowhere")
    with pytest.raises(RelayError, match="attach"):
        DRelay(relay.config).double().select(block)
    with pytest.raises(ValueError, match="vocab_size"):
        RelayConfig(hidden_size=H, lattice_rank=4)
    with pytest.raises(ValueError, match="lattice_messages, lattice_bigram and lattice_pool need"):
        RelayConfig(hidden_size=H, vocab_size=V, token_rank=4, lattice_messages=True)
    # a relay saved before δ was renamed (config.json says "margin") loads with its δ
    config_file = tmp_path / "relay" / "config.json"
    old = json.loads(config_file.read_text())
    old["margin"] = old.pop("repair_margin")
    config_file.write_text(json.dumps(old))
    assert DRelay.load(tmp_path / "relay").config.repair_margin == 0.25


PROMPTS = [[1, 5, 7, 9, 3], [1, 20, 21], [1, 17, 18, 19, 20]]


def test_engine_with_relay_repair_is_lossless_and_replay_runs():
    target = make_tiny_target(vocab_size=24, init=0.3, seed=2)  # float64
    drafter = BlockDrafter.for_target(target, block_size=4)
    torch.manual_seed(0)
    relay = as_if_trained(DRelay.for_drafter(drafter, reader_dim=32, reader_heads=4, pool_size=4))
    replaced = []

    def counting(block):
        tokens = relay.select(block)
        replaced.append(int((tokens != block.pool_ids[..., 0]).sum()))
        return tokens

    live = []
    for prompt in PROMPTS:
        ar = ar_generate(target, prompt, 30).tokens
        spec = speculative_generate(target, drafter, prompt, 30, method=Hook(counting), pool_size=4)
        assert spec.tokens == ar
        assert speculative_generate(target, drafter, prompt, 30, method=relay, pool_size=4).tokens == ar
        live.append(spec.stats.accept_lengths)
    assert sum(replaced) > 0  # the relay did change drafts, and output stayed identical

    seqs = generate_batch(target, PROMPTS, 30, set())
    stats = replay(drafter, seqs, pool_size=4, repair=relay.select)
    assert stats.replaced > 0 and stats.tau >= 1.0
    for lengths, live_lengths in zip(stats.accept_lengths, live):  # replay = live, except the last step
        assert lengths[:-1] == live_lengths[: len(lengths) - 1]
