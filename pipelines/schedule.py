"""Scheduled retraining: a Prefect deployment `retrain/drelay-retrain` that re-runs the pipeline.

    make schedule [PROFILE=NAME]

starts `prefect server start --host 127.0.0.1 --port <schedule.port>` in the background (log in
.prefect/server.log, pid in .prefect/server.pid), then runs `python -m pipelines.schedule` in the
foreground with PREFECT_API_URL pointing at it: it serves the deployment on `schedule.cron` in
`schedule.timezone`. Ctrl-C stops serving (the server keeps running, the UI stays browsable at
http://127.0.0.1:<port>); `make schedule-stop` stops the server.
"""

from __future__ import annotations

import argparse
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


@flow(name="retrain")
def retrain(workdir: str = ".", profile: str | None = None) -> None:
    """Re-run the pipeline in `workdir`: `dvc repro`, or the profile runner for `profile`."""
    logger = get_run_logger()
    cwd = Path(workdir).resolve()
    python = sys.executable
    cmd = [python, "-m", "pipelines.profile", profile] if profile else [python, "-m", "dvc", "repro"]
    # Stage commands say `python`: make it this environment's.
    env = {**os.environ, "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    shown = " ".join(cmd[2:])  # "dvc repro" or "pipelines.profile NAME"
    logger.info("running %s in %s", shown, cwd)
    tail: deque[str] = deque(maxlen=20)
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:
        for line in proc.stdout:  # streamed: each line reaches the run's log as it is printed
            line = line.rstrip()
            tail.append(line)
            logger.info(line)
    if proc.returncode != 0:
        last = "\n".join(tail)
        raise RuntimeError(f"{shown} exited with code {proc.returncode}:\n{last}")


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
