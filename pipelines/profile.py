"""Run the DVC pipeline with a profile's params, leaving the committed params.yaml alone.

    python -m pipelines.profile NAME [dvc repro args...]      (make repro PROFILE=NAME)

Each profile gets a workspace `runs/<NAME>/` (git-ignored): its own DVC repo (`dvc init
--no-scm`: own dvc.lock, outs and cache), symlinks to the repo's dvc.yaml and code so stage deps
resolve, and `params.yaml` copied from `profiles/<NAME>.yaml`. MLflow runs still go to the repo
root's store (pipelines.tracking resolves the repo through the symlink), one experiment per
profile, so all profiles compare in one UI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from drelay.config import ConfigError, load_params
from pipelines.common import REPO_ROOT, configure_environment

LINKED = ("dvc.yaml", "drelay", "pipelines")  # repo paths a workspace sees through symlinks


class ProfileError(Exception):
    """A profile that cannot be run (unknown name, invalid file, no dvc.yaml)."""


def profile_names(repo_root: Path = REPO_ROOT) -> list[str]:
    return sorted(p.stem for p in (repo_root / "profiles").glob("*.yaml"))


def _dvc(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`dvc ...` from this interpreter's environment; its stage commands find this venv's
    `python` first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, env=env)


def prepare_workspace(name: str, repo_root: Path = REPO_ROOT) -> Path:
    """Create or refresh `runs/<name>/`; returns its path. Re-running only fixes what changed."""
    repo_root = Path(repo_root).resolve()
    source = repo_root / "profiles" / f"{name}.yaml"
    if not source.is_file():
        known = ", ".join(profile_names(repo_root)) or "none"
        raise ProfileError(f"unknown profile {name!r}: no profiles/{name}.yaml "
                           f"(profiles: {known})")
    try:
        params = load_params(source)
    except ConfigError as e:
        raise ProfileError(str(e)) from None
    if params.run.profile != name:  # else its MLflow runs would land in another experiment
        raise ProfileError(f"profiles/{name}.yaml: run.profile is {params.run.profile!r}; "
                           f"set it to {name!r}")
    if not (repo_root / "dvc.yaml").is_file():
        raise ProfileError(f"no dvc.yaml in {repo_root}: nothing to reproduce")

    workspace = repo_root / "runs" / name
    workspace.mkdir(parents=True, exist_ok=True)
    if not (workspace / ".dvc").is_dir():
        for args in (["init", "--no-scm", "-q"], ["config", "core.analytics", "false"]):
            if _dvc(args, workspace).returncode != 0:
                raise ProfileError(f"dvc {' '.join(args)} failed in {workspace}")
    for rel in LINKED:  # relative links ("../../dvc.yaml"): the repo may move
        link = workspace / rel
        target = Path(os.path.relpath(repo_root / rel, workspace))
        if link.is_symlink() and link.readlink() == target:
            continue
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            raise ProfileError(f"{link} exists and is not a symlink; remove it")
        link.symlink_to(target, target_is_directory=(repo_root / rel).is_dir())
    copy = workspace / "params.yaml"
    text = source.read_text()
    if not copy.is_file() or copy.read_text() != text:  # unchanged: leave the file untouched
        copy.write_text(text)
    return workspace


def run_profile(name: str, dvc_args: list[str] = (), repo_root: Path = REPO_ROOT) -> int:
    """`dvc repro [dvc_args]` in the profile's workspace, output streamed; its exit code."""
    workspace = prepare_workspace(name, repo_root)
    print(f"profile {name}: dvc repro in {workspace}", file=sys.stderr, flush=True)
    return _dvc(["repro", *dvc_args], workspace).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m pipelines.profile NAME [dvc repro args...]\n"
              f"profiles: {', '.join(profile_names()) or 'none'}", file=sys.stderr)
        return 2
    configure_environment()
    try:
        return run_profile(argv[0], argv[1:])
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
