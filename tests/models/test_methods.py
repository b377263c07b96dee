"""The repair-method registry: every method implements the same interface (create for a drafter from its
settings, save/load, joint loss, select, tune), an untrained one keeps every native choice, and the hand-kept
method lists of the config agree with the registry."""

import math
import random
from pathlib import Path

import pytest
import torch

from drelay.config import EVAL_METHODS, JOINT_METHODS, JointConfig
from drelay.data.records import make_batch
from drelay.models import cpu_linear
from drelay.models.drafter import BlockDrafter
from drelay.models.methods import (METHODS, TRAINABLE, create_method, load_method, load_speculator, method_class,
                                   save_method)
from drelay.models.repair import DraftBlock, Native, Oracle
from drelay.kernels.reference import candidate_pool
from drelay.training.distill import generate_batch
from drelay.training.trainer import block_hidden
from tests.conftest import make_tiny_target

POOL = 4


def test_the_config_lists_agree_with_the_registry():
    assert set(JOINT_METHODS) == set(TRAINABLE)
    assert set(EVAL_METHODS) == {"ar", *METHODS}
    assert all(method_class(name).name == name for name in METHODS)
    with pytest.raises(ValueError, match="unknown repair method 'medusa'; known: dflash, drelay"):
        method_class("medusa")


@pytest.fixture(scope="module")
def drafter_and_block():
    target = make_tiny_target(vocab_size=32, dtype=torch.float32, seed=4)
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=4)
    hidden = torch.randn(3, 3, target.hidden_size)
    logits = drafter.logits(hidden)
    pool_ids, pool_logprobs = candidate_pool(logits, POOL)
    block = DraftBlock(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]), hidden, logits, pool_ids, pool_logprobs,
                       truth=pool_ids[..., 2])
    return target, drafter, block


@pytest.mark.parametrize("name", TRAINABLE)
def test_every_trainable_method_starts_as_the_native_and_round_trips_through_its_folder(drafter_and_block, name,
                                                                                       tmp_path):
    target, drafter, block = drafter_and_block
    settings = JointConfig().settings(name)
    method = create_method(name, drafter, settings, POOL, seed=0)
    assert method.name == name and method.trainable
    assert torch.equal(method.select(block), block.pool_ids[..., 0])  # untrained: every native choice kept
    again = create_method(name, drafter, settings, POOL, seed=0)  # the seed fixes the initial weights
    assert all(torch.equal(a, b) for a, b in zip(method.state_dict().values(), again.state_dict().values()))
    save_method(method, tmp_path / name)
    loaded = load_method(name, tmp_path / name, target.embed_tokens)
    assert type(loaded) is type(method) and not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(method.state_dict().values(), loaded.state_dict().values()))
    assert torch.equal(loaded.select(block), method.select(block))
    for m in (method, loaded):  # the few-row fp32 rule only when it is on (cpu_linear.py; off in the suite)
        assert not any(getattr(lin.forward, "__func__", None) is cpu_linear._forward
                       for lin in m.modules() if type(lin) is torch.nn.Linear)
    saved = sorted(p.relative_to(tmp_path / name) for p in (tmp_path / name).rglob("*.*"))
    assert saved == ([] if method.folder_name is None else
                     [Path(method.folder_name, "config.json"), Path(method.folder_name, "model.safetensors")])


@pytest.mark.parametrize("name", TRAINABLE)
def test_every_joint_loss_has_the_common_terms_and_reaches_the_backbone(drafter_and_block, name):
    target, drafter, _ = drafter_and_block
    method = create_method(name, drafter, JointConfig().settings(name), POOL, seed=0)
    seqs = generate_batch(target, [[1, 5, 7, 9], [1, 20, 21]], 10, set())
    batch = make_batch(seqs, 2, 4, random.Random(0))
    drafter.zero_grad()
    loss, terms = method.joint_loss(drafter, block_hidden(drafter, batch), batch.labels, batch.anchor_ids,
                                    gamma=4.0, progress=0.75)
    loss.backward()
    assert {"loss", "ce"} <= set(terms) and all(math.isfinite(float(v)) for v in terms.values())
    assert float(drafter.fc.weight.grad.norm()) > 0


def test_the_oracle_reads_the_truth_and_is_not_trained(drafter_and_block):
    _, drafter, block = drafter_and_block
    oracle = Oracle()
    assert torch.equal(oracle.select(block), block.pool_ids[..., 2])  # the truth is in the pool here
    with pytest.raises(ValueError, match="not a trainable method"):
        create_method("oracle", drafter, None, POOL, seed=0)
    with pytest.raises(ValueError, match="needs the true tokens"):
        oracle.select(DraftBlock(block.anchor_ids, block.anchor_pos, block.hidden, None, block.pool_ids,
                                 block.pool_logprobs))
    assert not Native.repairs and Oracle.needs_truth and not Oracle.trainable


def test_load_speculator_takes_the_oracle_on_the_drafter_it_names(drafter_and_block, tmp_path):
    target, drafter, _ = drafter_and_block
    drafter.save(tmp_path / "dflash" / "drafter")
    spec = load_speculator(target, tmp_path, "oracle", oracle_drafter="dflash")
    assert isinstance(spec.method, Oracle) and spec.fingerprint
    native = load_speculator(target, tmp_path, "dflash")
    assert isinstance(native.method, Native) and native.fingerprint != spec.fingerprint  # folder vs drafter/


@pytest.mark.parametrize("name", [n for n in TRAINABLE if method_class(n).repairs])
def test_a_walk_stops_at_the_last_checked_draft_and_chooses_there_as_over_the_whole_block(drafter_and_block, name):
    """With decode.verify_size the target checks drafts 1..checked only: a method walks those (its choices
    there are the whole walk's, the walk being causal) and leaves the later drafts native."""
    target, drafter, block = drafter_and_block
    method = create_method(name, drafter, JointConfig().settings(name), POOL, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained-looking method: weights off their neutral start, so it replaces
        for p in method.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    full = method.select(block)
    native = block.pool_ids[..., 0]
    assert (full != native).any()  # a real comparison: the whole walk replaces somewhere
    for checked in range(1, full.shape[1] + 1):
        part = method.select(DraftBlock(**{**block.__dict__, "checked": checked}))
        assert torch.equal(part[:, :checked], full[:, :checked])
        assert torch.equal(part[:, checked:], native[:, checked:])
