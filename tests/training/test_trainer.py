import pytest
import torch

from drelay.config import TrainConfig
from drelay.data.records import split_sequences
from drelay.models.drafter import BlockDrafter
from drelay.training.distill import generate_batch
from drelay.training import trainer
from drelay.training.trainer import CHECKPOINT, LoopSettings, lr_at, train_dflash
from tests.conftest import make_tiny_target


def _data(target, n=24):
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 24, (4,), generator=gen).tolist() for _ in range(n)]
    return generate_batch(target, prompts, 24, set())


@pytest.fixture(scope="module")
def setup():
    # init 0.12: continuations with learnable structure (runs, repeats), not noise
    target = make_tiny_target(vocab_size=24, dtype=torch.float32, seed=2, init=0.12)
    target.set_layer_ids([1, 2, 3])
    train, val = split_sequences(_data(target, 48), 0.25, seed=0)
    return target, train, val


def _cfg(tmp_path, **kw):
    base = dict(max_steps=12, blocks_per_step=32, anchors_per_sequence=4, lr=3e-3, warmup_steps=2,
                eval_every=6, checkpoint_every=4, patience=0, out_dir=str(tmp_path / "drafter"),
                checkpoint_dir=str(tmp_path / "ckpt"))
    return TrainConfig(**{**base, **kw})


def _fresh(target):
    torch.manual_seed(0)
    return BlockDrafter.for_target(target, block_size=4).float()


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = LoopSettings.for_dflash(TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1))
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(50, cfg) < lr_at(20, cfg)


def test_training_lowers_held_out_loss_and_raises_replay_tau(setup, tmp_path):
    target, train, val = setup
    result = train_dflash(_fresh(target), train, val, _cfg(tmp_path, max_steps=60, eval_every=10), pool_size=4, seed=0)
    first, best = result.history[0], min(result.history, key=lambda h: h["val_loss"])
    assert best["val_loss"] < first["val_loss"] - 0.3
    assert max(h["replay_tau"] for h in result.history) > first["replay_tau"]
    assert all(h["oracle_tau"] >= h["replay_tau"] for h in result.history)
    loaded = BlockDrafter.load(tmp_path / "drafter", target)  # the best weights, usable by the engine
    assert loaded.config.block_size == 4


class Killed(Exception):
    pass


def test_a_killed_run_resumes_from_its_checkpoint_and_ends_where_an_uninterrupted_one_does(setup, tmp_path):
    target, train, val = setup
    straight = _fresh(target)
    train_dflash(straight, train, val, _cfg(tmp_path / "a"), pool_size=4, seed=0)

    def die_at_step_6(step, metrics):
        if step == 6:
            raise Killed  # after the step-4 checkpoint, before the step-8 one

    killed = _fresh(target)
    with pytest.raises(Killed):
        train_dflash(killed, train, val, _cfg(tmp_path / "b"), pool_size=4, seed=0, progress=die_at_step_6)
    assert (tmp_path / "b" / "ckpt" / CHECKPOINT).is_file()
    resumed = _fresh(target)
    result = train_dflash(resumed, train, val, _cfg(tmp_path / "b"), pool_size=4, seed=0)
    assert result.resumed_from == 4 and result.steps == 12
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_finished_run_is_reloaded_only_under_the_same_library_code(setup, tmp_path, monkeypatch):
    """Re-run with everything the same, a finished run reloads its last step; after a change to drelay's
    source (what makes DVC re-run a stage) it trains again."""
    target, train, val = setup
    train_dflash(_fresh(target), train, val, _cfg(tmp_path, max_steps=4), pool_size=4, seed=0)
    again = train_dflash(_fresh(target), train, val, _cfg(tmp_path, max_steps=4), pool_size=4, seed=0)
    assert (again.resumed_from, again.steps) == (4, 4)
    monkeypatch.setattr(trainer, "source_digest", lambda: "the digest of edited code")
    edited = train_dflash(_fresh(target), train, val, _cfg(tmp_path, max_steps=4), pool_size=4, seed=0)
    assert (edited.resumed_from, edited.steps) == (0, 4)


def test_the_source_digest_follows_every_python_file_of_the_package(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    (package / "notes.txt").write_text("not code")
    before = trainer.source_digest(package)
    (package / "notes.txt").write_text("still not code")
    assert trainer.source_digest.__wrapped__(package) == before
    (package / "sub" / "b.py").write_text("y = 3\n")
    assert trainer.source_digest.__wrapped__(package) != before
    assert trainer.source_digest() == trainer.source_digest.__wrapped__()  # drelay's own, cached per process


def test_changed_settings_do_not_resume_and_a_corrupt_checkpoint_is_a_clear_error(setup, tmp_path):
    target, train, val = setup
    train_dflash(_fresh(target), train, val, _cfg(tmp_path, max_steps=4), pool_size=4, seed=0)
    other = train_dflash(_fresh(target), train, val, _cfg(tmp_path, max_steps=4, lr=1e-3), pool_size=4, seed=0)
    assert other.resumed_from == 0
    (tmp_path / "ckpt" / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="corrupt checkpoint .*delete it"):
        train_dflash(_fresh(target), train, val, _cfg(tmp_path, max_steps=4), pool_size=4, seed=0)
