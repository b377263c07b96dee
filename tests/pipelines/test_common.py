"""pipelines.common: the stage entry point (bad input is one line and exit 2), metrics files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.common import REPO_ROOT, resolve_from_repo, stage_main, write_metrics

# A stage whose flow only records that it ran: what stage_main does before the flow is the point.
STAGE = "from pipelines.common import stage_main; stage_main(lambda **kw: print('flow ran', kw))"


def run_stage(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STAGE, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_bad_params_key_is_one_error_line_and_exit_2(tmp_path, subprocess_env):
    (tmp_path / "params.yaml").write_text("distill:\n  batch_sise: 4\n")
    out = run_stage(cwd=tmp_path, env=subprocess_env)
    assert out.returncode == 2
    assert out.stderr.startswith("error: params.yaml: unknown key 'batch_sise' in section 'distill'")
    assert "did you mean 'batch_size'" in out.stderr
    assert "Traceback" not in out.stderr
    assert "flow ran" not in out.stdout


def test_bad_override_and_missing_file_exit_2(tmp_path, subprocess_env):
    (tmp_path / "params.yaml").write_text("")
    out = run_stage("--set", "distill.batch_size=many", cwd=tmp_path, env=subprocess_env)
    assert out.returncode == 2 and "distill.batch_size must be int" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_stage("--params", "nope.yaml", cwd=tmp_path, env=subprocess_env)
    assert out.returncode == 2 and out.stderr.strip() == "error: params file not found: nope.yaml"


def test_good_params_reach_the_flow(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text("distill:\n  batch_size: 4\n")
    calls = []
    result = stage_main(lambda **kw: calls.append(kw) or "done",
                        ["--params", str(params), "--set", "distill.batch_size=2",
                         "--set", "run.seed=3"])
    assert result == "done"
    assert calls == [{"params_path": str(params),
                      "overrides": ["distill.batch_size=2", "run.seed=3"]}]


def test_error_raised_inside_the_flow_is_exit_2(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("")

    def flow_fn(params_path, overrides):
        raise FileNotFoundError("models/target/config.json: run prepare_target first")

    with pytest.raises(SystemExit) as exit_info:
        stage_main(flow_fn, ["--params", str(tmp_path / "params.yaml")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: models/target/config.json: run prepare_target first\n"


def test_write_metrics_sorted_rounded_atomic(tmp_path):
    metrics = {"tau": 3.14159265358, "speedup": 2.0, "n": 7, "bad": float("nan"),
               "gsm8k": {"drelay": {"tau": 1e-9 / 3, "pool_hit": 0.5}}, "ok": True}
    path = write_metrics("eval", metrics, root=tmp_path)
    assert path == tmp_path / "metrics" / "eval.json"
    text = path.read_text()
    assert json.loads(text) == {"bad": None, "gsm8k": {"drelay": {"pool_hit": 0.5, "tau": 3.33333e-10}},
                                "n": 7, "ok": True, "speedup": 2.0, "tau": 3.14159}
    assert text.index('"bad"') < text.index('"gsm8k"') < text.index('"n"')  # sorted keys
    assert text.endswith("}\n") and '\n  "n": 7' in text  # indent 2
    write_metrics("eval", {"tau": 1.0}, root=tmp_path)  # replaced whole, no temp files left
    assert json.loads(path.read_text()) == {"tau": 1.0}
    assert [p.name for p in path.parent.iterdir()] == ["eval.json"]


def test_resolve_from_repo(tmp_path):
    assert resolve_from_repo("../shared") == REPO_ROOT / "../shared"
    assert resolve_from_repo(tmp_path) == tmp_path
    assert (REPO_ROOT / "pipelines" / "common.py").is_file()  # resolved to the real repo
