"""Joint training (DESIGN §1.6-§1.7): the fairness rule (same start, same batches, same budget), the
joint loss reaching backbone, reader and selector, the choice of δ, resume, and, on data built so that
a block drafter's per-position top-1 contradicts itself, a drelay run that repairs it."""

import math
import random
from pathlib import Path

import pytest
import torch

from drelay.config import (JOINT_METHODS, ConfigError, DFlash2Settings, DominoSettings, DRelaySettings, DSparkSettings,
                           JointCommon, JointConfig, TrainConfig, load_section)
from drelay.data.records import Sequence, split_sequences
from drelay.decoding.replay import replay
from drelay.models.drafter import BlockDrafter
from drelay.models.methods import create_method, load_method
from drelay.models.relay import DRelay
from drelay.training import trainer
from drelay.training.trainer import CHECKPOINT, replay_as_trained, train_dflash, train_method
from tests.conftest import make_tiny_target

ROOT = Path(__file__).resolve().parents[2]
POOL = 4
TERMS = ("loss", "ce", "support", "hinge", "reader_bce", "repair", "selector_acc", "native_acc")
# Responses are random two-token phrases. A phrase's second token is 5 or 7 half the time each (7 also
# follows 9), but after 4 it is 5 five times out of six: a drafter's independent per-position top-1 is a
# coin toss that may say "4 7" (and flip as it trains); a selector that reads its own prefix says "4 5".
PHRASES, WEIGHTS = [(4, 5), (4, 7), (9, 7)], [0.5, 0.1, 0.4]


def _phrase_data(n: int, hidden_size: int, num_layers: int, seed: int = 0) -> list[Sequence]:
    """Prompt [1, 3] and 10-14 random phrases; the context feature of a position is its token, one-hot."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        tokens = [1, 3] + [t for _ in range(rng.randint(10, 14)) for t in rng.choices(PHRASES, WEIGHTS)[0]]
        features = torch.zeros(len(tokens), num_layers * hidden_size)
        features[torch.arange(len(tokens) - 1), torch.tensor(tokens[:-1])] = 1.0  # the last row stays 0, as distilled
        seqs.append(Sequence(torch.tensor(tokens), 2, features))
    return seqs


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_the_module():
    """conftest's `one_thread` for the whole module: its module fixtures do the training, and a
    function fixture would only start after them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_cfg(tmp: Path) -> TrainConfig:
    return TrainConfig(max_steps=60, blocks_per_step=32, anchors_per_sequence=4, lr=3e-3, warmup_steps=2,
                       eval_every=60, checkpoint_every=60, patience=0, out_dir=str(tmp / "drafter"),
                       checkpoint_dir=str(tmp / "ckpt_dflash"))


def _cfg(tmp: Path, common: dict | None = None, **sections) -> JointConfig:
    base = dict(extra_steps=150, lr=5e-3, warmup_steps=2, replay_sequences=32, eval_every=50, checkpoint_every=50,
                out_dir=str(tmp / "joint"), checkpoint_dir=str(tmp / "ckpt"))
    drelay = DRelaySettings(reader_dim=32, reader_layers=2, reader_heads=4, repair_margins=(0.0, 0.5, 1.0, 2.0))
    return JointConfig(methods=JOINT_METHODS, common=JointCommon(**{**base, **(common or {})}),
                       **{"drelay": drelay, **sections})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target (its frozen embedding and head), phrase data, and a DFlash drafter trained on it:
    the shared start."""
    tmp = tmp_path_factory.mktemp("start")
    with torch.random.fork_rng(devices=[]):
        target = make_tiny_target(vocab_size=24, dtype=torch.float32, seed=2, init=0.12)
        torch.manual_seed(0)
        drafter = BlockDrafter.for_target(target, block_size=4).float()
        data = _phrase_data(96, target.hidden_size, len(drafter.config.target_layer_ids))
        train, val = split_sequences(data, 0.3, seed=0)
        train_cfg = _train_cfg(tmp)
        train_dflash(drafter, train, val, train_cfg, pool_size=POOL, seed=0)
    start = lambda: BlockDrafter.load(tmp / "drafter", target).float()  # noqa: E731  a fresh copy each call
    return target, train, val, train_cfg, start


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """One run per method from the same start, recording the batches drawn and everything logged."""
    tmp = tmp_path_factory.mktemp("runs")
    return {method: {**_recorded_run(setup, method, _cfg(tmp)), "tmp": tmp} for method in ("dflash", "drelay")}


def _recorded_run(setup, method: str, cfg: JointConfig) -> dict:
    """One joint run from the shared start, with the anchors of every batch drawn and everything logged."""
    _, train, val, train_cfg, start = setup
    anchors, logs = [], []
    real = trainer.sample_batch

    def recording(*args, **kwargs):
        batch = real(*args, **kwargs)
        anchors.append(batch.anchors.clone())
        return batch

    trainer.sample_batch = recording
    try:
        drafter = start()
        result = train_method(method, drafter, train, val, cfg, train_cfg, pool_size=POOL, seed=0,
                              log=lambda metrics, step: logs.append((step, dict(metrics))))
    finally:
        trainer.sample_batch = real
    return dict(result=result, drafter=drafter, anchors=anchors, logs=logs, out_dir=Path(cfg.common.out_dir) / method)


def test_both_methods_start_alike_draw_the_same_batches_and_get_the_same_budget(runs):
    dflash, drelay = runs["dflash"], runs["drelay"]
    assert dflash["result"].steps == drelay["result"].steps == 150
    assert len(dflash["anchors"]) == len(drelay["anchors"]) == 150
    assert all(torch.equal(a, b) for a, b in zip(dflash["anchors"], drelay["anchors"]))
    d0, r0 = dflash["result"].history[0], drelay["result"].history[0]
    assert d0["step"] == r0["step"] == 0
    assert d0["val_ce"] == r0["val_ce"] and d0["native_tau"] == r0["native_tau"] == d0["replay_tau"]
    steps = [[h["step"] for h in runs[m]["result"].history] for m in ("dflash", "drelay")]
    assert steps[0] == steps[1] == [0, 50, 100, 150]
    assert not dflash["result"].tuned and drelay["result"].tuned  # only drelay has a setting to tune (δ)
    assert "repair_margin" not in dflash["result"].final and "repair_margin" in drelay["result"].final
    for method in ("dflash", "drelay"):
        final = runs[method]["result"].final
        for key in ("replay_tau", "replay_pool_hit", "replay_replace_rate", "replay_repair_precision",
                    "replay_harm_rate", "replay_accept_pos1", "replay_accept_pos3", "oracle_tau", "native_tau"):
            assert math.isfinite(final[key]), (method, key)
        assert final["oracle_tau"] >= final["native_tau"]
    assert dflash["result"].final["replay_replace_rate"] == 0.0  # no repair: the native top-1 everywhere


def test_drelay_logs_every_loss_term_and_all_are_finite(runs):
    train_logs = [(step, m) for step, m in runs["drelay"]["logs"] if "train_loss" in m]
    assert [step for step, _ in train_logs] == [1, *range(10, 151, 10)]
    for _, metrics in train_logs:
        for term in TERMS:
            assert math.isfinite(metrics[f"train_{term}"]), term
        assert metrics["train_repair"] > 0 and metrics["train_support"] > 0
    evals = [m for _, m in runs["drelay"]["logs"] if "replay_tau" in m]
    assert len(evals) == 4 and all(math.isfinite(m[f"val_{term}"]) for m in evals for term in TERMS)
    assert any(k.startswith("tune_tau_") for _, m in runs["drelay"]["logs"] for k in m)


def test_joint_loss_moves_backbone_reader_and_selector(setup, runs):
    target, *_, start = setup
    run = runs["drelay"]
    before = start().state_dict()
    moved = {name: not torch.equal(before[name], p) for name, p in run["drafter"].state_dict().items()}
    assert all(moved.values()), [n for n, ok in moved.items() if not ok]
    init = create_method("drelay", start(), _cfg(run["tmp"]).drelay, POOL, seed=0).state_dict()
    trained = DRelay.load(run["out_dir"] / "relay", target.embed_tokens)
    moved = {name: not torch.equal(init[name], p.float()) for name, p in trained.state_dict().items()}
    assert any(n.startswith("reader.layers") for n in moved) and any(n.startswith("selector.prefix") for n in moved)
    # with the anchor a reader token (v2), no_feature stands only for a true token outside its pool, which
    # this phrase data may never put in a prefix; everything else, the lattice and token tables included, moves
    moved.pop("selector.no_feature")
    assert any(n.startswith("lattice.") for n in moved) and any(".tokens." in n for n in moved)
    assert all(moved.values()), [n for n, ok in moved.items() if not ok]


def test_tune_picks_the_repair_margin_with_the_best_held_out_replay_tau_and_the_relay_is_saved_with_it(setup, runs):
    target, _, val, *_ = setup
    result, out_dir = runs["drelay"]["result"], runs["drelay"]["out_dir"]
    drafter = BlockDrafter.load(out_dir / "drafter", target).float()
    relay = DRelay.load(out_dir / "relay", target.embed_tokens)
    assert relay.config.repair_margin == result.final["repair_margin"]
    assert result.final["repair_margin"] == max(result.tuned, key=lambda m: (result.tuned[m], -m))

    margins = (0.0, 0.25, 1.0, 3.0, 1e9)  # 1e9: never replace, the native τ
    relay.settings = DRelaySettings(repair_margins=margins)
    taus = relay.tune(lambda hook: replay_as_trained(drafter, val, POOL, "bfloat16", hook).tau)
    best = relay.config.repair_margin
    expected = {}
    for m in margins:  # recomputed independently: one replay per δ
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected[m] = replay(drafter, val, pool_size=POOL,
                                 repair=lambda block: relay.select(block, repair_margin=m)).tau
    assert taus == expected
    assert len(set(taus.values())) > 1  # the choice is not trivial
    top = max(expected.values())
    assert best == min(m for m in margins if expected[m] == top)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert taus[1e9] == replay(drafter, val, pool_size=POOL).tau


def test_trained_drelay_repairs_the_drafter_and_beats_the_equal_budget_baseline(runs):
    history = runs["drelay"]["result"].history
    start, final = history[0], history[-1]
    assert start["replay_tau"] == start["native_tau"] and start["replay_replace_rate"] == 0  # starts as the native
    assert final["replay_tau"] > start["native_tau"], (start, final)
    assert final["replay_tau"] >= final["native_tau"]  # with its δ it never loses to its own backbone
    assert final["replay_tau"] >= runs["dflash"]["result"].final["replay_tau"]  # the same extra steps as CE only
    assert final["replay_replace_rate"] > 0 and final["replay_repair_precision"] > 0.5
    assert final["val_repair"] < 0.8 * start["val_repair"] and final["val_reader_bce"] < start["val_reader_bce"]
    assert final["val_selector_acc"] > start["val_selector_acc"]
    assert final["val_selector_acc"] > final["val_native_acc"]  # teacher-forced, it beats the drafter's top-1


class Killed(Exception):
    pass


def test_a_killed_joint_run_resumes_and_ends_where_an_uninterrupted_one_does(setup, tmp_path):
    target, train, val, train_cfg, start = setup
    short = dict(extra_steps=12, eval_every=6, checkpoint_every=4)
    straight = start()
    train_method("drelay", straight, train, val, _cfg(tmp_path / "a", short), train_cfg, pool_size=POOL, seed=0)
    cfg = _cfg(tmp_path / "b", short)

    def die_at_step_6(step, metrics):
        if step == 6:
            raise Killed  # after the step-4 checkpoint, before the step-8 one

    with pytest.raises(Killed):
        train_method("drelay", start(), train, val, cfg, train_cfg, pool_size=POOL, seed=0, progress=die_at_step_6)
    assert (tmp_path / "b" / "ckpt" / "drelay" / CHECKPOINT).is_file()

    seen = []  # another starting drafter must not continue from that checkpoint

    def stop_at_once(step, metrics):
        seen.append(step)
        raise Killed

    other = start()
    with torch.no_grad():
        other.fc.weight.mul_(1.01)
    with pytest.raises(Killed):
        train_method("drelay", other, train, val, cfg, train_cfg, pool_size=POOL, seed=0, progress=stop_at_once)
    assert seen == [1]

    resumed = start()
    result = train_method("drelay", resumed, train, val, cfg, train_cfg, pool_size=POOL, seed=0)
    assert result.resumed_from == 4 and result.steps == 12
    assert [h["step"] for h in result.history] == [0, 6, 12]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    relay_a = DRelay.load(tmp_path / "a" / "joint" / "drelay" / "relay")
    relay_b = DRelay.load(tmp_path / "b" / "joint" / "drelay" / "relay")
    assert relay_a.config == relay_b.config
    for (name, a), b in zip(relay_a.state_dict().items(), relay_b.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("params", ["params.yaml", "profiles/smoke.yaml", "profiles/qwen3-8b.yaml",
                                    "profiles/cpu-bf16.yaml", "profiles/cpu-small.yaml"])
def test_every_profile_has_a_valid_joint_section(params):
    cfg = load_section(ROOT / params, "joint")
    assert set(cfg.methods) == set(JOINT_METHODS) and cfg.common.extra_steps >= 1 and 0.0 in cfg.drelay.repair_margins


@pytest.mark.parametrize(("text", "message"), [
    ("joint:\n  drelay:\n    repair_margins: [0.5, 0.5]\n",
     "joint.drelay.repair_margins must be a non-empty list of distinct values"),
    ("joint:\n  drelay-lite:\n    omega: raw\n", "joint.drelay-lite.omega must be reach or block or expected"),
    ("joint:\n  drelay:\n    repair_margins: []\n", "joint.drelay.repair_margins must be a non-empty list"),
    ("joint:\n  methods: [dflash, medusa]\n", "joint.methods must be a non-empty list of distinct names from dflash"),
    ("joint:\n  drelay:\n    reader_heads: 3\n", "joint.drelay.reader_heads must be a divisor of reader_dim (256), got 3"),
    ("joint:\n  drelay:\n    eps: 0\n", "joint.drelay.eps must be in (0, 1], got 0.0"),
    ("joint:\n  drelay:\n    prefix_model: lstm\n", "joint.drelay.prefix_model must be gru or attn"),
    ("joint:\n  common:\n    extra_step: 10\n", "unknown key 'extra_step' in section 'joint.common'"),
    ("joint:\n  extra_steps: 10\n", "unknown key 'extra_steps' in section 'joint'"),
    ("joint:\n  domino:\n    rank: 0\n", "joint.domino.rank must be >= 1, got 0"),
    ("joint:\n  dspark: 3\n", "joint.dspark must be a mapping of settings"),
])
def test_joint_section_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_section(path, "joint")
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_unknown_method_is_an_error(setup, tmp_path):
    _, train, val, train_cfg, start = setup
    with pytest.raises(ValueError, match="unknown joint method 'medusa'"):
        train_method("medusa", start(), train, val, _cfg(tmp_path), train_cfg, pool_size=POOL, seed=0)


@pytest.mark.parametrize("method", ["dflash2", "domino", "dspark"])
def test_baseline_heads_train_under_the_same_rule_and_are_saved(setup, runs, method, tmp_path):
    target, train, val, train_cfg, start = setup
    cfg = _cfg(tmp_path, dict(extra_steps=60, eval_every=60, checkpoint_every=60, head_lr_scale=10.0),
               dflash2=DFlash2Settings(rank=8), domino=DominoSettings(gru_size=16, rank=16), dspark=DSparkSettings(rank=16))
    run = _recorded_run(setup, method, cfg)
    result, drafter, anchors, logs = run["result"], run["drafter"], run["anchors"], run["logs"]
    dflash = runs["dflash"]
    assert result.steps == 60 and all(torch.equal(a, b) for a, b in zip(anchors, dflash["anchors"]))  # same batches
    start_eval, final = result.history[0], result.final
    assert start_eval["replay_tau"] == start_eval["native_tau"] == dflash["result"].history[0]["native_tau"]
    assert start_eval["replay_replace_rate"] == 0  # every head starts as the native top-1
    trained = [m for _, m in logs if "train_loss" in m]
    assert all(math.isfinite(m["train_loss"]) and math.isfinite(m["train_ce"]) for m in trained)
    assert {"train_acc", "train_native_acc"} <= set(trained[-1])
    # it learned (teacher-forced, its choice beats the drafter's top-1; on this data a dflash2 fix can sit
    # only after a wrong predecessor, so live replacements are not guaranteed) and is saved as evaluated
    assert trained[-1]["train_acc"] > trained[-1]["train_native_acc"] and final["oracle_tau"] >= final["native_tau"]
    head = load_method(method, run["out_dir"], target.embed_tokens)
    assert type(head) is type(create_method(method, drafter, cfg.settings(method), POOL, 0))
    saved = BlockDrafter.load(run["out_dir"] / "drafter", target).float()
    again = replay_as_trained(saved, val[: cfg.common.replay_sequences], POOL, "bfloat16", head.select)
    assert again.tau == pytest.approx(final["replay_tau"], abs=1e-9)
