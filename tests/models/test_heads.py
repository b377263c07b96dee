"""Baseline repair heads (dflash2 / domino / dspark): shapes, parallel teacher-forced pass = sequential
repair, causality, untrained = native top-1, gradient flow, lossless decoding through the engine, a
synthetic task each head must learn, Domino's λ schedule, and save/load."""

import dataclasses
from dataclasses import make_dataclass

import pytest
import torch
from torch import nn

from drelay.models.repair import DraftBlock
from drelay.decoding.generate import ar_generate, speculative_generate
from drelay.models.drafter import OUT_OF_VOCAB, BlockDrafter
from drelay.models.heads import (HEADS, DFlash2Config, DominoConfig, DominoHead, DSparkHead, HeadError, RepairHead,
                                 to_columns)
from drelay.models.methods import create_method, load_method, method_class
from drelay.kernels.reference import candidate_pool
from drelay.data.records import IGNORE
from tests.conftest import make_tiny_target
from tests.methods import Hook

V, H, N, K = 40, 16, 5, 4  # vocabulary, width, drafted positions per block, pool size
KINDS = list(HEADS)
TINY = {"dflash2": {"pool_size": K, "rank": 8}, "domino": {"gru_size": 16, "rank": 8}, "dspark": {"rank": 8}}
OWN_TERMS = {"dflash2": {"selector", "pool_hit"}, "domino": {"final", "lambda"}, "dspark": {"markov_ce", "conf_bce"}}

pytestmark = pytest.mark.usefixtures("one_thread")


def as_if_trained(head: RepairHead, std: float = 0.5) -> RepairHead:
    """Every head starts as the native top-1 (a zero output layer); random weights everywhere stand in
    for a trained head, so its choices depend on the prefix and really change."""
    torch.manual_seed(1)
    for p in head.parameters():
        nn.init.normal_(p, std=std)
    return head


def _head(kind: str, trained: bool = True, dtype=torch.float64, **kw) -> RepairHead:
    torch.manual_seed(0)
    cfg = HEADS[kind].config_cls(hidden_size=H, vocab_size=V, block_size=N + 1, **(TINY[kind] | kw))
    embed = nn.Embedding(V, H).to(dtype).requires_grad_(False)
    head = HEADS[kind](cfg).to(dtype).attach(embed)
    return as_if_trained(head) if trained else head


def _block(b: int = 4, seed: int = 1, hidden=None, logits=None) -> DraftBlock:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, N, V, generator=gen, dtype=torch.float64) * 2 if logits is None else logits
    hidden = torch.randn(b, N, H, generator=gen, dtype=torch.float64) if hidden is None else hidden
    anchor = torch.randint(0, V, (b,), generator=gen)
    pool_ids, pool_logprobs = candidate_pool(logits, K)
    return DraftBlock(anchor, torch.zeros(b, dtype=torch.long), hidden, logits, pool_ids, pool_logprobs)


def _lead(t: torch.Tensor) -> torch.Tensor:
    """(4, ...) -> (2, 2, ...): blocks as (b, nA) in training."""
    return t.reshape(2, 2, *t.shape[1:])


def _labels(block: DraftBlock, seed: int = 2) -> torch.Tensor:
    """True tokens: pool members at random ranks, some outside the pool, one row padded at the end."""
    gen = torch.Generator().manual_seed(seed)
    b = block.pool_ids.shape[0]
    labels = block.pool_ids.gather(-1, torch.randint(0, K, (b, N, 1), generator=gen)).squeeze(-1)
    labels = torch.where(torch.rand(b, N, generator=gen) < 0.3, torch.randint(0, V, (b, N), generator=gen), labels)
    labels[0, -2:] = IGNORE
    return labels


# ------------------------------------------------------------------------------ 1. shapes, terms
@pytest.mark.parametrize("kind", KINDS)
def test_shapes_and_finite_terms(kind):
    head, block = _head(kind), _block()
    tokens, sigma = head.select(block, return_scores=True)
    width = K if kind == "dflash2" else V
    assert tokens.shape == (4, N) and tokens.dtype == torch.long and sigma.shape == (4, N, width)
    assert torch.equal(head(block), tokens)  # forward = select
    labels = _labels(block)
    loss, terms = head.training_loss(_lead(block.hidden), _lead(block.logits), _lead(labels),
                                     _lead(block.anchor_ids), gamma=4.0, progress=0.75)
    flat, _ = head.training_loss(block.hidden, block.logits, labels, block.anchor_ids, gamma=4.0, progress=0.75)
    torch.testing.assert_close(loss, flat, rtol=1e-12, atol=1e-12)  # leading dims are only a batch
    assert set(terms) == {"loss", "ce", "acc", "native_acc"} | OWN_TERMS[kind]
    assert loss.dim() == 0 and all(bool(torch.isfinite(t)) and not t.requires_grad for t in terms.values())
    assert float(terms["loss"]) == float(loss.detach())
    if kind == "dspark":
        conf = head.confidence(block)
        assert conf.shape == (4, N) and bool(((conf > 0) & (conf < 1)).all())


# ------------------------------------------------------------------------------ 2. parallel = sequential
@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forced_scores_equal_sequential_select(kind):
    head, block = _head(kind), _block()
    labels = _labels(block)
    sigma, ids = head.scores(block.hidden, block.logits, block.anchor_ids, labels)
    _, seq_sigma = head.select(block, return_scores=True, prefix_ids=labels)  # sequential, fed the true prefix
    torch.testing.assert_close(sigma, seq_sigma, rtol=1e-10, atol=1e-10)
    if kind == "dflash2":
        assert torch.equal(ids, block.pool_ids)
    lead_sigma, _ = head.scores(_lead(block.hidden), _lead(block.logits), _lead(block.anchor_ids), _lead(labels))
    torch.testing.assert_close(lead_sigma.reshape(sigma.shape), sigma, rtol=1e-12, atol=1e-12)
    # unforced: the run on its own choices = the parallel pass fed those choices
    tokens, own_sigma = head.select(block, return_scores=True)
    assert bool((tokens != block.pool_ids[..., 0]).any())  # the randomised head does replace
    torch.testing.assert_close(head.scores(block.hidden, block.logits, block.anchor_ids, tokens)[0], own_sigma,
                               rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------ 3. causality
@pytest.mark.parametrize("kind", KINDS)
def test_position_i_ignores_everything_after_it(kind):
    head, block = _head(kind), _block()
    labels = _labels(block).clamp(min=0)
    gen = torch.Generator().manual_seed(5)
    p = 2  # 0-based; prefix_ids[:, j] (the true y_{j+1}) is first read at position j+1
    hidden, logits, prefix = block.hidden.clone(), block.logits.clone(), labels.clone()
    hidden[:, p:] = torch.randn(hidden[:, p:].shape, generator=gen, dtype=hidden.dtype)
    logits[:, p:] = torch.randn(logits[:, p:].shape, generator=gen, dtype=logits.dtype) * 2
    prefix[:, p - 1:] = (prefix[:, p - 1:] + torch.randint(1, V, prefix[:, p - 1:].shape, generator=gen)) % V
    base = head.scores(block.hidden, block.logits, block.anchor_ids, labels)[0]
    changed = head.scores(hidden, logits, block.anchor_ids, prefix)[0]
    assert torch.equal(changed[:, :p], base[:, :p]) and not torch.allclose(changed[:, p], base[:, p])
    prefix_only = labels.clone()
    prefix_only[:, p - 1] = prefix[:, p - 1]  # the predecessor of position p alone
    changed = head.scores(block.hidden, block.logits, block.anchor_ids, prefix_only)[0]
    assert torch.equal(changed[:, :p], base[:, :p]) and not torch.allclose(changed[:, p], base[:, p])
    # the sequential repair: what it chooses and scores before p ignores the block and the fed prefix from p on
    later = DraftBlock(block.anchor_ids, block.anchor_pos, hidden, logits, *candidate_pool(logits, K))
    assert torch.equal(head.select(later)[:, :p], head.select(block)[:, :p])
    _, fed = head.select(block, return_scores=True, prefix_ids=labels)
    _, fed_later = head.select(later, return_scores=True, prefix_ids=prefix)
    assert torch.equal(fed_later[:, :p], fed[:, :p]) and not torch.allclose(fed_later[:, p], fed[:, p])


# ------------------------------------------------------------------------------ 4. untrained = native
@pytest.mark.parametrize("kind", KINDS)
def test_an_untrained_head_picks_the_native_top1(kind):
    head, block = _head(kind, trained=False), _block(b=8)
    tokens, sigma = head.select(block, return_scores=True)
    assert torch.equal(tokens, block.pool_ids[..., 0]) and torch.equal(tokens, block.logits.argmax(-1))
    native = block.pool_logprobs.double() if kind == "dflash2" else block.logits
    assert torch.equal(sigma, native)  # the correction is exactly zero, not just small


# ------------------------------------------------------------------------------ 4b. draft vocabulary
COLUMNS = torch.tensor([0, 3, 4, 9, 11, 17, 20, 26, 31, 38])  # a draft vocabulary: the ids the drafter scores


def test_to_columns_maps_ids_to_their_column_and_everything_else_to_ignore():
    tokens = torch.tensor([[0, 9, 38, 5], [IGNORE, 39, 17, 1]])
    assert to_columns(tokens, COLUMNS).tolist() == [[0, 3, 9, IGNORE], [IGNORE, IGNORE, 5, IGNORE]]
    assert to_columns(tokens, None) is tokens


@pytest.mark.parametrize("kind", KINDS)
def test_logits_over_the_draft_vocabulary_give_the_vocabulary_wide_choices_and_losses(kind):
    """A drafter with a draft vocabulary gives every other id the logit OUT_OF_VOCAB. A head fed only the
    draft vocabulary's columns (block.logit_ids; training: columns=) picks the same tokens with the same
    scores on them, and its loss and gradients are those of the V-wide pass."""
    gen = torch.Generator().manual_seed(3)
    narrow_logits = torch.randn(4, N, len(COLUMNS), generator=gen, dtype=torch.float64) * 2
    wide_logits = torch.full((4, N, V), OUT_OF_VOCAB, dtype=torch.float64).index_copy(-1, COLUMNS, narrow_logits)
    head, wide = _head(kind), _block(logits=wide_logits)
    narrow = dataclasses.replace(wide, logits=narrow_logits, logit_ids=COLUMNS)
    tokens, sigma = head.select(wide, return_scores=True)
    narrow_tokens, narrow_sigma = head.select(narrow, return_scores=True)
    assert torch.isin(tokens, COLUMNS).all() and bool((tokens != wide.pool_ids[..., 0]).any())
    assert torch.equal(narrow_tokens, tokens)
    # (dflash2's pool log-probs are float32: their normaliser over 10 or 40 columns rounds differently)
    torch.testing.assert_close(narrow_sigma, sigma if kind == "dflash2" else sigma[..., COLUMNS], rtol=1e-6, atol=1e-6)
    labels = _labels(wide)  # ~30% random ids: some outside the columns, no loss can lower their CE
    assert bool((~torch.isin(labels, COLUMNS) & (labels != IGNORE)).any())
    kept = torch.where(torch.isin(labels, COLUMNS), labels, IGNORE)  # what the trainer feeds (drafts_only_vocab)
    hidden = wide.hidden.clone().requires_grad_(True)
    losses = {}
    for name, logits, columns in (("wide", wide_logits, None), ("narrow", narrow_logits, COLUMNS)):
        logits = logits.clone().requires_grad_(True)
        head.zero_grad()
        loss, terms = head.training_loss(hidden, logits, kept, wide.anchor_ids, gamma=4.0, progress=0.75,
                                         columns=columns)
        loss.backward()
        grads = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters() if p.grad is not None]
        logit_grad = logits.grad
        if columns is not None:
            logit_grad = torch.zeros_like(wide_logits).index_copy(-1, COLUMNS, logit_grad)
        losses[name] = terms, grads, logit_grad
        hidden.grad = None
    (terms, grads, logit_grad), (n_terms, n_grads, n_logit_grad) = losses["wide"], losses["narrow"]
    assert set(n_terms) == set(terms)
    for name in terms:
        torch.testing.assert_close(n_terms[name], terms[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert len(n_grads) == len(grads)
    for g_narrow, g_wide in zip(n_grads, grads):
        torch.testing.assert_close(g_narrow, g_wide, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(n_logit_grad, logit_grad, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ 5. gradient flow
BLOCKED_AT_START = {"dflash2": {"predecessor", "hidden_proj.weight"},  # each multiplied by S = 0
                    "domino": {"gru.weight_ih_l0", "gru.weight_hh_l0", "correction.0.weight"},  # behind W_b = 0
                    "dspark": set()}  # W1 reaches the loss through the confidence head too


def _grads(head: RepairHead) -> dict[str, bool]:
    return {name: p.grad is not None and bool(p.grad.abs().sum() > 0) for name, p in head.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_reaches_every_head_weight_after_one_step_and_the_hidden_states(kind):
    head, block = _head(kind, trained=False, dtype=torch.float32), _block()
    hidden = block.hidden.float().requires_grad_(True)  # leaves: what the drafter would receive
    logits = block.logits.float().requires_grad_(True)
    labels = _labels(block)

    def backward():
        head.zero_grad()
        hidden.grad = logits.grad = None
        # progress 1: Domino's λ is 0 (at progress 0, λ = 1 and the head gets no gradient at all)
        head.training_loss(hidden, logits, labels, block.anchor_ids, gamma=4.0, progress=1.0)[0].backward()

    backward()  # step 0: the zero-initialised output layer blocks the gradient of what lies behind it
    assert {name for name, ok in _grads(head).items() if not ok} == BLOCKED_AT_START[kind]
    torch.optim.SGD(head.parameters(), lr=0.5).step()
    backward()
    assert all(_grads(head).values()), [name for name, ok in _grads(head).items() if not ok]
    assert float(logits.grad.abs().sum()) > 0  # the DFlash CE (and dflash2's pool scores) train z
    # and the head's own path into h_i: W_h h (dflash2), [h; r] (domino), the confidence head (dspark)
    assert float(hidden.grad.abs().sum()) > 0


# ------------------------------------------------------------------------------ 6. lossless through the engine
PROMPTS = [[1, 5, 7, 9, 3], [1, 20, 21], [1, 17, 18, 19, 20]]


@pytest.mark.parametrize("kind", KINDS)
def test_engine_with_a_head_is_lossless(kind):
    target = make_tiny_target(vocab_size=24, init=0.3, seed=2)  # float64
    drafter = BlockDrafter.for_target(target, block_size=4)
    settings = make_dataclass("Settings", [(k, type(v)) for k, v in TINY[kind].items() if k != "pool_size"])
    head = as_if_trained(create_method(kind, drafter, settings(**{k: v for k, v in TINY[kind].items()
                                                                  if k != "pool_size"}), 4, seed=0), std=1.0)
    assert head.dtype == torch.float64 and head.shared.embed_tokens is target.embed_tokens
    replaced = []

    def counting(block):
        tokens = head(block)
        replaced.append(int((tokens != block.pool_ids[..., 0]).sum()))
        return tokens

    for prompt in PROMPTS:
        spec = speculative_generate(target, drafter, prompt, 30, method=Hook(counting), pool_size=4)
        assert spec.tokens == ar_generate(target, prompt, 30).tokens
    assert sum(replaced) > 0  # the head did change drafts, and the output stayed identical


# ------------------------------------------------------------------------------ 7. a learnable task, λ schedule
def _bigram_task(b: int, table: torch.Tensor, gen: torch.Generator):
    """True tokens follow a fixed bigram table, y_i = table[y_{i-1}] from the anchor, except after the
    tokens where table < 0: there y_i is random (nothing can predict it; DSpark's confidence should learn
    that). The drafter's logits are random with y_i moved into the pool: at rank 0 (native right) 30% of
    the time, else at rank 1..k-1. Hidden states are noise plus a constant coordinate (real ones have a
    mean direction too), through which a head whose correction reads h (dflash2's W_h h_i) can express a
    plain bigram."""
    anchors = torch.randint(0, V, (b,), generator=gen)
    chain = [anchors]
    for _ in range(N):
        follow = table[chain[-1]]
        chain.append(torch.where(follow < 0, torch.randint(0, V, (b,), generator=gen), follow))
    labels = torch.stack(chain[1:], dim=1)  # (b, N)
    logits = torch.randn(b, N, V, generator=gen) * 2
    rank = torch.where(torch.rand(b, N, generator=gen) < 0.3, 0, torch.randint(1, K, (b, N), generator=gen))
    other = logits.topk(K, dim=-1).indices.gather(-1, rank[..., None])  # the token now at that rank
    z_label, z_other = logits.gather(-1, labels[..., None]), logits.gather(-1, other)
    logits.scatter_(-1, other, z_label).scatter_(-1, labels[..., None], z_other)  # swap the two
    hidden = torch.randn(b, N, H, generator=gen)
    hidden[..., 0] = 1.0
    block = DraftBlock(anchors, torch.zeros(b, dtype=torch.long), hidden, logits, *candidate_pool(logits, K))
    return block, labels


def _accepted(tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean accepted length: the matching prefix of each block."""
    return float((tokens == labels).long().cumprod(1).sum(1).float().mean())


@pytest.mark.parametrize("kind", KINDS)
def test_a_synthetic_bigram_repair_is_learned(kind):
    head = _head(kind, trained=False, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(V, generator=gen)
    table[torch.randperm(V, generator=gen)[: V // 4]] = -1  # a quarter of the tokens: unpredictable successor
    held, held_labels = _bigram_task(256, table, gen)
    native = _accepted(held.pool_ids[..., 0], held_labels)  # ~0.43; a perfect bigram repair reaches ~3
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-2)
    steps = 300
    for step in range(steps):
        # fresh draws each step: on one fixed set of 256 blocks dflash2 and domino memorise the noise in h
        # (training accuracy 1.0) and generalise less
        block, labels = _bigram_task(64, table, gen)
        loss, _ = head.training_loss(block.hidden, block.logits, labels, block.anchor_ids,
                                     gamma=4.0, progress=step / steps)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tokens = head.select(held)
    assert _accepted(tokens, held_labels) > native + 2.0, (native, _accepted(tokens, held_labels))
    if kind == "dspark":  # the confidence head separates its right choices from its wrong ones (~0.90 vs ~0.63)
        conf, right = head.confidence(held), tokens == held_labels
        assert float(conf[right].mean()) > float(conf[~right].mean()) + 0.15


def test_domino_lambda_anneals_linearly_then_stays_zero():
    head = _head("domino", anneal_fraction=0.4)
    assert head.lambda_at(0.0) == 1.0
    assert head.lambda_at(0.2) == pytest.approx(0.5)
    assert head.lambda_at(0.1) == pytest.approx(0.75)
    assert head.lambda_at(0.4) == 0.0 and head.lambda_at(0.7) == 0.0 and head.lambda_at(1.0) == 0.0
    assert _head("domino", anneal_fraction=0.0).lambda_at(0.0) == 0.0
    block = _block()
    labels = _labels(block)
    _, start = head.training_loss(block.hidden, block.logits, labels, block.anchor_ids, gamma=4.0, progress=0.0)
    assert float(start["loss"]) == pytest.approx(float(start["ce"]))  # λ = 1: the plain base CE
    _, mid = head.training_loss(block.hidden, block.logits, labels, block.anchor_ids, gamma=4.0, progress=0.2)
    assert float(mid["loss"]) == pytest.approx(0.5 * float(mid["ce"]) + 0.5 * float(mid["final"]))
    with pytest.raises(ValueError, match="progress"):
        head.lambda_at(1.5)


# ------------------------------------------------------------------------------ 8. save / load
@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_never_stores_the_embedding(kind, tmp_path):
    # float32: load_folder builds the module in the default dtype before copying the weights in, so a
    # float64 head would come back rounded through float32 (the same for the drafter and the relay)
    head = _head(kind, dtype=torch.float32)
    embed = head.shared.embed_tokens
    state = head.state_dict()
    assert not any("shared" in key or "embed_tokens" in key for key in state)
    assert not any(v.shape == embed.weight.shape and torch.equal(v, embed.weight) for v in state.values())
    head.save(tmp_path / kind / "head")
    loaded = load_method(kind, tmp_path / kind, embed)
    assert type(loaded) is HEADS[kind] and loaded.config == head.config and loaded.shared.embed_tokens is embed
    assert all(torch.equal(loaded.state_dict()[key], value) for key, value in state.items())
    block = _block()
    assert torch.equal(loaded.select(block), head.select(block))
    with pytest.raises(HeadError, match=str(tmp_path / "nowhere")):
        HEADS[kind].load(tmp_path / "nowhere")


def test_registry_configs_and_binding_fail_clearly():
    with pytest.raises(ValueError, match="unknown repair method 'medusa'"):
        method_class("medusa")
    with pytest.raises(ValueError, match="rank"):
        DFlash2Config(hidden_size=H, vocab_size=V, rank=0)
    with pytest.raises(ValueError, match="anneal_fraction"):
        DominoConfig(hidden_size=H, vocab_size=V, anneal_fraction=1.5)
    with pytest.raises(HeadError, match="does not fit"):
        _head("dspark").attach(nn.Embedding(V + 1, H))
    with pytest.raises(HeadError, match="attach"):
        DominoHead(DominoConfig(hidden_size=H, vocab_size=V, gru_size=8, rank=8)).double().select(_block())
    # dflash2 and dspark keep their own token tables: they repair without the embedding
    assert DSparkHead(_head("dspark").config).double().select(_block()).shape == (4, N)
