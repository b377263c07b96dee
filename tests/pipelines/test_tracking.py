"""pipelines.tracking against a real sqlite MLflow store in tmp_path, read back with MlflowClient."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient

from drelay.config import load_params
from pipelines.common import REPO_ROOT, write_metrics
from pipelines.tracking import stage_run
from tests.pipelines.conftest import seeded_mlflow_uri

# MLflow 3.17 itself trips a SQLAlchemy deprecation when it opens a sqlite store.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    # One store for the module: creating a fresh MLflow sqlite db (its migrations) takes ~5 s here.
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture
def store(store_dir, monkeypatch) -> str:
    uri = seeded_mlflow_uri(store_dir / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def make_params(tmp_path, profile: str):
    """Each test its own profile, so its own experiment in the shared store."""
    path = tmp_path / "params.yaml"
    path.write_text(f"run:\n  profile: {profile}\ndistill:\n  batch_size: 3\n"
                    "data:\n  train_sources: [gsm8k, mbpp]\n  mix: {math: 0.5, code: 0.5, chat: 0.0}\n")
    return load_params(path)


def test_stage_run_logs_params_tags_metrics_artifacts(tmp_path, store_dir, store):
    params = make_params(tmp_path, "tiny")
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    fig = Figure()
    fig.add_subplot().plot([0, 1, 2], [3.0, 2.5, 2.0])
    with stage_run("distill", params, ["distill", "data"]) as tracker:
        tracker.log_metrics({"loss": 2.0, "tau": 1.5}, step=0)
        tracker.log_metrics({"loss": 1.0}, step=10)
        tracker.log_artifact(notes, artifact_path="extra")
        tracker.log_figure(fig, "plots/loss.png")
        tracker.log_dict({"a": 1}, "summary.json")

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "distill"
    assert client.get_experiment(run.info.experiment_id).name == "drelay-tiny"
    p = run.data.params
    assert p["distill.batch_size"] == "3" and p["distill.feature_dtype"] == "bfloat16"
    assert p["data.train_sources"] == '["gsm8k", "mbpp"]' and p["run.profile"] == "tiny"
    assert {k.split(".")[0] for k in p} == {"distill", "data", "run"}  # only the named sections
    assert "run.seed" not in p
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    tags = run.data.tags
    assert (tags["stage"], tags["profile"], tags["git_commit"]) == ("distill", "tiny", commit)
    assert tags["workspace"]
    experiment = client.get_experiment(run.info.experiment_id)  # opens on the runs table in the UI
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    # one reproduction = one pipeline_run tag on every stage run; other params, another tag
    with stage_run("train_dflash", params, ["train"]) as same:
        pass
    with stage_run("distill", load_params(tmp_path / "params.yaml", ["distill.batch_size=4"]), ["distill"]) as changed:
        pass
    mark = tags["pipeline_run"]
    assert mark.startswith(commit[:12] + "-") and len(mark) == len(commit[:12]) + 13
    assert client.get_run(same.run_id).data.tags["pipeline_run"] == mark
    assert client.get_run(changed.run_id).data.tags["pipeline_run"] != mark
    assert {r.info.run_id for r in client.search_runs([run.info.experiment_id], f"tags.pipeline_run = '{mark}'")} \
        == {tracker.run_id, same.run_id}
    history = client.get_metric_history(tracker.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 2.0), (10, 1.0)]
    assert run.data.metrics["tau"] == 1.5
    listed = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert listed == {"extra", "plots", "summary.json"}
    assert [a.path for a in client.list_artifacts(tracker.run_id, "plots")] == ["plots/loss.png"]
    # Artifacts sit next to the tmp store, not in the repo's mlartifacts/.
    local = store_dir / "mlartifacts" / "drelay-tiny" / tracker.run_id / "artifacts"
    assert (local / "extra" / "notes.txt").read_text() == "hello"
    assert (local / "plots" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_stage_run_is_the_stages_clock(tmp_path, store):
    (tmp_path / "params.yaml").write_text("run:\n  profile: clock\n")
    params = load_params(tmp_path / "params.yaml")
    with stage_run("distill", params, ["distill"]):
        time.sleep(0.1)
        path = write_metrics("distill", {"sequences": 3}, root=tmp_path)
    written = json.loads(path.read_text())
    assert written["sequences"] == 3 and 0.1 <= written["wall_s"] < 60


def test_exception_leaves_run_failed(tmp_path, store):
    params = make_params(tmp_path, "failing")
    with pytest.raises(RuntimeError, match="boom"):
        with stage_run("train_dflash", params, ["train"]) as tracker:
            tracker.log_metrics({"loss": 1.0}, step=1)
            raise RuntimeError("boom")
    run = MlflowClient(tracking_uri=store).get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert run.data.metrics["loss"] == 1.0


def test_unknown_section_fails_before_a_run_exists(tmp_path, store):
    params = make_params(tmp_path, "typo")
    with pytest.raises(ValueError, match="unknown params section 'distil'"):
        with stage_run("distill", params, ["distil"]):
            pass
    assert MlflowClient(tracking_uri=store).get_experiment_by_name("drelay-typo") is None


SEQUENTIAL_STAGE = """
import sys
from drelay.config import load_params
from pipelines.tracking import stage_run
with stage_run(sys.argv[1], load_params(sys.argv[2]), ["distill"]) as t:
    t.log_metrics({"done": 1.0})
"""


def test_sequential_stage_processes_share_one_store(tmp_path, store, subprocess_env):
    """Stages are separate processes: the first creates the experiment, the next reuses it."""
    (tmp_path / "params.yaml").write_text("run:\n  profile: sequential\n")
    env = {**subprocess_env, "MLFLOW_TRACKING_URI": store}
    for stage in ("distill", "train_dflash"):
        out = subprocess.run([sys.executable, "-c", SEQUENTIAL_STAGE, stage,
                              str(tmp_path / "params.yaml")], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("drelay-sequential")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["distill", "train_dflash"]
    assert all(r.info.status == "FINISHED" and r.data.metrics["done"] == 1.0 for r in runs)


def test_ui_links_open_each_experiment_on_its_runs_table(tmp_path, store):
    """MLflow's UI lands on its GenAI overview unless the URL asks for the model-training view."""
    from mlflow.tracking import MlflowClient

    from pipelines.ui import links

    params = make_params(tmp_path, "links")
    with stage_run("distill", params, ["distill"]):
        pass
    experiment = MlflowClient(store).get_experiment_by_name("drelay-links")
    assert f"http://127.0.0.1:5123/#/experiments/{experiment.experiment_id}?workflowType=machine_learning" in \
        "\n".join(links(5123))
