"""Distributed execution under torchrun, for real: 2 gloo processes on the CPU (tests/training/ddp_script.py)
against the same code in this one process. Distillation makes the same set of sequences; DDP training
steps end with the one process's parameters (same global batch: the batch means use the global
denominators); a run whose rank 1 is SIGKILLed resumes from its checkpoint to the uninterrupted run's end;
a stage started plainly with run.nproc_per_node = 2 launches itself under torchrun (pipelines/common.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drelay.config import ConfigError
from drelay.data.records import MANIFEST, load_distilled
from pipelines.common import torchrun_command
from tests.training.ddp_script import KILLED, STEP_RUNS, run_distill, run_train, training_setup

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               "-m", "tests.training.ddp_script", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One 2-process launch doing everything (distill, the DDP training runs, the killed run), then the
    killed run started again. Launches cost seconds of imports each, so there are only these two."""
    out = tmp_path_factory.mktemp("ddp")
    first = torchrun("all", str(out))
    folder, method, steps, _ = KILLED
    resumed = torchrun("train", str(out / folder), method, str(steps))
    return out, first, resumed


def _output(run: subprocess.CompletedProcess) -> str:
    return (run.stdout + run.stderr)[-4000:]


def test_distillation_over_two_processes_makes_the_one_process_sequences(two_processes, tmp_path):
    out, first, _ = two_processes
    assert (out / "distill" / MANIFEST).is_file(), _output(first)
    summary = json.loads((out / "distill" / "summary.json").read_text())
    one = run_distill(tmp_path / "one")
    assert summary["sequences"] == one["sequences"] == 13
    assert summary["generated_tokens_this_run"] == one["generated_tokens_this_run"] > 0  # every rank counted
    # each rank wrote its own shards: the same five files as one process
    assert sorted(p.name for p in (out / "distill").glob("shard_*")) == sorted(
        p.name for p in (tmp_path / "one").glob("shard_*"))
    two = {tuple(s.tokens.tolist()): s for s in load_distilled(out / "distill")}
    ones = {tuple(s.tokens.tolist()): s for s in load_distilled(tmp_path / "one")}
    assert len(two) == len(ones) == 13 and two.keys() == ones.keys()  # order-independent: the same sequences
    for key, seq in ones.items():
        assert two[key].prompt_len == seq.prompt_len
        torch.testing.assert_close(two[key].features, seq.features, rtol=1e-5, atol=1e-6)


def _assert_same_weights(got: dict, want: dict, start: dict | None = None, skip: set[str] = frozenset()) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if name not in skip:
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=5e-6, msg=name)
    if start is not None:  # the steps moved the weights: the comparison is not of two untouched copies
        assert max((want[n] - start[n]).abs().max().item() for n in start) > 1e-3


def _noise_gradients(grads: dict[str, torch.Tensor]) -> set[str]:
    """Parameters whose gradient is float rounding, not signal (0 < |g| < Adam's eps 1e-8): AdamW turns such a
    gradient into a step of up to ±lr whose sign is the rounding's, so their weights cannot be compared.
    drelay's score-MLP output bias is one: σ's softmax over the pool ignores a shift of every candidate."""
    return {name for name, g in grads.items() if 0 < g.abs().max() < 1e-8}


@pytest.mark.parametrize("folder", list(STEP_RUNS))
def test_ddp_steps_equal_the_one_process_steps_on_the_same_global_batch(two_processes, tmp_path, folder):
    out, first, _ = two_processes
    state_file = out / folder / "state.pt"
    assert state_file.is_file(), _output(first)
    two = torch.load(state_file, weights_only=False)
    method, steps = STEP_RUNS[folder]
    one = run_train(tmp_path, method, steps)
    assert (two["world"], one["world"], two["steps"]) == (2, 1, steps)
    assert [s for s, _ in two["logged"]] == [s for s, _ in one["logged"]]
    assert sum("grad_norm" in m for _, m in one["logged"]) == steps  # every step logged its loss terms
    for (step, got), (_, want) in zip(two["logged"], one["logged"]):  # the global batch's terms, then the evaluation
        for name in (k for k in want if k.startswith(("train_", "val_loss")) and k != "train_tokens_per_s" or k == "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), (step, name)
    # the last step's gradient, averaged over the 2 ranks' slices by DDP, is the 1-process gradient of the global batch
    assert two["grads"].keys() == one["grads"].keys() and len(one["grads"]) > 5
    scale = max(g.abs().max().item() for g in one["grads"].values())
    for name, want in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], want, rtol=1e-4, atol=1e-6 * scale, msg=name)
    noise = _noise_gradients(one["grads"])
    assert len(noise) <= 1, noise
    _assert_same_weights(two["drafter"], one["drafter"], training_setup()[0].state_dict(),
                         {n.split(".", 1)[1] for n in noise if n.startswith("drafter.")})
    _assert_same_weights(two["method"], one["method"], skip={n.split(".", 1)[1] for n in noise if n.startswith("method.")})
    assert (out / folder / "drafter" / "config.json").is_file()  # rank 0 wrote the trained drafter


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_end(two_processes, tmp_path):
    out, first, resumed = two_processes
    folder, method, steps, kill_at = KILLED
    assert first.returncode != 0 and "SIGKILL" in _output(first), _output(first)  # rank 1 died after step 3
    assert resumed.returncode == 0, _output(resumed)
    state = torch.load(out / folder / "state.pt", weights_only=False)
    assert (state["world"], state["resumed_from"], state["steps"]) == (2, kill_at - kill_at % 2, steps)
    straight = run_train(tmp_path, method, steps)
    _assert_same_weights(state["drafter"], straight["drafter"], training_setup()[0].state_dict())


def _probe(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    out = tmp_path / "probe"
    args = [f"--set={o}" for o in overrides]
    run = subprocess.run([sys.executable, "-m", "tests.training.ddp_stage_probe", "--params", "profiles/smoke.yaml",
                          *args, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return run, records


def test_a_stage_asked_for_two_processes_launches_itself_under_torchrun(tmp_path):
    run, records = _probe(tmp_path, "run.nproc_per_node=2")
    assert run.returncode == 0, _output(run)
    assert sorted(records) == [0, 1]
    assert [records[r]["role"] for r in (0, 1)] == ["flow", "worker"]  # rank 0 alone runs the flow
    for record in records.values():
        assert record["world"] == 2 and record["sum"] == 3.0 and record["backend"] == "gloo"
        assert record["torchrun"] and record["nproc_per_node"] == 2
    run, records = _probe(tmp_path / "single")  # the profile's 1 process: no torchrun, as before
    assert run.returncode == 0, _output(run)
    assert records == {0: {**records[0], "role": "flow", "world": 1, "sum": 1.0, "backend": None, "torchrun": False}}


def test_torchrun_command_standalone_on_one_node_and_rendezvous_from_the_environment(monkeypatch):
    for name in ("PET_MASTER_ADDR", "PET_RDZV_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    command = torchrun_command("pipelines.distill", ["--params", "p.yaml"], 8, 1)
    assert command[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=1", "--standalone",
                           "-m", "pipelines.distill", "--params", "p.yaml"]
    with pytest.raises(ConfigError, match="PET_MASTER_ADDR"):
        torchrun_command("pipelines.distill", [], 8, 2)
    monkeypatch.setenv("PET_MASTER_ADDR", "node0")
    command = torchrun_command("pipelines.train", ["--method", "drelay"], 8, 2)
    assert "--nnodes=2" in command and "--standalone" not in command
