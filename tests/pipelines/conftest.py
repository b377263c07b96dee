"""Pipeline test plumbing: subprocess environments (the repo importable, telemetry off), one real
Prefect server per test module, and the stages' `__main__` run in-process. Every Prefect home a test
makes starts from a copy of one migrated database (`seeded_prefect_home`)."""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipelines.common import REPO_ROOT

BIN = Path(sys.executable).parent


def _template(name: str, version: str, filename: str, make) -> Path:
    """An empty, migrated store `filename` made once per test run by `make(folder)` (which writes folder/filename),
    kept under DRELAY_CACHE (tests/conftest.py) keyed by the library's version; a file lock makes it once for both
    xdist workers. Prefect and MLflow migrate an empty store on first use: a Prefect server on an empty home takes
    ~15 s to answer here instead of ~4 s, a new MLflow sqlite store ~2-5 s, and the suite makes several of each."""
    import filelock

    cache = Path(os.environ["DRELAY_CACHE"]) / f"{name}-{version}"
    path = cache / filename
    cache.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(cache / ".lock")):
        if not path.is_file():
            work = cache / "migrating"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            make(work)
            os.replace(work / filename, path)
            shutil.rmtree(work, ignore_errors=True)
    return path


def _prefect_db(folder: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
           "PREFECT_HOME": str(folder), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    subprocess.run([str(BIN / "prefect"), "server", "database", "upgrade", "-y"], env=env, check=True,
                   capture_output=True, timeout=300)


def _mlflow_db(folder: Path) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()  # creates and migrates it


def seeded_mlflow_uri(db: Path) -> str:
    """`sqlite:///<db>`, the file a copy of an empty, migrated MLflow store unless it exists."""
    if not db.exists():
        import mlflow

        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template("mlflow-db", mlflow.__version__, "mlflow.db", _mlflow_db), db)
    return f"sqlite:///{db}"


def seeded_prefect_home(home: Path) -> Path:
    """`home` made, with a copy of an empty, migrated Prefect database unless it has one: the real server, store
    and migrations (the copy is what they wrote), without each test waiting for them."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "prefect.db").exists():
        import prefect

        shutil.copyfile(_template("prefect-db", prefect.__version__, "prefect.db", _prefect_db), home / "prefect.db")
    return home


def base_env(prefect_home: Path) -> dict[str, str]:
    """os.environ plus: `pipelines` importable from any cwd (even before the editable install
    knows the package), this venv's `python` first on PATH, Prefect state under `prefect_home`."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PREFECT_", "MLFLOW_TRACKING_URI"))}
    path = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update({
        "PYTHONPATH": path,
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "PREFECT_HOME": str(seeded_prefect_home(prefect_home)),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
        "DO_NOT_TRACK": "1",
    })
    return env


@pytest.fixture
def subprocess_env(tmp_path) -> dict[str, str]:
    """The environment of a subprocess a test starts; no PREFECT_API_URL (a stage starts its own)."""
    return base_env(tmp_path / "prefect-home")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM, grace: float = 15) -> None:
    """Signal the process group of `proc` (started with start_new_session=True: the process and
    whatever it started), SIGKILL the group after `grace` seconds; `proc` is reaped."""
    try:
        os.killpg(proc.pid, first)
        proc.wait(grace)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, even when `proc` exited
    except ProcessLookupError:
        pass
    proc.wait(10)


def wait_healthy(proc: subprocess.Popen, api_url: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prefect server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"prefect server not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> str:
    """`prefect server start` on 127.0.0.1 for the whole module (a start costs 5-20 s here): its API
    URL. Stopped with its process group at the module's end."""
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = home / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
            env=base_env(home), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, api_url, log)
        yield api_url
    finally:
        stop_group(proc)


def run_stage_main(stage: str, *args: str) -> int:
    """`python -m pipelines.<stage> ARGS` in this process (its `__main__` block, options and prechecks
    included; stage modules are not imported elsewhere in the tests): the exit code it asks for
    (0 when it returns)."""
    argv = sys.argv
    sys.argv = [f"pipelines/{stage}.py", *args]
    try:
        runpy.run_module(f"pipelines.{stage}", run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return 0


@pytest.fixture
def in_process_stage(monkeypatch, tmp_path_factory):
    """`run_stage_main`, with what importing a stage sets up (configure_environment's defaults,
    PREFECT_HOME included) kept inside this test: os.environ is restored afterwards."""
    saved = dict(os.environ)
    monkeypatch.setenv("PREFECT_HOME", str(seeded_prefect_home(tmp_path_factory.mktemp("prefect-home"))))
    yield run_stage_main
    os.environ.clear()
    os.environ.update(saved)
