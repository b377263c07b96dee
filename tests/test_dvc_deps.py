"""dvc.yaml's code dependencies are the stages' real import closures: a stage that imports a module its
`deps` do not cover could be called up to date after a change to that module, and a dep it never imports
re-runs it for nothing. The closure follows every `import` of a repo module (drelay/, pipelines/) from the
stage's `python -m pipelines.<stage>` module, including imports inside functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("drelay", "pipelines")
# Imports the AST cannot see: the kernel choice loads the Triton launchers by name (drelay/kernels/ops.py).
DYNAMIC = {"drelay/kernels/ops.py": sorted(str(p.relative_to(ROOT)) for p in (ROOT / "drelay/kernels").glob("*.py"))}


def module_file(module: str, root: Path = ROOT) -> Path | None:
    path = root / module.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_empty_init(path: Path) -> bool:
    """A package __init__ with nothing but a docstring (and a `__version__`) adds no behaviour: not a dependency."""
    def inert(node) -> bool:
        if isinstance(node, ast.Expr):
            return isinstance(node.value, ast.Constant)
        return (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
                and isinstance(node.value, ast.Constant))
    return path.name == "__init__.py" and all(inert(n) for n in ast.parse(path.read_text()).body)


def imported_files(path: Path, root: Path = ROOT) -> set[Path]:
    """Repo files `path` imports directly (a `from pkg import name` may name a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] not in PACKAGES:
                continue
            for i in range(1, len(parts) + 1):  # the module and the packages above it
                file = module_file(".".join(parts[:i]), root)
                if file is not None:
                    found.add(file)
    return found


def closure(entry: Path, root: Path = ROOT) -> set[str]:
    """Every repo file `entry` reaches through imports, as paths relative to `root`."""
    seen, todo = set(), [entry]
    while todo:
        path = todo.pop()
        rel = str(path.relative_to(root))
        if rel in seen:
            continue
        seen.add(rel)
        todo += imported_files(path, root)
        todo += [root / d for d in DYNAMIC.get(rel, [])]
    return {p for p in seen if not _is_empty_init(root / p)}


def stage_commands(dvc_yaml: Path = ROOT / "dvc.yaml") -> dict[str, tuple[str, list[str]]]:
    """{stage: (its pipelines module file, its deps)}; a foreach stage is checked once (its deps are templated alike)."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    out = {}
    for name, stage in stages.items():
        body = stage.get("do", stage)
        module = re.search(r"python -m (pipelines\.\w+)", body["cmd"]).group(1)
        deps = [d for d in body.get("deps", []) if isinstance(d, str) and d.split("/")[0] in PACKAGES]
        out[name] = (str(module_file(module).relative_to(ROOT)), deps)
    return out


def coverage_problems(dvc_yaml: Path = ROOT / "dvc.yaml", root: Path = ROOT) -> list[str]:
    problems = []
    for stage, (entry, deps) in stage_commands(dvc_yaml).items():
        files = closure(root / entry, root)
        covered = lambda f: any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)  # noqa: E731
        problems += [f"{stage}: imports {f}, which its deps do not cover" for f in sorted(files) if not covered(f)]
        for dep in deps:
            listed = [dep] if dep.endswith(".py") else sorted(  # a folder dep: every module in it
                str(p.relative_to(root)) for p in (root / dep).rglob("*.py") if not _is_empty_init(p))
            problems += [f"{stage}: depends on {f}, which it never imports" for f in listed if f not in files]
    return problems


def test_every_stage_depends_on_exactly_the_code_it_imports():
    assert coverage_problems() == []


def missing_params(profile: Path, dvc_yaml: Path = ROOT / "dvc.yaml") -> list[str]:
    """The stage params (`joint.${item}` for each of the profile's joint.methods) absent from a params file:
    DVC refuses to run a stage whose params are missing, whatever their defaults in drelay/config.py."""
    values = yaml.safe_load(profile.read_text())
    missing = []
    for name, stage in yaml.safe_load(dvc_yaml.read_text())["stages"].items():
        body = stage.get("do", stage)
        items = values.get("joint", {}).get("methods", []) if "foreach" in stage else [None]
        for item in items:
            for key in body.get("params", []):
                node = values
                for part in key.replace("${item}", str(item)).split("."):
                    node = node.get(part) if isinstance(node, dict) else None
                if node is None and not isinstance(node, (dict, list)):
                    missing.append(f"{profile.name}: {name}{'@' + item if item else ''} needs {key}")
    return missing


@pytest.mark.parametrize("profile", [ROOT / "params.yaml", *sorted((ROOT / "profiles").glob("*.yaml"))],
                         ids=lambda p: p.name)
def test_every_profile_has_every_params_key_the_stages_read(profile):
    assert missing_params(profile) == []


def test_the_check_catches_a_missing_and_a_stale_dep(tmp_path):
    """The check can fail both ways: a stage whose deps miss a module it imports, or list one it does not."""
    text = (ROOT / "dvc.yaml").read_text()
    head, distill_on = text.split("\n  distill:\n", 1)
    missing = f"{head}\n  distill:\n" + distill_on.replace("      - drelay/training/distill.py\n", "", 1)  # distill's own
    assert missing != text
    (tmp_path / "missing.yaml").write_text(missing)
    assert coverage_problems(tmp_path / "missing.yaml") == [
        "distill: imports drelay/training/distill.py, which its deps do not cover"]
    stale = text.replace("      - pipelines/prepare_target.py\n",
                         "      - pipelines/prepare_target.py\n      - drelay/eval/report.py\n", 1)
    (tmp_path / "stale.yaml").write_text(stale)
    assert coverage_problems(tmp_path / "stale.yaml") == [
        "prepare_target: depends on drelay/eval/report.py, which it never imports"]


@pytest.mark.parametrize("stage", ["train_dflash", "train", "evaluate"])
def test_training_and_evaluation_stages_follow_the_kernels_they_may_load(stage):
    """The Triton launchers are imported by name at run time: a stage that reaches the kernel choice depends
    on them too."""
    entry, deps = stage_commands()[stage]
    assert "drelay/kernels/relay_select.py" in closure(ROOT / entry)


# ---- which stages a params change re-runs, asked of DVC itself --------------------------------------
def _fake_outputs(repo: Path) -> None:
    """Every out of the default pipeline as a small file, so `dvc commit` can lock the stages without running them."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    joint_out = params["joint"]["common"]["out_dir"]
    files = ["models/target/config.json", "data/prepared/train.jsonl", "data/prepared/val.jsonl",
             "data/prepared/benchmarks/gsm8k.jsonl", "data/distilled/manifest.json", "models/drafter/config.json",
             "reports/train_dflash.png", "data/eval/cells.json", "reports/data_card.md", "reports/eval.md",
             "reports/eval_tau.png", "reports/eval_acceptance.png", "reports/eval_repair.png",
             "metrics/prepare_target.json", "metrics/prepare_data.json", "metrics/distill.json",
             "metrics/train_dflash.json", "metrics/eval.json", "serve/prompts/gsm8k.jsonl", "reports/serve.md",
             "metrics/serve.json", "data/eval/sample_taus.json", "metrics/register.json"]
    for method in params["joint"]["methods"]:
        files += [f"{joint_out}/{method}/drafter/config.json", f"reports/joint_{method}.png",
                  f"metrics/joint_{method}.json"]
    for rel in files:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("{}\n")


def _dvc(repo: Path, *args: str) -> None:
    """`dvc ARGS` in `repo`, in this process (dvc's own CLI entry point; a process of its own costs ~2 s of
    imports, and these tests call it a dozen times); a failure shows what it logged."""
    import contextlib
    import io
    import os

    from dvc.cli import main as dvc_main

    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    err = io.StringIO()
    with contextlib.chdir(repo), contextlib.redirect_stderr(err):
        code = dvc_main(list(args))
    assert code == 0, err.getvalue()


def _changed(repo: Path) -> set[str]:
    """The stages `dvc status` calls changed (its Python API: what `dvc status --json` prints, keyed by stage)."""
    import contextlib

    from dvc.repo import Repo

    with contextlib.chdir(repo), Repo(".") as dvc_repo:  # stage names relative to the cwd, as the CLI prints them
        return set(dvc_repo.status())


def _set(repo: Path, dotted: str, value) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    node = params
    *path, key = dotted.split(".")
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture
def locked_repo(tmp_path):
    """The repo's dvc.yaml, params.yaml and code in a fresh git + DVC repo, every stage locked on fake outs."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    for rel in ("dvc.yaml", "params.yaml", ".dvcignore", ".dvc/config"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, repo / rel)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _fake_outputs(repo)
    _dvc(repo, "commit", "-f", "-q")
    assert _changed(repo) == set()
    return repo


def test_one_methods_settings_rerun_only_its_stage_then_evaluate(locked_repo):
    repo = locked_repo
    _set(repo, "joint.domino.rank", 64)
    assert _changed(repo) == {"train@domino"}
    # its new output (as a re-run would write it) leaves evaluate out of date, and register, which files the
    # retrained domino with its evaluation in the model registry (it reads evaluate's results)
    (repo / "models/joint/domino/drafter/config.json").write_text('{"retrained": true}\n')
    _dvc(repo, "commit", "-f", "-q", "train@domino")
    assert _changed(repo) == {"evaluate", "register"}
    _dvc(repo, "commit", "-f", "-q", "evaluate", "register")
    _set(repo, "joint.drelay.lambda_repair", 0.5)
    assert _changed(repo) == {"train@drelay"}
    # a method SGLang serves (dflash, drelay) also re-runs serve_bench; domino above did not
    (repo / "models/joint/drelay/drafter/config.json").write_text('{"retrained": true}\n')
    _dvc(repo, "commit", "-f", "-q", "train@drelay")
    assert _changed(repo) == {"evaluate", "register", "serve_bench"}
    _dvc(repo, "commit", "-f", "-q", "evaluate", "register", "serve_bench")
    _set(repo, "registry.min_tau_gain", 0.01)  # the registry settings re-run only register
    assert _changed(repo) == {"register"}
    _dvc(repo, "commit", "-f", "-q", "register")
    _set(repo, "serve.concurrency", [1, 4])  # the serving settings re-run only serve_bench
    assert _changed(repo) == {"serve_bench"}
    _set(repo, "joint.common.extra_steps", 10)  # what every method shares re-runs every method
    assert _changed(repo) == {"serve_bench", *(f"train@{m}" for m in ("dflash", "drelay", "drelay-lite", "dflash2",
                                                                         "domino", "dspark"))}
