"""The whole pipeline for real: `dvc repro` of the smoke profile in a temporary copy of the repo,
the MLflow sqlite store read back, reruns, the scheduled retrain, the ablation and stage errors on
it. The stages report to one Prefect server for the module (PREFECT_API_URL). Kill-then-resume of
distill/train: tests/pipelines/test_resume.py (its own inputs, so the other xdist worker runs it)."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.common import REPO_ROOT
from tests.pipelines.conftest import seeded_mlflow_uri, stop_group

HEADS = ("dflash2", "domino", "dspark")
STAGES = ("prepare_target", "prepare_data", "distill", "train_dflash", "train@dflash", "train@drelay",
          "train@drelay-lite", *(f"train@{head}" for head in HEADS), "evaluate", "register", "serve_bench")
METRICS = {**{s: f"joint_{s[6:]}" for s in STAGES if s.startswith("train@")}, "evaluate": "eval",
           "serve_bench": "serve"}  # metrics file
BENCHMARKS = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "mt_bench", "alpaca")
EVAL_METHODS = ("ar", "dflash", "dflash2", "domino", "dspark", "drelay-lite", "drelay", "oracle")
pytestmark = pytest.mark.slow


def _copy_repo(dest: Path) -> Path:
    """The files a fresh clone would have (tracked + new, ignored ones left out) in a new git repo."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    for rel in filter(None, listed):
        if (REPO_ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, dest / rel)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def _set_params(repo: Path, updates: dict) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for dotted, value in updates.items():
        *path, key = dotted.split(".")
        node = params
        for part in path:  # nested sections: joint.drelay.lambda_repair
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _dvc(repo: Path, env: dict, *args: str) -> str:
    # Its own session: on a timeout the stage it runs is killed with it, not left orphaned.
    proc = subprocess.Popen([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=1800)  # a hang guard: the smoke repro takes ~10 min
    finally:
        stop_group(proc, first=signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout + stderr


def _runs_by_stage(uri: str) -> dict[str, list]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("drelay-smoke")
    runs = client.search_runs([experiment.experiment_id])
    by_stage: dict[str, list] = {}
    for run in runs:
        by_stage.setdefault(run.data.tags["stage"], []).append(run)
    return by_stage


@pytest.fixture(scope="module")
def smoke_repo(tmp_path_factory, mirror):
    tmp = tmp_path_factory.mktemp("pipeline")
    repo = _copy_repo(tmp / "repo")
    shutil.copy2(repo / "profiles" / "smoke.yaml", repo / "params.yaml")
    _set_params(repo, {"data.mirror": str(mirror)})
    return repo


@pytest.fixture
def env(subprocess_env, tmp_path_factory, prefect_server):
    """Stage processes' environment: the module's MLflow store and Prefect server."""
    uri = seeded_mlflow_uri(tmp_path_factory.getbasetemp() / "mlflow.db")
    return {**subprocess_env, "MLFLOW_TRACKING_URI": uri, "PREFECT_API_URL": prefect_server}


def _check_prepared_data(repo: Path) -> None:
    """prepare_data's card (the target's own prompts asked for) and distill's tokens per source; no prepared
    prompt equals or nearly equals a benchmark turn, checked by brute force over the stage's own outputs."""
    from drelay.config import load_params
    from drelay.data.dedup import normalize, shingles

    cfg = load_params(repo / "params.yaml").data
    card = json.loads((repo / "metrics/prepare_data.json").read_text())
    assert card["written.requested"] == cfg.writer.total > 0 and card["wall_s"] > 0
    assert card["train.total"] == cfg.max_train_prompts and (repo / "reports/data_card.md").is_file()
    distilled = json.loads((repo / "metrics/distill.json").read_text())
    per_source = {k: v for k, v in distilled.items() if k.startswith("response_tokens.source.")}
    assert sum(per_source.values()) == distilled["response_tokens"] and "response_tokens.source.gsm8k" in per_source
    prepared = repo / cfg.out_dir
    texts = [json.loads(line)["messages"][0]["content"] for name in ("train", "val")
             for line in (prepared / f"{name}.jsonl").read_text().splitlines()]
    turns = [t for path in (prepared / "benchmarks").glob("*.jsonl")
             for line in path.read_text().splitlines() for t in json.loads(line)["turns"]]
    bench = [shingles(normalize(t), cfg.shingle_words) for t in turns]
    bench_exact = {normalize(t) for t in turns}
    for text in texts:
        grams = shingles(normalize(text), cfg.shingle_words)
        assert normalize(text) not in bench_exact and max(len(grams & b) / len(grams | b) for b in bench) < \
            cfg.near_dup_threshold, text


def _check_serve_skip(repo: Path, run) -> None:
    """No CUDA here: serve_bench records the skip with its reason (no numbers), and still writes the prompt
    files and the exported drafts a GPU host would serve."""
    from drelay.serving.export import read_serving

    serve = json.loads((repo / "metrics/serve.json").read_text())
    assert serve["skipped"] == "no CUDA" and "no CUDA device" in serve["reason"] and "results" not in serve
    assert serve["prompt_files"] == {b: 2 for b in BENCHMARKS} and serve["wall_s"] > 0
    assert "not measured" in (repo / "reports/serve.md").read_text().lower()
    rows = (repo / "serve/prompts/gsm8k.jsonl").read_text().splitlines()
    assert len(rows) == 2 and json.loads(rows[0])["conversations"][0]["role"] == "user"
    assert read_serving(repo / "serve/drafts/drelay")["relay"] == "relay" and "skipped" in serve["drafts"]["dspark"]
    assert run.data.tags["skipped"] == "no CUDA" and run.info.status == "FINISHED"


def test_repro_logs_every_stage_and_reruns_only_what_changed(smoke_repo, env):
    repo, uri = smoke_repo, env["MLFLOW_TRACKING_URI"]
    log = _dvc(repo, env, "repro")
    assert all(f"Running stage '{s}'" in log for s in STAGES), log
    for path in ("models/target/config.json", "data/prepared/train.jsonl", "data/prepared/benchmarks/mt_bench.jsonl",
                 "data/distilled/manifest.json", "models/drafter/model.safetensors", "reports/train_dflash.png",
                 "models/joint/dflash/drafter/model.safetensors", "models/joint/drelay/drafter/model.safetensors",
                 "models/joint/drelay/relay/model.safetensors", "reports/joint_drelay.png",
                 *(f"models/joint/{head}/head/model.safetensors" for head in HEADS),
                 *(f"metrics/{METRICS.get(s, s)}.json" for s in STAGES)):
        assert (repo / path).is_file(), path
    _check_prepared_data(repo)
    trained = json.loads((repo / "metrics/train_dflash.json").read_text())
    assert trained["replay_tau"] >= 1 and trained["oracle_tau"] >= trained["replay_tau"]
    assert trained["live_tau"] >= 1 and trained["live_identical_rate"] == 1.0  # fp32 smoke target

    runs = _runs_by_stage(uri)
    assert {s: len(runs.get(s, [])) for s in STAGES} == {s: 1 for s in STAGES}
    train_run = runs["train_dflash"][0]
    assert {"train_loss", "val_loss", "replay_tau", "oracle_tau", "val_top1_pos1", "val_topk_pos1", "live_tau",
            "blocks_per_s"} <= set(train_run.data.metrics)
    assert train_run.data.params["train.lr"] == "0.001" and train_run.data.tags["profile"] == "smoke"
    assert {"response_tokens", "sequences", "generation_tokens_per_s"} <= set(runs["distill"][0].data.metrics)
    # joint training: both methods from the same drafter, same budget; drelay logs every loss term and
    # the per-position repair statistics, and saves the δ it chose
    dflash, drelay = (json.loads((repo / f"metrics/joint_{m}.json").read_text()) for m in ("dflash", "drelay"))
    assert dflash["steps"] == drelay["steps"] == 12 and dflash["start_native_tau"] == drelay["start_native_tau"]
    relay_config = json.loads((repo / "models/joint/drelay/relay/config.json").read_text())
    assert relay_config["repair_margin"] == drelay["repair_margin"]
    assert f"{drelay['repair_margin']:g}" in drelay["tune_taus"]
    logged = set(runs["train@drelay"][0].data.metrics)
    terms = ("loss", "ce", "support", "hinge", "reader_bce", "repair")
    assert {f"{split}_{t}" for split in ("train", "val") for t in terms} <= logged
    assert {f"replay_{stat}_pos{i}" for stat in ("accept", "pool_hit", "replace_rate", "repair_precision", "harm_rate")
            for i in (1, 2, 3)} <= logged
    assert {"native_tau", "oracle_tau", "tune_tau_0", "tune_tau_1", "live_tau", "live_repair_share"} <= logged
    assert drelay["live_identical_rate"] == 1.0 and runs["train@drelay"][0].data.tags["method"] == "drelay"
    for head in HEADS:  # the baselines: same start and budget, their own loss terms logged
        m = json.loads((repo / f"metrics/joint_{head}.json").read_text())
        assert m["steps"] == 12 and m["start_native_tau"] == dflash["start_native_tau"]
        assert m["live_identical_rate"] == 1.0
        assert {"train_loss", "train_ce", "train_acc", "train_native_acc", "replay_tau",
                "replay_replace_rate_pos1"} <= set(runs[f"train@{head}"][0].data.metrics)
    _check_evaluation(repo, runs["evaluate"][0])
    _check_serve_skip(repo, runs["serve_bench"][0])

    log = _dvc(repo, env, "repro")  # nothing changed: nothing runs
    assert "Running stage" not in log, log
    assert sum(len(r) for r in _runs_by_stage(uri).values()) == len(STAGES)

    # Which stages a params change re-runs is checked on a locked repo without training
    # (tests/test_dvc_deps.py), and which eval cells a changed model recomputes in-process
    # (tests/eval/test_run.py): re-running stages here would only repeat them at minutes' cost.


def _trigger_retrain(env: dict, workdirs: list[Path], tmp_path: Path) -> dict:
    """Serve the retrain deployment (`python -m pipelines.schedule`, what `make schedule` runs, on a schedule with a
    time zone) and trigger one run per workdir through Prefect, one after the other: {"schedules": the served
    deployment's [cron, timezone], "runs": each run's {"state", "logs"}}."""
    from tests.pipelines.test_schedule import TRIGGER, serving_deployment

    schedule = 'schedule:\n  cron: "0 3 * * 0"\n  timezone: Europe/Paris\n'
    with serving_deployment(schedule, env, tmp_path) as (served_env, log):
        done = subprocess.run([sys.executable, "-c", TRIGGER.replace("timeout=120", "timeout=600"),
                               *map(str, workdirs)], env=served_env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + log.read_text()[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _retrain_summaries(uri: str, experiment: str = "drelay-smoke") -> list[dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], "tags.stage = 'retrain'", order_by=["attributes.start_time"])
    out = []
    for run in runs:
        path = client.download_artifacts(run.info.run_id, "retrain_summary.json")
        out.append({**json.loads(Path(path).read_text()), "status": run.info.status, "tags": run.data.tags})
    return out


def test_scheduled_retrain_gates_the_champion_and_a_failed_run_leaves_it(smoke_repo, env, tmp_path):
    """A real scheduled run on the reproduced smoke profile: the pipeline is up to date, the register stage's
    versions exist, the gate makes the first DRelay version the champion; then a run whose pipeline fails
    (a bad params key) leaves the champion where it was, and both runs' summaries are in MLflow. The same served
    deployment then runs a DVC project without a register stage (no gate, dvc's output in the run log) and a
    folder that is no DVC project (the run fails)."""
    from mlflow.tracking import MlflowClient

    from tests.pipelines.test_schedule import dvc_project

    repo, uri = smoke_repo, env["MLFLOW_TRACKING_URI"]
    client = MlflowClient(tracking_uri=uri)
    registered = json.loads((repo / "metrics/register.json").read_text())["models"]
    assert set(registered) == {"dflash", "drelay", "drelay-lite", *HEADS}
    versions = client.search_model_versions("name = 'drelay-smoke-drelay'")
    assert len(versions) == 1 and versions[0].tags["method"] == "drelay" and "T0.tau" in versions[0].tags

    # the same reproduction with a bad params key: its pipeline fails before any stage finishes
    broken = tmp_path / "broken"
    shutil.copytree(repo, broken, symlinks=True)
    _set_params(broken, {"joint.common.no_such_key": 1})
    project, not_dvc = dvc_project(tmp_path / "project", env), tmp_path / "not_dvc"
    not_dvc.mkdir()
    result = _trigger_retrain(env, [repo, broken, project, not_dvc], tmp_path)
    assert result["schedules"] == [["0 3 * * 0", "Europe/Paris"]]
    good, bad, plain, outside = result["runs"]
    assert good["state"] == "COMPLETED", good["logs"][-30:]
    assert bad["state"] == "FAILED" and any("no_such_key" in m for m in bad["logs"]), bad["logs"][-30:]
    champion = client.get_model_version_by_alias("drelay-smoke-drelay", "champion")
    assert int(champion.version) == registered["drelay"]["version"] == 1  # promoted by the first, kept by the second
    promoted, failed = _retrain_summaries(uri)
    assert promoted["pipeline"] == "succeeded" and promoted["gate"]["promoted"] and promoted["status"] == "FINISHED"
    assert "no champion yet" in promoted["gate"]["reason"] and promoted["tags"]["gate"] == "promoted"
    assert failed["pipeline"] == "failed" and failed["status"] == "FAILED" and failed["champion"] == 1
    assert "no_such_key" in failed["error"] and failed["tags"]["gate"] == "not run"
    assert len(client.search_model_versions("name = 'drelay-smoke-drelay'")) == 1

    assert plain["state"] == "COMPLETED", plain["logs"][-30:]
    assert (project / "out.txt").read_text() == "ok" and f"running dvc repro in {project}" in plain["logs"]
    assert "Running stage 'hello':" in plain["logs"]  # dvc's own output, streamed into the run log
    assert outside["state"] == "FAILED"  # dvc repro outside a DVC repo exits non-zero
    assert any("dvc repro exited with code" in m for m in outside["logs"])
    # no params file in either: the default profile's experiment; no register stage, so the gate does not run
    elsewhere = _retrain_summaries(uri, "drelay-default")
    assert [(r["tags"]["pipeline"], r["tags"]["gate"], r["status"]) for r in elsewhere] == [
        ("succeeded", "not run", "FINISHED"), ("failed", "not run", "FAILED")]
    assert elsewhere[0]["gate_skipped"].startswith("the pipeline has no register stage")


def test_the_ablation_trains_each_variant_once_and_writes_its_table(smoke_repo, env, in_process_stage, monkeypatch):
    """On the reproduced smoke pipeline: drelay-lite, + the lattice alone, and all of DRelay v2, one MLflow
    run each; a second call reuses them; an unknown part is one error line."""
    monkeypatch.chdir(smoke_repo)
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.setenv(key, env[key])
    assert in_process_stage("ablation", "--only", "lattice") == 0
    metrics = json.loads((smoke_repo / "metrics/drelay_ablation.json").read_text())
    assert metrics.pop("wall_s") > 0  # every stage's metrics carry its wall time
    assert sorted(metrics) == sorted(["drelay-lite", "+ lattice", "drelay (all)"])  # (metrics files sort their keys)
    assert metrics["drelay-lite"]["gain"] == 0 and all(m["replay_tau"] >= 1 for m in metrics.values())
    assert all("repair_margin" in m and m["oracle_tau"] >= m["native_tau"] for m in metrics.values())
    report = (smoke_repo / "reports/drelay_ablation.md").read_text()
    assert "| + lattice |" in report and "Acceptance rate per block position" in report
    runs = [r for rs in _runs_by_stage(env["MLFLOW_TRACKING_URI"]).values() for r in rs if "ablation" in r.data.tags]
    assert sorted(r.data.tags["ablation"] for r in runs) == sorted(metrics)
    assert in_process_stage("ablation", "--only", "lattice") == 0  # finished variants are read back
    again = [r for rs in _runs_by_stage(env["MLFLOW_TRACKING_URI"]).values() for r in rs if "ablation" in r.data.tags]
    assert len(again) == len(runs)
    assert in_process_stage("ablation", "--only", "latice") == 2


def _check_evaluation(repo: Path, run) -> None:
    """eval.json: every temperature x benchmark (+ mean) x method, finite numbers, the identical-output
    check passed at T=0 (float32 smoke target); the report and plots; the numbers in MLflow."""
    tables = json.loads((repo / "metrics/eval.json").read_text())
    for tkey in ("T0", "T1"):
        assert set(tables[tkey]) == {*BENCHMARKS, "mean"}  # (metrics files are written with sorted keys)
        for bench, cells in tables[tkey].items():
            assert set(cells) == set(EVAL_METHODS), (tkey, bench)
            for method, metrics in cells.items():
                assert all(v is not None and math.isfinite(v) for v in metrics.values()), (tkey, bench, method)
                assert metrics["tau"] >= 1.0
                if method != "ar":
                    assert {"pool_hit", "replace_rate", "repair_precision", "harm_rate"} <= set(metrics)
                if not (method == "oracle" and tkey == "T1"):  # the live oracle needs T=0
                    assert metrics["speedup"] > 0 and metrics["tokens_per_s"] > 0
                if tkey == "T0" and method != "ar":
                    assert metrics["identical_rate"] == 1.0
            assert cells["oracle"]["tau"] >= cells["dflash"]["tau"]
    report = (repo / "reports/eval.md").read_text()
    assert "| benchmark | ar | dflash | dflash2 | domino | dspark | drelay-lite | drelay | oracle |" in report
    assert "drelay against each method (T0)" in report and "| benchmark | dflash | dflash2 | domino |" in report
    paired = json.loads((repo / "metrics/eval.json").read_text())["paired"]
    for tkey in ("T0", "T1"):
        assert set(paired[tkey]) == set(EVAL_METHODS) - {"ar", "drelay"}
        for other, rows in paired[tkey].items():
            assert set(rows) == {*BENCHMARKS, "mean"}
            mean = rows["mean"]
            assert mean["low"] <= mean["diff"] <= mean["high"], (tkey, other)
            diff = tables[tkey]["mean"]["drelay"]["tau"] - tables[tkey]["mean"][other]["tau"]
            assert abs(mean["diff"] - diff) < 1e-4, (tkey, other)
    assert report.count("| **mean** |") == 4 and "replay" in report and "live" in report  # τ + paired, per T
    for name in ("tau", "acceptance", "repair"):
        assert (repo / f"reports/eval_{name}.png").stat().st_size > 10000
    logged = run.data.metrics
    assert logged["T0/mean/drelay/tau"] == pytest.approx(tables["T0"]["mean"]["drelay"]["tau"], rel=1e-5)
    assert logged["T1/gsm8k/dspark/speedup"] == pytest.approx(tables["T1"]["gsm8k"]["dspark"]["speedup"], rel=1e-5)


# Params keys the error checks override, in one place (params sections are being restructured).
JOINT_OUT_DIR, JOINT_METHODS = "joint.common.out_dir", "joint.methods"


def test_bad_key_and_missing_inputs_are_clear_errors(smoke_repo, env, tmp_path, monkeypatch, capsys,
                                                     in_process_stage):
    """Each stage's `__main__` in-process (the same argv, options and prechecks as `python -m
    pipelines.<stage>`; tests/pipelines/test_common.py runs one for real): one `error:` line, exit 2."""
    monkeypatch.chdir(smoke_repo)
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):  # prepare_data's flow runs before it fails
        monkeypatch.setenv(key, env[key])

    def stage(name: str, *args: str) -> tuple[int, str]:
        code = in_process_stage(name, *args)
        return code, capsys.readouterr().err

    bad = tmp_path / "bad.yaml"
    bad.write_text((smoke_repo / "params.yaml").read_text().replace("max_steps:", "max_step:"))
    code, err = stage("train_dflash", "--params", str(bad))
    assert code == 2 and "unknown key 'max_step' in section 'train'" in err
    assert "did you mean 'max_steps'" in err and "Traceback" not in err and err.startswith("error: ")

    empty = tmp_path / "empty-mirror"
    empty.mkdir()
    code, err = stage("prepare_data", "--set", f"data.mirror={empty}", "--set", f"data.out_dir={tmp_path / 'prepared'}")
    assert code == 2, err[-2000:]
    assert str(empty / "benchmarks") in err and "openai/gsm8k" in err
    assert err.splitlines()[-1].startswith("error: ")
    assert (smoke_repo / "data/prepared/train.jsonl").is_file()  # what was computed is still there

    code, err = stage("train", "--method", "drelay", "--set", f"train.out_dir={tmp_path / 'none'}")
    assert code == 2 and str(tmp_path / "none") in err and "train_dflash stage" in err
    assert "Traceback" not in err and err.startswith("error: ")
    code, err = stage("train", "--method", "medusa")
    assert code == 2 and "invalid choice: 'medusa'" in err

    code, err = stage("evaluate", "--set", f"{JOINT_OUT_DIR}={tmp_path / 'none'}")
    assert code == 2 and str(tmp_path / "none" / "dflash") in err
    assert "train@dflash stage" in err and "Traceback" not in err
    code, err = stage("evaluate", "--set", "eval.methods=[ar, medusa]")
    assert code == 2 and "eval.methods must be" in err
    code, err = stage("evaluate", "--set", f"{JOINT_METHODS}=[dflash]")
    assert code == 2 and "which joint.methods does not train" in err
    # evaluate reads prepare_data's benchmark copies: a missing one names the file and the stage
    joint, target = tmp_path / "joint", tmp_path / "target"
    for method in ("dflash", "dflash2", "domino", "dspark", "drelay", "drelay-lite"):
        (joint / method / "drafter").mkdir(parents=True)
        (joint / method / "drafter" / "config.json").write_text("{}")
    target.mkdir()
    (target / "config.json").write_text("{}")
    code, err = stage("evaluate", "--set", f"{JOINT_OUT_DIR}={joint}", "--set", f"target.path={target}",
                      "--set", f"data.out_dir={tmp_path / 'unprepared'}")
    assert code == 2 and str(tmp_path / "unprepared" / "benchmarks" / "gsm8k") in err
    assert "the prepare_data stage writes it" in err and err.startswith("error: ")
