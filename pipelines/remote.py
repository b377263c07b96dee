"""A shared DVC remote for a team: push a reproduction's outputs (models, data, evaluation cells) and DVC's
run cache, pull them on another machine instead of re-running the pipeline.

    python -m pipelines.remote push [--workspace DIR] [--remote URL]     # make push [PROFILE=name] [REMOTE=URL]
    python -m pipelines.remote pull [--workspace DIR] [--remote URL]     # make pull [PROFILE=name] [REMOTE=URL]

The remote: `--remote URL` (any URL DVC takes: a local or mounted directory, s3://..., gs://... with DVC's
own extras, e.g. `pip install 'dvc[s3]'`), saved as the workspace's default in `.dvc/config.local` (not
committed, so each user or machine sets its own); otherwise the default already configured there; otherwise
$DRELAY_DVC_REMOTE, else the directory `drelay-dvc-remote` beside the repository. Metrics files are in git,
not in the remote (`cache: false`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pipelines.common import REPO_ROOT

REMOTE_NAME = "team"


def default_remote() -> str:
    return os.environ.get("DRELAY_DVC_REMOTE") or str(REPO_ROOT.parent / "drelay-dvc-remote")


def _dvc(workspace: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=workspace, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"dvc {' '.join(args)} failed in {workspace}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def configured_remote(workspace: Path) -> str | None:
    """The URL of the workspace's default remote, None if it has none."""
    name = _dvc(workspace, "remote", "default", check=False).stdout.strip()
    if not name or "No default remote" in name:
        return None
    url = _dvc(workspace, "config", f"remote.{name}.url", check=False).stdout.strip()
    return url or None


def ensure_remote(workspace: Path, url: str | None) -> str:
    """Set (`url` given, or nothing configured: the default directory) or keep the workspace's default remote."""
    current = configured_remote(workspace)
    if url is None and current is not None:
        return current
    url = url or default_remote()
    if "://" not in url:  # a directory: absolute, so the setting works from any workspace
        url = str(Path(url).expanduser().resolve())
        Path(url).mkdir(parents=True, exist_ok=True)
    _dvc(workspace, "remote", "add", "--local", "--default", "--force", REMOTE_NAME, url)
    return url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["push", "pull"])
    parser.add_argument("--workspace", type=Path, default=Path("."), help="the DVC project (default: here; "
                                                                         "a profile's is runs/<name>)")
    parser.add_argument("--remote", help="remote URL, saved as the workspace's default (.dvc/config.local)")
    args = parser.parse_args(argv)
    workspace = args.workspace.resolve()
    if not (workspace / "dvc.yaml").is_file():
        print(f"error: {workspace} has no dvc.yaml: not a pipeline workspace (make repro PROFILE=name makes "
              f"runs/<name>)", file=sys.stderr)
        return 2
    try:
        url = ensure_remote(workspace, args.remote)
        print(f"{args.action}: {workspace} <-> {url}", file=sys.stderr)
        if args.action == "push":
            done = _dvc(workspace, "push", "--run-cache")
        else:
            done = _dvc(workspace, "pull", "--run-cache")
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print((done.stdout + done.stderr).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
