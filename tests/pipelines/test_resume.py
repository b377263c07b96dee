"""Kill-then-resume of the two resumable stage kinds for real: `python -m pipelines.distill` and
`python -m pipelines.train_dflash` SIGKILLed at their first shard / checkpoint, then run again. On inputs of
their own (the smoke profile's tiny random target and a prepared prompt file written here), so this file
does not wait for tests/pipelines/test_dvc_pipeline.py's reproduction and runs on the other xdist worker."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from drelay.io import write_jsonl
from drelay.models.target import make_tiny_random_target
from tests.pipelines.conftest import seeded_mlflow_uri, stop_group
from tests.pipelines.test_dvc_pipeline import _copy_repo, _set_params

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def inputs_repo(tmp_path_factory, mirror):
    """A copy of the repo on the smoke profile with prepare_target's and prepare_data's outputs: the tiny random
    target (what the smoke prepare_target makes) and 24 + 4 prompt records in prepare_data's format."""
    repo = _copy_repo(tmp_path_factory.mktemp("resume") / "repo")
    shutil.copy2(repo / "profiles" / "smoke.yaml", repo / "params.yaml")
    _set_params(repo, {"data.mirror": str(mirror)})
    make_tiny_random_target(repo / "models/target")
    records = [{"id": f"probe/{i}", "source": "probe", "domain": "math",
                "messages": [{"role": "user", "content": f"What is {i} times {i + 3}, and why?"}]} for i in range(28)]
    write_jsonl(records[:24], repo / "data/prepared/train.jsonl")
    write_jsonl(records[24:], repo / "data/prepared/val.jsonl")
    return repo


@pytest.fixture
def env(subprocess_env, tmp_path_factory, prefect_server):
    return {**subprocess_env, "PREFECT_API_URL": prefect_server,
            "MLFLOW_TRACKING_URI": seeded_mlflow_uri(tmp_path_factory.getbasetemp() / "resume-mlflow.db")}


def _stage(repo: Path, env: dict, stage: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"pipelines.{stage}", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600, **kw)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    """SIGKILL the stage process alone (not its group: what it started must go down on its own)
    as soon as `ready()`."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the stage finished before it could be killed"
        assert time.monotonic() < deadline, "timed out waiting to kill the stage"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def _own_servers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The Prefect server(s) a stage process started (children of it running `prefect server ...`)."""
    try:
        return [p for p in psutil.Process(proc.pid).children() if "server" in p.cmdline()]
    except psutil.Error:  # exited meanwhile
        return []


def test_killed_distill_and_train_resume_without_redoing_finished_work(inputs_repo, env, tmp_path):
    """Killed as soon as the first shard / checkpoint exists, then rerun: finished work is reused. Both
    distill runs have no PREFECT_API_URL, so each runs on a Prefect server of its own, as a stage does
    by default: it must go down with the killed stage, and be stopped by the one that finishes."""
    repo = inputs_repo
    distill_args = ["--set", "distill.out_dir=data/distill_kill", "--set", "distill.shard_size=2",
                    "--set", "distill.batch_size=2", "--set", "distill.max_new_tokens=8"]
    shards = repo / "data/distill_kill"
    own_server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}

    def start_distill(stderr) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "pipelines.distill", *distill_args], cwd=repo,
                                env=own_server_env, stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)

    proc = start_distill(subprocess.DEVNULL)
    servers: list[psutil.Process] = []
    try:
        def first_shard() -> bool:
            servers[:] = servers or _own_servers(proc)
            return (shards / "shard_00000.safetensors").is_file()

        _kill_when(proc, first_shard)
        assert len(servers) == 1  # the stage's own Prefect server, running until the kill
        _, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"the killed stage's Prefect server is still running: {alive}"
    finally:
        stop_group(proc, first=signal.SIGKILL)
    done = sorted(p.name for p in shards.glob("shard_*.safetensors"))
    stamps = {name: (shards / name).stat().st_mtime_ns for name in done}
    assert done and not (shards / "manifest.json").exists()

    log = tmp_path / "distill.log"
    with open(log, "w") as stderr:
        proc = start_distill(stderr)
    servers = []
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            servers = servers or _own_servers(proc)
            time.sleep(0.1)
        assert proc.poll() == 0, log.read_text()[-2000:]
    finally:
        stop_group(proc, first=signal.SIGKILL)
    assert len(servers) == 1 and not servers[0].is_running()  # stopped when the flow returned
    metrics = json.loads((repo / "metrics/distill.json").read_text())
    assert metrics["shards_reused"] == len(done) and metrics["sequences"] == metrics["prompts"]
    assert metrics["prompts"] > 2 * len(done)  # the kill left work to do
    assert all((shards / name).stat().st_mtime_ns == stamp for name, stamp in stamps.items())

    # A short run (few blocks a step) on the sequences just distilled, checkpointed every 2 steps, killed at the
    # first checkpoint.
    train_args = ["--set", "distill.out_dir=data/distill_kill", "--set", "train.max_steps=24",
                  "--set", "train.checkpoint_every=2", "--set", "train.eval_every=100",
                  "--set", "train.blocks_per_step=4", "--set", "train.checkpoint_dir=checkpoints/kill",
                  "--set", "train.out_dir=models/drafter_kill"]
    ckpt = repo / "checkpoints/kill/last.pt"
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.train_dflash", *train_args], cwd=repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _kill_when(proc, lambda: ckpt.is_file())
    finally:
        stop_group(proc, first=signal.SIGKILL)
    out = _stage(repo, env, "train_dflash", *train_args)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads((repo / "metrics/train_dflash.json").read_text())
    assert 2 <= metrics["resumed_from_step"] < 24 and metrics["steps"] == 24
    assert (repo / "models/drafter_kill/model.safetensors").is_file()


def test_distill_and_train_dflash_under_torchrun_make_the_one_process_outputs(inputs_repo, env):
    """The real stages asked for two processes (`--set run.nproc_per_node=2`): each launches itself under
    torchrun (2 gloo ranks on the CPU) and ends with what the one-process stage makes: the same set of
    distilled sequences, and after the same steps on the same global batch the same drafter weights."""
    from safetensors.torch import load_file

    from drelay.data.records import load_distilled

    repo = inputs_repo
    distill_args = ["--set", "distill.shard_size=2", "--set", "distill.batch_size=2", "--set",
                    "distill.max_new_tokens=8"]
    train_args = ["--set", "distill.out_dir=data/distill_p1", "--set", "train.max_steps=4", "--set",
                  "train.eval_every=2", "--set", "train.checkpoint_every=100", "--set", "train.blocks_per_step=4"]
    distilled, trained = {}, {}
    for n in (1, 2):
        run = _stage(repo, env, "distill", *distill_args, "--set", f"distill.out_dir=data/distill_p{n}",
                     "--set", f"run.nproc_per_node={n}")
        assert run.returncode == 0, run.stderr[-3000:]
        distilled[n] = json.loads((repo / "metrics/distill.json").read_text())
    for n in (1, 2):
        run = _stage(repo, env, "train_dflash", *train_args, "--set", f"train.checkpoint_dir=checkpoints/p{n}",
                     "--set", f"train.out_dir=models/drafter_p{n}", "--set", f"run.nproc_per_node={n}")
        assert run.returncode == 0, run.stderr[-3000:]
        trained[n] = json.loads((repo / "metrics/train_dflash.json").read_text())

    assert (distilled[1]["processes"], distilled[2]["processes"]) == (1, 2)
    assert distilled[2]["sequences"] == distilled[1]["sequences"] == distilled[1]["prompts"] > 4
    one = {tuple(s.tokens.tolist()): s for s in load_distilled(repo / "data/distill_p1")}
    two = {tuple(s.tokens.tolist()): s for s in load_distilled(repo / "data/distill_p2")}
    assert len(one) == distilled[1]["sequences"] and one.keys() == two.keys()  # the same sequences, any order
    for key, seq in one.items():
        assert two[key].prompt_len == seq.prompt_len
        torch.testing.assert_close(two[key].features, seq.features, rtol=1e-5, atol=1e-6)

    assert (trained[1]["processes"], trained[2]["processes"]) == (1, 2)
    assert trained[1]["steps"] == trained[2]["steps"] == 4
    assert trained[1]["best_step"] == trained[2]["best_step"] >= 2  # the drafter written was trained, not the start
    assert trained[2]["best_val_loss"] == pytest.approx(trained[1]["best_val_loss"], rel=1e-5)
    weights = {n: load_file(repo / f"models/drafter_p{n}/model.safetensors") for n in (1, 2)}
    assert weights[1].keys() == weights[2].keys() and len(weights[1]) > 5
    # Two ranks average two half-batch means where one process takes one mean: the same gradient up to float
    # rounding. Adam divides each element's gradient by its own running RMS, so where an element's gradient is
    # itself at rounding level (its blocks cancel) that rounding can move its update by up to the step size
    # (seen: 1 element of 53,600 off by 8.8e-6 on an AMD EPYC). So: all but a few elements in 10^4 agree to
    # float32 noise, and none is further apart than Adam's steps could carry it (each at most ~lr per element).
    # A rank that skipped the all-reduce (its own half-batch gradient) fails the count: in a 4-step AdamW proxy it
    # put 24% of the elements beyond float32 noise.
    import yaml
    lr = float(yaml.safe_load((repo / "params.yaml").read_text())["train"]["lr"])
    total = off = 0
    for name, want in weights[1].items():
        got = weights[2][name]
        assert got.shape == want.shape, name
        far = ~torch.isclose(got, want, rtol=1e-5, atol=5e-6)
        total, off = total + want.numel(), off + int(far.sum())
        assert float((got - want).abs().max()) <= 2 * lr * trained[1]["steps"], name
    assert off <= max(1, total // 10_000), f"{off} of {total} weights differ beyond float32 noise"
