"""DRelay losses (DESIGN §1.6): support hinge, reader BCE, prefix weights ω against autograd, the
repair loss, gradient flow of the joint loss, and a synthetic repair task that must be learned."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from drelay.models.repair import DraftBlock
from drelay.models.drafter import BlockDrafter
from drelay.models.relay import DRelay, RelayConfig
from drelay.kernels.reference import candidate_pool
from drelay.data.records import IGNORE, make_batch
from drelay.training.distill import generate_batch
from drelay.models.relay_loss import drelay_loss, drelay_loss_from_terms, prefix_weights, reader_bce, repair_loss
from drelay.kernels.reference import pool_index, support_hinge
from tests.conftest import make_tiny_target


pytestmark = pytest.mark.usefixtures("one_thread")


def test_support_hinge_matches_a_plain_loop_and_ignores_padding():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 10, generator=gen)
    labels = torch.tensor([[1, 4, 9], [0, IGNORE, 7]])
    k, margin = 3, 0.5
    terms = []
    for b in range(2):
        for i in range(3):
            y = int(labels[b, i])
            if y == IGNORE:
                continue
            competitors = sorted((float(z) for v, z in enumerate(logits[b, i]) if v != y), reverse=True)
            terms.append(F.softplus(torch.tensor(competitors[k - 1] - float(logits[b, i, y]) + margin)))
    torch.testing.assert_close(support_hinge(logits, labels, k, margin), torch.stack(terms).mean())
    changed = logits.clone()
    changed[1, 1] += 5.0  # the padded position
    torch.testing.assert_close(support_hinge(changed, labels, k, margin), support_hinge(logits, labels, k, margin))
    # a label far above everything costs ~0; far below the k-th competitor costs ~the gap
    sure = torch.zeros(1, 10)
    sure[0, 3] = 50.0
    assert float(support_hinge(sure, torch.tensor([3]), 2, 1.0)) < 1e-12
    assert abs(float(support_hinge(-sure, torch.tensor([3]), 2, 1.0)) - 51.0) < 1e-4


def test_reader_bce_targets_the_label_inside_the_pool():
    support = torch.tensor([[2.0, -1.0, 0.5], [0.0, 1.0, -2.0]])
    pool = torch.tensor([[4, 7, 9], [1, 2, 3]])
    labels = torch.tensor([7, IGNORE])
    expected = F.binary_cross_entropy_with_logits(support[0], torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(reader_bce(support, pool, labels), expected)


def _expected_accept(log_pi: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """E[accepted length] = Σ_n Π_{m<=n} π_m over valid positions, written as a plain loop."""
    total = log_pi.new_zeros(())
    for row in range(log_pi.shape[0]):
        reach = log_pi.new_ones(())
        for n in range(log_pi.shape[1]):
            if valid[row, n]:
                reach = reach * log_pi[row, n].exp()
                total = total + reach
    return total


def test_prefix_weights_are_the_gradient_of_expected_accepted_length():
    gen = torch.Generator().manual_seed(0)
    pi = torch.rand(4, 7, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    valid = torch.ones(4, 7, dtype=torch.bool)
    valid[1, 5:] = False  # a block running past the sequence end
    log_pi = pi.log().requires_grad_(True)
    (grad,) = torch.autograd.grad(_expected_accept(log_pi, valid), log_pi)
    raw = prefix_weights(pi, eps=1e-6, valid=valid, normalize=False)
    torch.testing.assert_close(raw, grad, rtol=1e-12, atol=1e-12)
    assert float(raw[1, 5:].abs().sum()) == 0.0
    normed = prefix_weights(pi, eps=1e-6, valid=valid)
    expected = grad / grad.sum(-1, keepdim=True) * valid.sum(-1, keepdim=True)  # mean 1 over valid positions
    torch.testing.assert_close(normed, expected, rtol=1e-12, atol=1e-12)
    assert bool((normed[:, :-1] >= normed[:, 1:]).all())  # earlier positions never weigh less
    # π = 0 (true token outside the pool) is floored at eps, not a zero that kills the block
    pi[2, 0] = 0.0
    floored = pi.clone()
    floored[2, 0] = 0.01
    torch.testing.assert_close(prefix_weights(pi, eps=0.01), prefix_weights(floored, eps=0.01))
    assert bool((prefix_weights(pi, eps=0.01)[2] > 0).all())


def test_repair_loss_is_omega_weighted_ce_over_in_pool_positions():
    gen = torch.Generator().manual_seed(1)
    sigma = torch.randn(2, 3, 4, generator=gen)
    pool = torch.arange(24).view(2, 3, 4)
    labels = torch.tensor([[2, 5, 99], [14, IGNORE, IGNORE]])  # 99: outside the pool
    omega = torch.tensor([[2.0, 1.0, 5.0], [1.5, 0.0, 0.0]])
    ce = lambda b, i, j: -torch.log_softmax(sigma[b, i], -1)[j]  # noqa: E731
    expected = (2.0 * ce(0, 0, 2) + 1.0 * ce(0, 1, 1) + 1.5 * ce(1, 0, 2)) / 4.5
    torch.testing.assert_close(repair_loss(sigma, pool, labels, omega), expected)
    index, in_pool = pool_index(pool, labels)
    assert index.tolist() == [[2, 1, 0], [2, 0, 0]] and in_pool.tolist() == [[True, True, False], [True, False, False]]


@pytest.mark.parametrize("omega", ["reach", "block"])
def test_repair_positions_limit_the_repair_ce_to_the_first_positions(omega):
    """joint.drelay.repair_positions = n: the repair CE of a block is the one of its first n positions alone
    (what the target checks when decode.verify_size is n + 1); the later positions get no repair gradient,
    while the CE, hinge and reader terms still cover every position."""
    gen = torch.Generator().manual_seed(3)
    N, n, k, n_keep = 5, 6, 4, 2
    pool = torch.stack([torch.randperm(40, generator=gen)[:k] for _ in range(N * n)]).view(N, n, k)
    labels = torch.where(torch.rand(N, n, generator=gen) < 0.8, pool[..., 0], pool[..., 2])
    labels[0, 1] = 99  # outside the pool: position 2 of block 0 unreachable
    sigma = torch.randn(N, n, k, generator=gen, requires_grad=True)
    support = torch.randn(N, n, k, generator=gen)
    ce, hinge = torch.tensor(1.25), torch.tensor(0.5)
    kw = dict(lambda_support=0.1, lambda_repair=1.0, omega=omega)
    loss, cut = drelay_loss_from_terms(ce, hinge, labels, sigma, support, pool, positions=n_keep, **kw)
    _, first = drelay_loss_from_terms(ce, hinge, labels[:, :n_keep], sigma[:, :n_keep], support[:, :n_keep],
                                      pool[:, :n_keep], **kw)
    _, every = drelay_loss_from_terms(ce, hinge, labels, sigma, support, pool, **kw)
    torch.testing.assert_close(cut["repair"], first["repair"])
    assert not torch.isclose(cut["repair"], every["repair"])  # the later positions counted before
    torch.testing.assert_close(cut["reader_bce"], every["reader_bce"])  # the reader still learns every position
    (grad,) = torch.autograd.grad(loss, sigma)  # σ reaches the loss through the repair CE alone
    assert grad[:, n_keep:].abs().max() == 0 and grad[:, :n_keep].abs().max() > 0


def _nonzero_grad(module: nn.Module) -> dict[str, bool]:
    return {name: p.grad is not None and float(p.grad.abs().sum()) > 0 for name, p in module.named_parameters()}


def test_joint_loss_reaches_backbone_reader_and_selector():
    target = make_tiny_target(vocab_size=24, dtype=torch.float32, seed=2, init=0.3)
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=4)
    relay = DRelay.for_drafter(drafter, reader_dim=32, reader_heads=4, pool_size=8)
    seqs = generate_batch(target, [[1, 5, 7, 9], [1, 20, 21], [1, 8, 6, 3]], 12, set())
    batch = make_batch(seqs, 3, 4, random.Random(0))

    def forward():
        b, T = batch.tokens.shape
        ctx_kv = drafter.context_kv(batch.features, torch.arange(T).expand(b, T))
        hidden = drafter.forward_anchored(ctx_kv, batch.anchors, batch.anchor_ids)  # (b, nA, B-1, H)
        logits = drafter.logits(hidden)
        pool_ids, pool_logprobs = candidate_pool(logits.detach(), 8)
        sigma, support = relay.score(hidden, pool_ids, pool_logprobs, batch.anchor_ids, batch.labels)
        return logits, sigma, support, pool_ids

    logits, sigma, support, pool_ids = forward()
    assert sigma.shape == pool_ids.shape == (3, 3, 3, 8)
    assert bool(pool_index(pool_ids, batch.labels)[1].any())  # some true tokens are in the pool
    loss, terms = drelay_loss(logits, batch.labels, sigma, support, pool_ids, gamma=4.0)
    assert set(terms) >= {"loss", "ce", "support", "hinge", "reader_bce", "repair"}
    assert all(bool(torch.isfinite(t)) for t in terms.values()) and float(terms["repair"]) > 0
    loss.backward()
    # the selector's last layer starts at zero (σ = the drafter's log-prob): the first step moves it
    # (and the reader through its support head); one step later the gradient reaches every weight
    grads = _nonzero_grad(relay)
    assert grads["selector.score_mlp.2.weight"] and grads["reader.layers.0.qkv.weight"]
    assert not grads["selector.prefix.weight_hh_l0"]
    torch.optim.SGD(relay.parameters(), lr=0.1).step()
    drafter.zero_grad(), relay.zero_grad()
    logits, sigma, support, pool_ids = forward()
    drelay_loss(logits, batch.labels, sigma, support, pool_ids, gamma=4.0)[0].backward()
    assert all(_nonzero_grad(relay).values()), [n for n, ok in _nonzero_grad(relay).items() if not ok]
    assert _nonzero_grad(drafter)["fc.weight"] and _nonzero_grad(drafter)["layers.0.attn.q_proj.weight"]
    assert target.embed_tokens.weight.grad is None  # E stays frozen

    # the repair term alone reaches the backbone too: through h_i in the reader
    drafter.zero_grad(), relay.zero_grad()
    logits, sigma, support, pool_ids = forward()
    _, in_pool = pool_index(pool_ids, batch.labels)
    repair_loss(sigma, pool_ids, batch.labels, torch.ones_like(in_pool, dtype=torch.float32)).backward()
    assert _nonzero_grad(drafter)["fc.weight"] and _nonzero_grad(drafter)["layers.0.down_proj.weight"]


V, H, B, K = 64, 16, 8, 4


def _synthetic(b: int, gen: torch.Generator):
    """Random blocks whose native is right half the time; otherwise the true token sits at rank 1..k-1,
    and that rank is written (one-hot) only into the NEXT position's hidden state (the last position's
    into the first): a repair needs the reader's view across positions."""
    n = B - 1
    pool_ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(b * n)]).view(b, n, K)
    pool_logprobs = (-4 * torch.rand(b, n, K, generator=gen)).sort(-1, descending=True).values
    rank = torch.where(torch.rand(b, n, generator=gen) < 0.5, 0, torch.randint(1, K, (b, n), generator=gen))
    hidden = torch.randn(b, n, H, generator=gen)
    hidden[..., :K] = 2 * F.one_hot(rank.roll(1, dims=1), K).float()
    labels = pool_ids.gather(-1, rank[..., None]).squeeze(-1)
    anchors = torch.randint(0, V, (b,), generator=gen)
    return DraftBlock(anchors, torch.zeros(b, dtype=torch.long), hidden, None, pool_ids, pool_logprobs), labels


def _repair_stats(relay: DRelay, block: DraftBlock, labels: torch.Tensor) -> tuple[float, float]:
    """(share of wrong natives replaced by the true token, mean accepted length) of `select`."""
    tokens = relay.select(block)
    wrong = block.pool_ids[..., 0] != labels
    repaired = ((tokens == labels) & wrong).sum() / wrong.sum()
    return float(repaired), float((tokens == labels).long().cumprod(1).sum(1).float().mean())


def test_a_synthetic_repair_task_is_learned():
    torch.manual_seed(0)
    embed = nn.Embedding(V, H).requires_grad_(False)
    # the reader's view across positions is what this task needs; the bilinear prefix term is off (with it,
    # 400 steps reach a repair rate of 0.14 here instead of 0.52)
    cfg = RelayConfig(hidden_size=H, block_size=B, pool_size=K, reader_dim=32, reader_heads=4, bilinear_rank=0)
    relay = DRelay(cfg).attach(embed)
    gen = torch.Generator().manual_seed(1)
    held_out, held_labels = _synthetic(256, gen)
    native_accept = float((held_out.pool_ids[..., 0] == held_labels).long().cumprod(1).sum(1).float().mean())
    repair0, accept0 = _repair_stats(relay, held_out, held_labels)
    optimizer = torch.optim.Adam(relay.parameters(), lr=1e-2)
    for _ in range(400):
        block, labels = _synthetic(64, gen)
        sigma, support = relay.score(block.hidden, block.pool_ids, block.pool_logprobs, block.anchor_ids, labels)
        index, in_pool = pool_index(block.pool_ids, labels)
        pi = torch.softmax(sigma.detach(), -1).gather(-1, index[..., None]).squeeze(-1) * in_pool
        loss = reader_bce(support, block.pool_ids, labels) + repair_loss(sigma, block.pool_ids, labels,
                                                                         prefix_weights(pi, 1e-2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    repair1, accept1 = _repair_stats(relay, held_out, held_labels)
    assert repair1 > repair0 + 0.2, (repair0, repair1)
    assert accept1 > max(accept0, native_accept) + 1.0, (accept0, native_accept, accept1)
