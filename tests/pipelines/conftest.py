"""Subprocess environment for the pipeline tests: the repo importable, telemetry off, no server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pipelines.common import REPO_ROOT


@pytest.fixture
def subprocess_env(tmp_path) -> dict[str, str]:
    """os.environ plus: `pipelines` importable from any cwd (even before the editable install
    knows the package), this venv's `python` first on PATH, Prefect state under tmp_path."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PREFECT_", "MLFLOW_TRACKING_URI"))}
    path = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update({
        "PYTHONPATH": path,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
        "DO_NOT_TRACK": "1",
    })
    return env
