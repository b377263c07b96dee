"""pipelines.common: the stage entry point (bad input is one line and exit 2), metrics files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.common import REPO_ROOT, resolve_from_repo, stage_clock, stage_main, write_metrics

def run_stage(*args: str, capsys) -> tuple[int, list, str]:
    """stage_main with a flow that only records its calls: what happens before the flow is the point.
    (exit code or 0, the flow's calls, stderr)."""
    calls = []
    try:
        stage_main(lambda **kw: calls.append(kw), list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, calls, capsys.readouterr().err


def test_bad_params_key_is_one_error_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("distill:\n  batch_sise: 4\n")
    code, calls, err = run_stage(capsys=capsys)
    assert code == 2 and calls == []
    assert err.startswith("error: params.yaml: unknown key 'batch_sise' in section 'distill'")
    assert "did you mean 'batch_size'" in err and err.count("\n") == 1


def test_bad_override_and_missing_file_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("")
    code, calls, err = run_stage("--set", "distill.batch_size=many", capsys=capsys)
    assert code == 2 and calls == [] and "distill.batch_size must be int" in err
    assert err.startswith("error: ") and err.count("\n") == 1
    code, calls, err = run_stage("--params", "nope.yaml", capsys=capsys)
    assert code == 2 and calls == [] and err == "error: params file not found: nope.yaml\n"


def test_real_stage_process_bad_key_is_one_error_line_exit_2_before_prefect(tmp_path, subprocess_env):
    """The one real `python -m pipelines.<stage>` error check (the rest call stage_main in-process):
    one `error:` line on stderr, exit 2, no traceback, and no Prefect server was started for it."""
    (tmp_path / "bad.yaml").write_text("data:\n  mirorr: x\n")
    # prepare_data: the stage with the fewest imports (~2x quicker to start than the training ones)
    out = subprocess.run([sys.executable, "-m", "pipelines.prepare_data", "--params", "bad.yaml"], cwd=tmp_path,
                         env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.startswith("error: bad.yaml: unknown key 'mirorr' in section 'data'")
    assert "did you mean 'mirror'" in out.stderr and len(out.stderr.splitlines()) == 1
    assert out.stdout == ""
    assert not (Path(subprocess_env["PREFECT_HOME"]) / "stage-server.log").exists()


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


def test_metrics_written_in_a_stage_record_its_wall_time(tmp_path):
    assert "wall_s" not in json.loads(write_metrics("plain", {"n": 1}, root=tmp_path).read_text())
    with stage_clock():
        time.sleep(0.05)
        with stage_clock():  # nested (stage_main around stage_run): the outer start counts
            time.sleep(0.05)
            path = write_metrics("timed", {"n": 1, "wall_s": 0.001}, root=tmp_path)
    written = json.loads(path.read_text())
    assert written["n"] == 1 and 0.1 <= written["wall_s"] < 5  # the stage's own wall_s is replaced
    assert "wall_s" not in json.loads(write_metrics("after", {"n": 1}, root=tmp_path).read_text())


def test_stage_main_times_the_whole_flow(tmp_path):
    (tmp_path / "params.yaml").write_text("")

    def flow_fn(params_path, overrides):
        time.sleep(0.1)  # e.g. loading the model before the stage's own timer started
        return write_metrics("stage", {"n": 1}, root=tmp_path)

    path = stage_main(flow_fn, ["--params", str(tmp_path / "params.yaml")])
    assert json.loads(path.read_text())["wall_s"] >= 0.1


def test_resolve_from_repo(tmp_path):
    assert resolve_from_repo("../shared") == REPO_ROOT / "../shared"
    assert resolve_from_repo(tmp_path) == tmp_path
    assert (REPO_ROOT / "pipelines" / "common.py").is_file()  # resolved to the real repo


PROBE = """
import os, sys, urllib.request
url = os.environ["PREFECT_API_URL"]
with urllib.request.urlopen(url + "/health", timeout=10) as r:
    print(url, r.status)
sys.exit(int(sys.argv[1]))
"""


def test_prefect_session_serves_one_api_for_the_whole_command_and_stops_it(tmp_path, subprocess_env):
    """`python -m pipelines.prefect_session CMD` (make repro): CMD sees a live PREFECT_API_URL, its exit code is
    passed on, and the server is gone when it returns; a URL already set is passed through, no server started."""
    import urllib.error
    import urllib.request

    def session(*cmd: str, env=subprocess_env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipelines.prefect_session", *cmd], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    out = session(sys.executable, "-c", PROBE, "3")
    assert out.returncode == 3, out.stderr[-2000:]
    url, status = out.stdout.split()
    assert url.startswith("http://127.0.0.1:") and status == "200"
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # stopped with the command
        urllib.request.urlopen(url + "/health", timeout=5)

    given = {**subprocess_env, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens: not contacted
    out = session(sys.executable, "-c", "import os; print(os.environ['PREFECT_API_URL'])", env=given)
    assert out.returncode == 0 and out.stdout.strip() == "http://127.0.0.1:9/api"
    assert session().returncode == 2 and "usage" in session().stderr
