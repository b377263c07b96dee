"""pipelines.schedule for real: a Prefect server on 127.0.0.1, the deployment served by
`python -m pipelines.schedule`, runs triggered with run_deployment against tiny DVC projects."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.common import REPO_ROOT
from tests.pipelines.conftest import seeded_mlflow_uri, stop_group

pytestmark = pytest.mark.slow

# Runs in its own process (prefect reads PREFECT_API_URL at import): waits for the deployment,
# triggers a run in each workdir given, prints what the test checks as JSON.
TRIGGER = """
import asyncio, json, sys, time
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.deployments import run_deployment

NAME = "retrain/drelay-retrain"

async def deployment():
    async with get_client() as client:
        for _ in range(120):
            try:
                return await client.read_deployment_by_name(NAME)
            except Exception:  # not registered yet
                await asyncio.sleep(0.5)
        raise TimeoutError("deployment never appeared")

async def logs(flow_run_id):
    async with get_client() as client:
        found = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return [record.message for record in found]

d = asyncio.run(deployment())
result = {"schedules": [[s.schedule.cron, s.schedule.timezone] for s in d.schedules], "runs": []}
for workdir in sys.argv[1:]:
    run = run_deployment(NAME, parameters={"workdir": workdir}, timeout=120, poll_interval=1)
    messages = []
    for _ in range(30):  # logs reach the API in batches, shortly after the state
        messages = asyncio.run(logs(run.id))
        if any(m.startswith("Finished in state") for m in messages):
            break
        time.sleep(0.5)
    result["runs"].append({"state": run.state.type.value, "logs": messages})
print(json.dumps(result))
"""


@contextlib.contextmanager
def serving_deployment(schedule_yaml: str, env: dict, tmp_path: Path):
    """`python -m pipelines.schedule` (what `make schedule` runs) serving the deployment, with a schedule section
    `schedule_yaml`; yields (its environment, its log). Stopped with Ctrl-C, as a user stops `make schedule`."""
    params = tmp_path / "schedule-params.yaml"
    params.write_text(schedule_yaml)
    env = {**env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}  # pick triggered runs up within a second
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.schedule", "--params", str(params)],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield env, log
    finally:
        stop_group(proc, first=signal.SIGINT)


@pytest.fixture
def served(tmp_path, prefect_server, subprocess_env):
    env = {**subprocess_env, "PREFECT_API_URL": prefect_server,
           "MLFLOW_TRACKING_URI": seeded_mlflow_uri(tmp_path / "mlflow.db")}  # the runs' summaries
    with serving_deployment('schedule:\n  cron: "0 3 * * 0"\n  timezone: Europe/Paris\n', env, tmp_path) as served:
        yield served


def dvc_project(path: Path, env: dict) -> Path:
    path.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=path, env=env,
                   check=True, timeout=60)
    (path / "dvc.yaml").write_text(
        "stages:\n  hello:\n    cmd: python -c \"open('out.txt', 'w').write('ok')\"\n"
        "    outs: [out.txt]\n")
    return path


def test_served_deployment_runs_dvc_repro(tmp_path, served, subprocess_env):
    env, serve_log = served
    project = dvc_project(tmp_path / "project", subprocess_env)
    not_dvc = tmp_path / "not_dvc"
    not_dvc.mkdir()

    out = subprocess.run([sys.executable, "-c", TRIGGER, str(project), str(not_dvc)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stderr[-3000:]}\nserve log:\n{serve_log.read_text()[-3000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])

    assert result["schedules"] == [["0 3 * * 0", "Europe/Paris"]]
    good, bad = result["runs"]
    assert good["state"] == "COMPLETED", serve_log.read_text()[-3000:]
    assert (project / "out.txt").read_text() == "ok"
    assert f"running dvc repro in {project}" in good["logs"]
    assert "Running stage 'hello':" in good["logs"]  # dvc's own output, streamed into the run log
    assert bad["state"] == "FAILED"  # dvc repro outside a DVC repo exits non-zero
    assert any("dvc repro exited with code" in m for m in bad["logs"])
    # each run's summary in MLflow (no params file: the default profile's experiment); this pipeline registers
    # no models, so the gate does not run (tests/pipelines/test_dvc_pipeline.py has a pipeline that does)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("drelay-default").experiment_id],
                              "tags.stage = 'retrain'", order_by=["attributes.start_time"])
    assert [(r.data.tags["pipeline"], r.data.tags["gate"], r.info.status) for r in runs] == [
        ("succeeded", "not run", "FINISHED"), ("failed", "not run", "FAILED")]
    summary = json.loads(Path(client.download_artifacts(runs[0].info.run_id, "retrain_summary.json")).read_text())
    assert summary["gate_skipped"].startswith("the pipeline has no register stage")


def test_a_params_file_that_does_not_load_still_names_its_profile(tmp_path):
    """A pipeline run that failed on a bad key: its summary still goes to the profile's experiment."""
    from pipelines.schedule import _workspace_params

    (tmp_path / "params.yaml").write_text("run:\n  profile: smoke\njoint:\n  common:\n    no_such_key: 1\n"
                                          "registry:\n  alias: best\n")
    params = _workspace_params(tmp_path, None)
    assert (params.run.profile, params.registry.alias) == ("smoke", "best")
    assert _workspace_params(tmp_path / "missing", None).run.profile == "default"
