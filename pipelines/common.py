"""Plumbing shared by the stage flows: environment defaults, repo paths, the CLI entry, metrics files.

Importing this module imports neither prefect nor mlflow; call `configure_environment()` before
either is imported (both read their settings at import time).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

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
        # With no PREFECT_API_URL, stage_main starts a server of its own for the stage (see
        # `prefect_api`); a flow called outside stage_main starts Prefect's temporary local server.
        # Enabled here explicitly: the built-in "ephemeral" profile enables it, but a profiles.toml
        # under PREFECT_HOME may not.
        "PREFECT_SERVER_EPHEMERAL_ENABLED": "true",
        # Either start takes 5-15 s here (first start migrates the db); 2-core machines need more.
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


# When the running stage started (time.perf_counter()), while `stage_clock` is open; None outside a stage.
_STAGE_START: contextvars.ContextVar[float | None] = contextvars.ContextVar("stage_start", default=None)


@contextlib.contextmanager
def stage_clock() -> Iterator[None]:
    """Times a stage (`stage_main` and `pipelines.tracking.stage_run` open it): metrics written inside get the stage's
    wall time so far as top-level `wall_s`. A nested clock keeps the outer start."""
    if _STAGE_START.get() is not None:
        yield
        return
    token = _STAGE_START.set(time.perf_counter())
    try:
        yield
    finally:
        _STAGE_START.reset(token)


def write_metrics(stage: str, metrics: dict, root: str | Path = Path(".")) -> Path:
    """Write `<root>/metrics/<stage>.json` (a DVC metrics file) atomically: a reader or an
    interrupted run never sees half a file. Inside a stage (`stage_clock`) it records top-level
    `wall_s`, the seconds since the stage started (replacing any `wall_s` the stage measured)."""
    start = _STAGE_START.get()
    if start is not None:
        metrics = {**metrics, "wall_s": time.perf_counter() - start}
    return write_json_atomic(Path(root) / "metrics" / f"{stage}.json", _rounded(metrics), indent=2)


def write_json_atomic(out: Path, value: Any, indent: int | None = None) -> Path:
    """`value` as JSON into `out` (sorted keys), written beside it first and renamed: never half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(value, sort_keys=True, indent=indent) + "\n"
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def stage_main(flow_fn: Callable[..., Any], argv: list[str] | None = None,
               options: dict[str, dict] | None = None, precheck: Callable[..., None] | None = None,
               worker: Callable[..., Any] | None = None,
               process_group: Callable[[Any], contextlib.AbstractContextManager] | None = None) -> Any:
    """The `__main__` of a stage: `python -m pipelines.<stage> [--params P] [--set s.k=v ...]`.

    `options`: the stage's own flags, {name: argparse keyword arguments}, passed to the flow as
    keyword arguments (e.g. {"method": dict(required=True, choices=...)} -> `--method drelay`).
    The params file and overrides are validated before the flow starts, so a typo is one
    `error: ...` line and exit code 2 (no traceback, no Prefect server start-up); so are the stage's
    inputs when it gives `precheck(params, **options)`, which raises FileNotFoundError naming what is missing.
    The stage's clock (`wall_s` in its metrics) starts after that, before the Prefect server it may start.

    A stage that gives `worker` runs under torchrun when its params ask for it (run.nproc_per_node or
    run.nnodes > 1): started plainly, it re-executes itself as `python -m torch.distributed.run ...
    -m pipelines.<stage> <its args>` (`torchrun_command`). Under torchrun every process joins the group
    (`process_group(params)`, a context manager); rank 0 runs the flow (Prefect, MLflow, metrics, outs)
    and every other rank `worker(params, **options)`: the same computation, nothing tracked or written.
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
        wants_torchrun = worker is not None and (params.run.nproc_per_node > 1 or params.run.nnodes > 1)
        if wants_torchrun and not under_torchrun():
            if precheck is not None and _node_rank() == 0:  # another node may start before node 0's inputs exist
                precheck(params, **extra)
            command = torchrun_command(_stage_module(flow_fn), sys.argv[1:] if argv is None else list(argv),
                                       params.run.nproc_per_node, params.run.nnodes)
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(command[0], command)  # torchrun in this process's place: its signals, its exit code
        if precheck is not None:
            precheck(params, **extra)
        group = process_group(params) if worker is not None and process_group is not None else contextlib.nullcontext()
        with group:
            if worker is not None and int(os.environ.get("RANK", "0")) != 0:
                return worker(params, **extra)
            with stage_clock(), prefect_api() if _is_prefect_flow(flow_fn) else contextlib.nullcontext():
                return flow_fn(params_path=args.params, overrides=args.overrides, **extra)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# torchrun's own settings for a multi-node run, read from the environment (its `PET_<OPTION>` variables)
RENDEZVOUS_ENV = ("PET_RDZV_ENDPOINT", "PET_MASTER_ADDR")


def under_torchrun() -> bool:
    """Whether this process is a worker torchrun started (it sets these for every worker it starts)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _node_rank() -> int:
    return int(os.environ.get("PET_NODE_RANK", os.environ.get("NODE_RANK", "0")))


def _stage_module(flow_fn: Callable[..., Any]) -> str:
    """The module `python -m` runs for this stage (pipelines.<stage>), to start it again under torchrun."""
    module = getattr(getattr(flow_fn, "fn", flow_fn), "__module__", "__main__")
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else None
    if not module:
        raise ConfigError("run.nproc_per_node / run.nnodes > 1: start the stage as `python -m pipelines.<stage>`")
    return module


def torchrun_command(module: str, args: list[str], nproc_per_node: int, nnodes: int) -> list[str]:
    """`python -m torch.distributed.run` starting `python -m <module> <args>` in nproc_per_node processes on
    each of nnodes nodes. One node: a standalone rendezvous on a free local port. Several: torchrun reads the
    rendezvous from its PET_* variables on every node (see the README's Distributed section), e.g.
    PET_MASTER_ADDR, PET_MASTER_PORT and PET_NODE_RANK, or PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT, PET_RDZV_ID."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
               f"--nnodes={nnodes}"]
    if nnodes == 1:
        if not any(name in os.environ for name in RENDEZVOUS_ENV):
            command.append("--standalone")
    elif not any(name in os.environ for name in RENDEZVOUS_ENV):
        raise ConfigError(f"run.nnodes = {nnodes}: set torchrun's rendezvous on every node, e.g. PET_MASTER_ADDR, "
                          f"PET_MASTER_PORT and PET_NODE_RANK (or PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT, PET_RDZV_ID)")
    return [*command, "-m", module, *args]


# Run as `python -c _DIE_WITH_PARENT <parent pid> <module> <args...>`: asks Linux to SIGTERM this
# process when the thread that started it dies (PR_SET_PDEATHSIG, kept across exec), then becomes
# `python -m <module> <args...>`. Elsewhere (no prctl) it only execs.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl: nothing to serve
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-m", *sys.argv[2:]])
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_prefect_flow(fn: Any) -> bool:
    flows = sys.modules.get("prefect.flows")  # not imported: fn cannot be a flow
    return flows is not None and isinstance(fn, flows.Flow)


def _refresh_prefect_settings() -> None:
    """Prefect reads its settings from the environment when it is imported; re-read them (for every
    thread, the log and event workers included) after PREFECT_API_URL changed."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def _drain_prefect_workers() -> None:
    """Send the flow run's queued logs and events while its server is still up (best effort)."""
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
    except Exception:  # noqa: BLE001 - losing a last log line must not fail a finished stage
        pass


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """The Prefect API a stage's flow run reports to: PREFECT_API_URL when it is set (a shared server,
    e.g. `make schedule`'s), otherwise a `prefect server start` of the stage's own on a free port of
    127.0.0.1 (its db under PREFECT_HOME), stopped when the flow returns. That server also dies when
    the stage process dies in any way, SIGKILL included: Prefect's own temporary server is stopped
    only by an atexit hook, so a killed stage left it running, orphaned."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        _refresh_prefect_settings()
        try:
            yield url
        finally:
            _drain_prefect_workers()
        return
    home = Path(os.environ.get("PREFECT_HOME", REPO_ROOT / ".prefect"))
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    with open(home / "stage-server.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), "prefect", "server", "start",
             "--host", "127.0.0.1", "--port", str(port), "--no-ui", "--no-scheduler", "--no-late-runs",
             "--analytics-off"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 180))
        wait_for_health(url, timeout, server=server)
        os.environ["PREFECT_API_URL"] = url
        _refresh_prefect_settings()
        try:
            yield url
        finally:
            _drain_prefect_workers()
            del os.environ["PREFECT_API_URL"]
            _refresh_prefect_settings()
    finally:
        stop_process(server)


def wait_for_health(api_url: str, timeout: float = 120.0, server: subprocess.Popen | None = None, *,
                    what: str = "the Prefect server", log: str = "PREFECT_HOME/stage-server.log",
                    interval: float = 0.5) -> None:
    """Block until `<api_url>/health` answers 200 (a Prefect server, or `what`), or raise TimeoutError;
    RuntimeError at once if `server`, the process that should answer, exits first (`log`: where it wrote)."""
    deadline = time.monotonic() + timeout
    while True:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"{what} for {api_url} exited with code {server.returncode} "
                               f"before answering (log: {log})")
        try:
            with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from {api_url}/health after {timeout:.0f} s (log: {log})")
        time.sleep(interval)
