"""support_loss: the fused linear + CE + support hinge equals dflash_ce and support_hinge of the
materialised logits, forward and gradients (vs autograd of the reference), with labels inside, at the
edge of and outside the top-k, padding, and vocabulary chunks that do not divide V."""

import random

import pytest
import torch

from drelay.config import DRelayLiteSettings, DRelaySettings
from drelay.kernels.reference import support_loss_ref
from drelay.kernels.support_loss import support_loss
from drelay.models.drafter import BlockDrafter
from drelay.models.relay import DRelay
from drelay.data.records import IGNORE, make_batch
from drelay.training.distill import generate_batch
from drelay.training.trainer import block_hidden, mixed_precision
from tests.conftest import make_tiny_target
from tests.kernels.conftest import close


def _problem(lead, n, H, V, k, seed, device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, n, H, generator=gen, dtype=torch.float64).to(device, dtype)
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5).to(device, dtype)
    labels = torch.randint(0, V, (*lead, n), generator=gen).to(device)
    ranked = (hidden @ weight.T).topk(k + 1, dim=-1).indices  # (..., n, k+1)
    flat, ranked = labels.view(-1, n), ranked.view(-1, n, k + 1)
    flat[0, 0], flat[0, 1] = ranked[0, 0, 0], ranked[0, 1, k - 1]  # the top-1; the k-th (hinge edge)
    if n > 2:
        flat[-1, 2] = ranked[-1, 2, k]  # just outside the pool
    flat[-1, -1] = IGNORE  # padding
    return hidden, weight, labels


@pytest.mark.parametrize("lead, n, H, V, k, chunk", [((2,), 5, 24, 601, 4, 200), ((2, 3), 3, 17, 150, 8, 64),
                                                    ((1,), 7, 16, 40, 1, 40)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("hinge_gamma", [None, 2.0])
def test_forward_and_gradients_match_reference(device, lead, n, H, V, k, chunk, seed, hinge_gamma):
    hidden, weight, labels = _problem(lead, n, H, V, k, seed, device)
    results = []
    for impl in (support_loss, support_loss_ref):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kwargs = {"chunk_size": chunk} if impl is support_loss else {}
        ce, hinge, pool_ids, pool_logprobs = impl(x, w, labels, k, 4.0, 1.0, hinge_gamma, **kwargs)
        (0.7 * ce + 1.9 * hinge).backward()
        results.append((ce, hinge, pool_ids, pool_logprobs, x.grad, w.grad))
    (ce, hinge, ids, logprobs, gx, gw), (ref_ce, ref_hinge, ref_ids, ref_logprobs, ref_gx, ref_gw) = results
    close(ce, ref_ce)
    close(hinge, ref_hinge)
    assert torch.equal(ids, ref_ids) and ids.shape == (*lead, n, k)
    close(logprobs, ref_logprobs)
    close(gx, ref_gx)
    close(gw, ref_gw)
    assert float(ref_gw.abs().sum()) > 0 and float(hinge.detach()) > 0


def test_frozen_head_gets_no_gradient(device, monkeypatch):
    """The LM head is the target's, frozen: only dx is computed (here with the CUDA block sizes)."""
    monkeypatch.setattr("drelay.kernels.support_loss.interpreting", lambda: False)
    hidden, weight, labels = _problem((3,), 4, 20, 333, 5, 2, device)
    x = hidden.clone().requires_grad_()
    ce, hinge, _, _ = support_loss(x, weight, labels, 5, 4.0, 0.5, chunk_size=300)
    (ce + hinge).backward()
    ref_x = hidden.clone().requires_grad_()
    ref_ce, ref_hinge, _, _ = support_loss_ref(ref_x, weight, labels, 5, 4.0, 0.5)
    (ref_ce + ref_hinge).backward()
    close(x.grad, ref_x.grad)
    assert weight.grad is None


def test_launcher_names_the_bad_argument(device):
    hidden, weight, labels = _problem((2,), 3, 8, 30, 4, 0, device)
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 3\)"):
        support_loss(hidden, weight, labels[:, :2], 4, 4.0)
    with pytest.raises(ValueError, match=r"k must be in \[1, V-1=29\]"):
        support_loss(hidden, weight, labels, 30, 4.0)


@pytest.mark.parametrize("settings", [DRelaySettings, DRelayLiteSettings])
def test_joint_drelay_loss_through_the_kernel(kernels, settings):
    """DRelay's joint loss (v2 and paper-literal): fused terms = the logits path. Under the trainer's bf16
    autocast the reference rounds the logits to bf16 and the kernel keeps them fp32: bf16 tolerance there."""
    target = make_tiny_target(vocab_size=64, dtype=torch.float32, seed=2, init=0.3)
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=4)
    relay = DRelay.create(drafter, settings(reader_dim=32, reader_layers=2, reader_heads=4), pool_size=4, seed=0)
    seqs = generate_batch(target, [[1, 5, 7, 9], [1, 20, 21]], 10, set())
    batch = make_batch(seqs, 2, 4, random.Random(0))
    terms, grads = {}, {}
    for mode in ("reference", "triton"):
        kernels(mode)
        relay.attach(target.embed_tokens)  # the ops are chosen when the relay is attached
        drafter.zero_grad()
        with mixed_precision("cpu", "bfloat16"):
            loss, terms[mode] = relay.joint_loss(drafter, block_hidden(drafter, batch), batch.labels,
                                                 batch.anchor_ids, gamma=4.0, progress=1.0)
        loss.backward()
        grads[mode] = drafter.fc.weight.grad.clone()
    assert float(terms["triton"]["ce"]) != float(terms["reference"]["ce"])  # two paths: fp32 vs bf16 logits
    for name in ("loss", "ce", "hinge", "repair"):
        torch.testing.assert_close(terms["triton"][name], terms["reference"][name], rtol=2e-2, atol=2e-2)
    # the backbone's gradient: bf16-rounded CE gradients in the reference, fp32 in the kernel (measured: cos 0.9988)
    cosine = torch.nn.functional.cosine_similarity(grads["triton"].flatten(), grads["reference"].flatten(), dim=0)
    assert float(cosine) > 0.99 and float(grads["reference"].norm()) > 0
