"""Plumbing shared by the stage flows: environment defaults, repo paths, the CLI entry, metrics files.

Importing this module imports neither prefect nor mlflow; call `configure_environment()` before
either is imported (both read their settings at import time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from drelay.config import ConfigError, load_params

# resolve(): a profile workspace (runs/<name>/) reaches this package through a symlink, and
# everything repo-level (mlflow.db, .prefect/, the data mirror) must still land in the real repo.
REPO_ROOT = Path(__file__).resolve().parents[1]


def configure_environment() -> None:
    """Defaults for telemetry, offline hubs and Prefect's temporary server; explicit env wins."""
    defaults = {
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PREFECT_HOME": str(REPO_ROOT / ".prefect"),
        # With no PREFECT_API_URL a flow run starts Prefect's temporary local server. Enabled here
        # explicitly: the built-in "ephemeral" profile enables it, but a profiles.toml under
        # PREFECT_HOME may not.
        "PREFECT_SERVER_EPHEMERAL_ENABLED": "true",
        # Its start takes 5-15 s here (first start migrates the db); 2-core machines need more.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        # Quiet: hide Prefect's own INFO chatter ("Starting temporary server on ..."), keep the
        # flow and task run loggers (what stages log) at INFO.
        "PREFECT_LOGGING_LOGGERS_PREFECT_LEVEL": "WARNING",
        "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL": "INFO",
        "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "INFO",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def resolve_from_repo(path: str | Path) -> Path:
    """An absolute path as is; a relative one against the repo root (not the cwd, which may be a
    profile workspace), e.g. `data.mirror: ../shared`."""
    path = Path(path)
    return path if path.is_absolute() else REPO_ROOT / path


def _rounded(value: Any) -> Any:
    """Floats to 6 significant digits (NaN/inf -> null: JSON has neither); numpy/torch scalars to
    Python numbers; dicts and lists recursively."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, dict):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    return value


def apply_run_settings(params) -> None:
    """`run.seed` into torch's RNG and `run.threads` (0: torch's default) into its CPU thread pool."""
    import torch

    torch.manual_seed(params.run.seed)
    if params.run.threads:
        torch.set_num_threads(params.run.threads)


def write_metrics(stage: str, metrics: dict, root: str | Path = Path(".")) -> Path:
    """Write `<root>/metrics/<stage>.json` (a DVC metrics file) atomically: a reader or an
    interrupted run never sees half a file."""
    out = Path(root) / "metrics" / f"{stage}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_rounded(metrics), sort_keys=True, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{stage}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def stage_main(flow_fn: Callable[..., Any], argv: list[str] | None = None,
               options: dict[str, dict] | None = None, precheck: Callable[..., None] | None = None) -> Any:
    """The `__main__` of a stage: `python -m pipelines.<stage> [--params P] [--set s.k=v ...]`.

    `options`: the stage's own flags, {name: argparse keyword arguments}, passed to the flow as
    keyword arguments (e.g. {"method": dict(required=True, choices=...)} -> `--method drelay`).
    The params file and overrides are validated before the flow starts, so a typo is one
    `error: ...` line and exit code 2 (no traceback, no Prefect server start-up); so are the stage's
    inputs when it gives `precheck(params, **options)`, which raises FileNotFoundError naming what is missing.
    """
    parser = argparse.ArgumentParser(description=(flow_fn.__doc__ or "").strip().split("\n")[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one param (repeatable)")
    for name, kwargs in (options or {}).items():
        parser.add_argument(f"--{name}", **kwargs)
    args = parser.parse_args(argv)
    extra = {name: getattr(args, name) for name in options or {}}
    try:
        params = load_params(args.params, args.overrides)
        if precheck is not None:
            precheck(params, **extra)
        return flow_fn(params_path=args.params, overrides=args.overrides, **extra)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def wait_for_health(api_url: str, timeout: float = 120.0) -> None:
    """Block until `<api_url>/health` answers 200 (a Prefect server), or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from {api_url}/health after {timeout:.0f} s")
        time.sleep(0.5)
