"""pipelines.remote (make push / make pull) round-trips a reproduced DVC project through a real local remote:
the outputs come back byte for byte on a clone with no cache and no outputs, and the pipeline is up to date."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from pipelines.remote import configured_remote, main as remote_main

STAGE = """stages:
  make:
    cmd: python make.py
    deps: [make.py]
    outs: [out]
    metrics:
      - metrics.json:
          cache: false
"""
MAKE = """import pathlib
out = pathlib.Path("out")
out.mkdir(exist_ok=True)
(out / "model.bin").write_bytes(bytes(range(256)) * 64)
pathlib.Path("metrics.json").write_text('{"x": 1}')
"""


def _run(cmd: list[str], cwd: Path, env: dict) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


def _project(path: Path, env: dict) -> Path:
    path.mkdir()
    _run(["git", "init", "-q"], path, env)
    _run([sys.executable, "-m", "dvc", "init", "-q"], path, env)
    (path / "dvc.yaml").write_text(STAGE)
    (path / "make.py").write_text(MAKE)
    return path


def test_push_then_pull_on_a_fresh_clone(tmp_path, subprocess_env, monkeypatch):
    env = subprocess_env
    monkeypatch.setenv("DRELAY_DVC_REMOTE", str(tmp_path / "team-remote"))  # the default remote's place
    repo = _project(tmp_path / "a", env)
    _run([sys.executable, "-m", "dvc", "repro"], repo, env)
    original = (repo / "out" / "model.bin").read_bytes()

    assert remote_main(["push", "--workspace", str(repo)]) == 0  # no remote configured: the default directory
    assert configured_remote(repo) == str((tmp_path / "team-remote").resolve())
    assert any(p.is_file() for p in (tmp_path / "team-remote").rglob("*"))
    assert ".dvc/config.local" not in _run(["git", "status", "--porcelain", "--untracked-files=all"], repo, env)

    # another machine: the committed files only (dvc.yaml, dvc.lock, the metrics), no cache, no outputs
    clone = tmp_path / "b"
    clone.mkdir()
    for rel in ("dvc.yaml", "dvc.lock", "make.py", "metrics.json", ".dvc/config", ".dvcignore"):
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, clone / rel)
    _run(["git", "init", "-q"], clone, env)
    assert remote_main(["pull", "--workspace", str(clone), "--remote", str(tmp_path / "team-remote")]) == 0
    assert (clone / "out" / "model.bin").read_bytes() == original
    assert "up to date" in _run([sys.executable, "-m", "dvc", "status"], clone, env)


def test_not_a_workspace_is_a_clear_error(tmp_path, capsys):
    assert remote_main(["pull", "--workspace", str(tmp_path)]) == 2
    assert f"{tmp_path} has no dvc.yaml" in capsys.readouterr().err

