"""Scheduled retraining: a Prefect deployment `retrain/drelay-retrain` that re-runs the pipeline, then runs
the promotion gate (pipelines/registry.py: the new DRelay version takes the `champion` alias only if it is
better on the same evaluation) and logs a run summary (`retrain_summary.json` / `.md`) to MLflow, as run
`retrain` of the profile's experiment. A failed pipeline leaves the champion untouched (and says so).

    make schedule [PROFILE=NAME]

starts `prefect server start --host 127.0.0.1 --port <schedule.port>` in the background (log in
.prefect/server.log, pid in .prefect/server.pid), then runs `python -m pipelines.schedule` in the
foreground with PREFECT_API_URL pointing at it: it serves the deployment on `schedule.cron` in
`schedule.timezone`. Ctrl-C stops serving (the server keeps running, the UI stays browsable at
http://127.0.0.1:<port>); `make schedule-stop` stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from pipelines.common import REPO_ROOT, configure_environment, wait_for_health

configure_environment()  # before prefect is imported: it reads its settings at import time

from prefect import flow, get_run_logger  # noqa: E402
from prefect.schedules import Cron  # noqa: E402

from drelay.config import ConfigError, load_params  # noqa: E402

DEPLOYMENT = "drelay-retrain"


def _stream(cmd: list[str], cwd: Path, env: dict, logger, tail_lines: int = 20) -> tuple[int, list[str]]:
    """Run `cmd`, each output line into the flow run's log as it is printed; (exit code, last lines)."""
    tail: deque[str] = deque(maxlen=tail_lines)
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            logger.info(line)
    return proc.returncode, list(tail)


def _champion_version(params) -> int | None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipelines.registry import model_name
    from pipelines.tracking import tracking_uri

    try:
        version = MlflowClient(tracking_uri()).get_model_version_by_alias(
            model_name(params, params.registry.champion_method), params.registry.alias)
    except MlflowException:
        return None
    return int(version.version)


def _workspace_params(workspace: Path, profile: str | None):
    """The reproduced workspace's params (a profile's file before its workspace exists; defaults without any).
    A file that does not load (the reason a pipeline run failed, say) still names its profile and registry,
    so the run's summary lands in the right experiment."""
    import dataclasses

    import yaml

    from drelay.config import Params, RegistryConfig, RunConfig

    for path in (workspace / "params.yaml", REPO_ROOT / "profiles" / f"{profile}.yaml" if profile else None):
        if path is None or not path.is_file():
            continue
        try:
            return load_params(path)
        except ConfigError:
            raw = yaml.safe_load(path.read_text()) or {}
            sections = {}
            for name, cls in (("run", RunConfig), ("registry", RegistryConfig)):
                try:
                    sections[name] = cls(**(raw.get(name) or {}))
                except (ConfigError, TypeError, ValueError, AttributeError):
                    pass
            return dataclasses.replace(Params(), **sections)
    return Params()


def _registers(workspace: Path) -> bool:
    """Whether the workspace's pipeline has the register stage (which the gate reads)."""
    import yaml

    try:
        stages = yaml.safe_load((workspace / "dvc.yaml").read_text()).get("stages", {})
    except (OSError, AttributeError, yaml.YAMLError):
        return False
    return "register" in stages


def summary_markdown(summary: dict) -> str:
    lines = [f"# Retraining run {summary['flow_run']}", "",
             f"- pipeline: `{summary['command']}` in `{summary['workspace']}`: **{summary['pipeline']}**"]
    gate = summary.get("gate")
    if gate:
        verdict = "promoted" if gate["promoted"] else "kept the champion"
        lines += [f"- gate on `{gate['model']}`: **{verdict}** (challenger v{gate['challenger']}, champion before "
                  f"v{gate['champion_before']}, after v{gate['champion_after']})", f"- why: {gate['reason']}"]
    else:
        why = summary.get("gate_skipped", "the pipeline failed")
        lines.append(f"- gate not run ({why}); champion untouched: v{summary.get('champion')}")
    if summary.get("error"):
        lines += ["", "```", summary["error"], "```"]
    return "\n".join(lines) + "\n"


def log_summary(params, summary: dict) -> str:
    """The run summary as MLflow run `retrain` (artifacts retrain_summary.json / .md) of the profile's experiment."""
    import tempfile

    from mlflow.tracking import MlflowClient

    from pipelines.tracking import profile_experiment, tracking_uri

    uri = tracking_uri()
    client = MlflowClient(uri)
    run = client.create_run(profile_experiment(client, uri, params.run.profile), run_name="retrain",
                            tags={"stage": "retrain", "profile": params.run.profile, "pipeline": summary["pipeline"],
                                  "gate": (("promoted" if summary["gate"]["promoted"] else "kept")
                                           if summary.get("gate") else "not run")})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "retrain_summary.json").write_text(json.dumps(summary, indent=2))
        (Path(tmp) / "retrain_summary.md").write_text(summary_markdown(summary))
        client.log_artifacts(run.info.run_id, tmp)
    client.set_terminated(run.info.run_id, "FINISHED" if summary["pipeline"] == "succeeded" else "FAILED")
    return run.info.run_id


@flow(name="retrain")
def retrain(workdir: str = ".", profile: str | None = None) -> dict:
    """Re-run the pipeline in `workdir` (`dvc repro`, or the profile runner for `profile`), then the promotion
    gate; the summary goes to MLflow either way."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    cwd = Path(workdir).resolve()
    workspace = cwd / "runs" / profile if profile else cwd
    python = sys.executable
    cmd = [python, "-m", "pipelines.profile", profile] if profile else [python, "-m", "dvc", "repro"]
    # Stage commands say `python`: make it this environment's.
    env = {**os.environ, "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    shown = " ".join(cmd[2:])  # "dvc repro" or "pipelines.profile NAME"
    logger.info("running %s in %s", shown, cwd)
    code, tail = _stream(cmd, cwd, env, logger)
    params = _workspace_params(workspace, profile)
    summary = {"flow_run": flow_run.get_name() or "local", "command": shown, "workspace": str(workspace),
               "pipeline": "succeeded" if code == 0 else "failed"}
    if code != 0:
        summary["error"] = f"{shown} exited with code {code}:\n" + "\n".join(tail)
        summary["champion"] = _champion_version(params)
        log_summary(params, summary)
        raise RuntimeError(summary["error"])
    if not _registers(workspace):
        summary["champion"] = None
        summary["gate_skipped"] = "the pipeline has no register stage: no model version to gate"
        logger.info("gate not run: %s", summary["gate_skipped"])
        log_summary(params, summary)
        return summary
    code, tail = _stream([python, "-m", "pipelines.promote"], workspace, env, logger)
    if code != 0:
        summary["error"] = "the promotion gate failed:\n" + "\n".join(tail)
        summary["champion"] = _champion_version(params)
        log_summary(params, summary)
        raise RuntimeError(summary["error"])
    summary["gate"] = json.loads(tail[-1])
    logger.info("gate: %s", summary["gate"]["reason"])
    log_summary(params, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the scheduled retraining deployment.")
    parser.add_argument("--profile", help="retrain this profile (profiles/NAME.yaml) instead")
    parser.add_argument("--params", default=str(REPO_ROOT / "params.yaml"),
                        help="where the schedule section is read when no --profile is given")
    args = parser.parse_args(argv)
    params_path = REPO_ROOT / "profiles" / f"{args.profile}.yaml" if args.profile else args.params
    try:
        schedule = load_params(params_path).schedule
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:  # a temporary server would vanish with this process, and the schedule with it
        print("error: PREFECT_API_URL is not set; scheduling needs a running Prefect server "
              "(`make schedule` starts one)", file=sys.stderr)
        return 2
    try:
        wait_for_health(api_url, timeout=120)
    except TimeoutError as e:
        print(f"error: {e} (see .prefect/server.log)", file=sys.stderr)
        return 1
    print(f"serving {retrain.name}/{DEPLOYMENT}: cron {schedule.cron!r} ({schedule.timezone}) "
          f"on {api_url}; Ctrl-C stops serving", file=sys.stderr, flush=True)
    retrain.serve(name=DEPLOYMENT, schedules=[Cron(schedule.cron, timezone=schedule.timezone)],
                  parameters={"workdir": str(REPO_ROOT), "profile": args.profile})
    return 0


if __name__ == "__main__":
    sys.exit(main())
