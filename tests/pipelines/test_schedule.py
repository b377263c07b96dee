"""pipelines.schedule: how a served retrain deployment is driven in the tests (TRIGGER, serving_deployment,
dvc_project; tests/pipelines/test_dvc_pipeline.py serves it for real on a Prefect server and triggers runs on the
reproduced smoke pipeline, a plain DVC project and a folder that is none), and the params a run reads."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

from pipelines.common import REPO_ROOT
from tests.pipelines.conftest import stop_group

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


def dvc_project(path: Path, env: dict) -> Path:
    path.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=path, env=env,
                   check=True, timeout=60)
    (path / "dvc.yaml").write_text(
        "stages:\n  hello:\n    cmd: python -c \"open('out.txt', 'w').write('ok')\"\n"
        "    outs: [out.txt]\n")
    return path


def test_a_params_file_that_does_not_load_still_names_its_profile(tmp_path):
    """A pipeline run that failed on a bad key: its summary still goes to the profile's experiment."""
    from pipelines.schedule import _workspace_params

    (tmp_path / "params.yaml").write_text("run:\n  profile: smoke\njoint:\n  common:\n    no_such_key: 1\n"
                                          "registry:\n  alias: best\n")
    params = _workspace_params(tmp_path, None)
    assert (params.run.profile, params.registry.alias) == ("smoke", "best")
    assert _workspace_params(tmp_path / "missing", None).run.profile == "default"
