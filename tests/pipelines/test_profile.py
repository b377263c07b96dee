"""pipelines.profile: a real `dvc repro` in runs/<name>/ of a tiny fake repo, params.yaml untouched."""

from __future__ import annotations

import pytest

from pipelines.profile import ProfileError, main, prepare_workspace, run_profile

# One stage: its code lives in pipelines/ (reached through the workspace symlink), it reads a
# params key, and writes its out.
DVC_YAML = """\
stages:
  echo:
    cmd: python pipelines/echo.py
    deps: [pipelines/echo.py]
    params: [distill.batch_size]
    outs: [out.txt]
"""
ECHO = """\
import yaml
params = yaml.safe_load(open("params.yaml"))
open("out.txt", "w").write(f"batch_size={params['distill']['batch_size']}")
"""


@pytest.fixture
def fake_repo(tmp_path, subprocess_env, monkeypatch):
    for key in ("PATH", "DVC_NO_ANALYTICS", "DO_NOT_TRACK"):  # dvc runs in a subprocess
        monkeypatch.setenv(key, subprocess_env[key])
    repo = tmp_path / "repo"
    (repo / "drelay").mkdir(parents=True)
    (repo / "pipelines").mkdir()
    (repo / "pipelines" / "echo.py").write_text(ECHO)
    (repo / "profiles").mkdir()
    (repo / "profiles" / "x.yaml").write_text("run:\n  profile: x\ndistill:\n  batch_size: 7\n")
    (repo / "dvc.yaml").write_text(DVC_YAML)
    (repo / "params.yaml").write_text("distill:\n  batch_size: 1\n")
    return repo


def test_profile_repro_in_its_own_workspace(fake_repo):
    committed = fake_repo / "params.yaml"
    before = (committed.read_text(), committed.stat().st_mtime_ns)

    assert run_profile("x", repo_root=fake_repo) == 0

    workspace = fake_repo / "runs" / "x"
    assert (workspace / "out.txt").read_text() == "batch_size=7"
    assert (workspace / ".dvc").is_dir() and (workspace / "dvc.lock").is_file()
    assert "analytics = false" in (workspace / ".dvc" / "config").read_text()
    for name in ("dvc.yaml", "drelay", "pipelines"):
        assert (workspace / name).is_symlink()
        assert (workspace / name).resolve() == fake_repo / name
    copy = workspace / "params.yaml"
    assert copy.read_text() == (fake_repo / "profiles" / "x.yaml").read_text()
    assert (committed.read_text(), committed.stat().st_mtime_ns) == before
    assert not (fake_repo / "out.txt").exists()

    # Again: the copy is left alone when the profile did not change, rewritten when it did.
    stamp = copy.stat().st_mtime_ns
    prepare_workspace("x", fake_repo)
    assert copy.stat().st_mtime_ns == stamp
    (fake_repo / "profiles" / "x.yaml").write_text("run:\n  profile: x\ndistill:\n  batch_size: 9\n")
    prepare_workspace("x", fake_repo)
    assert "batch_size: 9" in copy.read_text()


def test_unknown_profile_lists_the_known_ones(fake_repo):
    (fake_repo / "profiles" / "gpu.yaml").write_text("run:\n  profile: gpu\n")
    with pytest.raises(ProfileError, match=r"unknown profile 'nope': no profiles/nope.yaml "
                                           r"\(profiles: gpu, x\)"):
        prepare_workspace("nope", fake_repo)
    assert not (fake_repo / "runs").exists()


def test_profile_must_name_itself(fake_repo):
    (fake_repo / "profiles" / "y.yaml").write_text("distill:\n  batch_size: 2\n")
    with pytest.raises(ProfileError, match="run.profile is 'default'; set it to 'y'"):
        prepare_workspace("y", fake_repo)


def test_cli_error_is_one_line_exit_2(capsys):
    assert main(["no-such-profile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown profile 'no-such-profile'") and "Traceback" not in err
