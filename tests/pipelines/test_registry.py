"""The model registry and the promotion gate (pipelines/registry.py) on a real MLflow sqlite store with real
model folders: registration with tags and artifacts, idempotence, the gate promoting a better challenger and
keeping the champion against a worse or slower one, re-replaying a champion evaluated differently, and
`drelay generate --model models:/NAME@champion` decoding with what the alias points at.
The scheduled retrain flow running it after a real smoke reproduction is in test_dvc_pipeline.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drelay.cli import main as drelay_main
from drelay.config import load_params
from drelay.io import folder_fingerprint
from pipelines.common import REPO_ROOT
from tests.pipelines.conftest import seeded_mlflow_uri

BENCHES = ("gsm8k", "mbpp")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A smoke-profile joint dir (dflash, drelay) with real tiny models, and their params."""
    from drelay.models.drafter import BlockDrafter
    from drelay.models.methods import create_method, save_method
    from drelay.models.target import Target, make_tiny_random_target

    root = tmp_path_factory.mktemp("registry")
    params = load_params(REPO_ROOT / "profiles" / "smoke.yaml", ["joint.methods=[dflash, drelay]"])
    target_dir = make_tiny_random_target(root / "target")
    target = Target.load(target_dir, dtype="float32")
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=params.drafter.block_size,
                                      num_context_layers=params.drafter.num_context_layers)
    for method in params.joint.methods:
        drafter.save(root / "joint" / method / "drafter")
    save_method(create_method("drelay", drafter, params.joint.settings("drelay"), params.decode.pool_size, seed=0),
                root / "joint" / "drelay")
    return params, root, target_dir


@pytest.fixture
def client(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = seeded_mlflow_uri(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(uri)


def _register(client, params, root: Path, taus: dict[str, list[float]], speedup: float = 1.2, stamp: str = "s1",
              fingerprint_salt: str = "") -> dict:
    """One register stage's work: a run in the profile's experiment, every method registered."""
    from pipelines.registry import register_methods
    from pipelines.tracking import stage_run

    tables = {"T0": {"mean": {m: {"tau": sum(map(sum, taus.values())) / sum(map(len, taus.values())),
                                  "speedup": speedup} for m in params.joint.methods}}}
    samples = {"taus": {"T0": {m: taus for m in params.joint.methods}}, "stamps": {"T0": {b: stamp for b in taus}}}
    with stage_run("register", params, ["registry"]) as tracker:
        return register_methods(tracker.client, tracker.run_id, params, root / "joint", tables, samples,
                                commit="abc123", pipeline_run=f"abc123-{stamp}{fingerprint_salt}",
                                fingerprints={m: folder_fingerprint(root / "joint" / m) + fingerprint_salt
                                              for m in params.joint.methods})


def _taus(shift: float = 0.0) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(0)
    return {b: (1.5 + torch.rand(12, generator=gen) + shift).tolist() for b in BENCHES}


def test_register_tags_artifacts_and_no_duplicates(workspace, client):
    from pipelines.registry import BUNDLE_INFO, download_bundle, version_samples

    params, root, _ = workspace
    first = _register(client, params, root, _taus())
    assert {m: (v["name"], v["version"], v["new"]) for m, v in first.items()} == {
        "dflash": ("drelay-smoke-dflash", 1, True), "drelay": ("drelay-smoke-drelay", 1, True)}
    version = client.get_model_version("drelay-smoke-drelay", "1")
    assert {"method": "drelay", "git_commit": "abc123", "pipeline_run": "abc123-s1"}.items() <= version.tags.items()
    assert float(version.tags["T0.tau"]) == pytest.approx(2.0, abs=0.3) and version.tags["T0.speedup"] == "1.2000"
    assert version_samples(client, version)["T0"]["taus"] == _taus()
    bundle = download_bundle(client, version, root / "dl")
    assert (bundle / "drafter" / "model.safetensors").is_file() and (bundle / "relay" / "config.json").is_file()
    assert json.loads((bundle / BUNDLE_INFO).read_text())["method"] == "drelay"
    again = _register(client, params, root, _taus())  # the same models evaluated the same way
    assert {m: (v["version"], v["new"]) for m, v in again.items()} == {"dflash": (1, False), "drelay": (1, False)}


def test_gate_promotes_only_a_better_challenger(workspace, client):
    from pipelines.registry import promote

    params, root, _ = workspace
    first = promote(client, params, _register(client, params, root, _taus()))
    assert first.promoted and first.champion_before is None and "no champion yet" in first.reason
    assert int(client.get_model_version_by_alias("drelay-smoke-drelay", "champion").version) == 1
    same = promote(client, params, _register(client, params, root, _taus()))
    assert not same.promoted and "already holds champion" in same.reason

    better = promote(client, params, _register(client, params, root, _taus(0.3), fingerprint_salt="b"))
    assert better.promoted and (better.challenger, better.champion_before, better.champion_after) == (2, 1, 2)
    assert better.tau_diff == pytest.approx(0.3) and better.tau_low > 0 and better.reason.startswith("better")
    assert client.get_model_version("drelay-smoke-drelay", "2").tags["gate.decision"] == "promoted"

    worse = promote(client, params, _register(client, params, root, _taus(0.2), fingerprint_salt="w"))
    assert not worse.promoted and worse.champion_after == 2 and worse.tau_diff == pytest.approx(-0.1)
    assert worse.reason.startswith("not better")
    tags = client.get_model_version("drelay-smoke-drelay", "3").tags
    assert tags["gate.decision"] == "kept" and tags["gate.reason"] == worse.reason

    slower = promote(client, params, _register(client, params, root, _taus(0.5), speedup=0.9, fingerprint_salt="s"))
    assert not slower.promoted and "live speedup 0.900 < champion's 1.200" in slower.reason
    assert int(client.get_model_version_by_alias("drelay-smoke-drelay", "champion").version) == 2


def test_a_champion_evaluated_differently_is_re_replayed(workspace, client):
    from pipelines.registry import RegistryError, promote

    params, root, _ = workspace
    promote(client, params, _register(client, params, root, _taus(), stamp="old"))
    new = _register(client, params, root, _taus(0.2), stamp="new", fingerprint_salt="n")
    kept = promote(client, params, new)  # nothing can re-replay it: kept, and why
    assert not kept.promoted and "evaluated differently" in kept.reason
    seen = []

    def reevaluate(bundle: Path):
        seen.append(sorted(p.name for p in bundle.iterdir()))
        return _taus(), {b: "new" for b in BENCHES}  # the champion's τ on the new evaluation

    decision = promote(client, params, new, reevaluate=reevaluate)
    assert seen == [["drafter", "drelay_bundle.json", "relay"]]
    assert decision.promoted and decision.reevaluated and decision.tau_diff == pytest.approx(0.2)
    with pytest.raises(RegistryError, match="different evaluation"):
        promote(client, params, _register(client, params, root, _taus(0.4), stamp="x", fingerprint_salt="x"),
                reevaluate=lambda bundle: (_taus(), {b: "other" for b in BENCHES}))


def test_generate_loads_the_champion(workspace, client, capsys):
    from pipelines.registry import promote

    params, root, target_dir = workspace
    promote(client, params, _register(client, params, root, _taus()))
    rc = drelay_main(["generate", "--target", str(target_dir), "--model", "models:/drelay-smoke-drelay@champion",
                      "--prompt", "Write a haiku about rain.", "--max-new-tokens", "12", "--ignore-eos",
                      "--pool-size", "4",
                      "--check-lossless"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert '"method": "drelay"' in captured.out and "identical: 12 tokens match AR" in captured.out
    assert "models:/drelay-smoke-drelay@champion: drelay from pipeline_run abc123-s1" in captured.err
    assert drelay_main(["generate", "--target", str(target_dir), "--model", "models:/drelay-smoke-drelay@nobody",
                        "--prompt", "hi"]) == 2
    assert "cannot load models:/drelay-smoke-drelay@nobody" in capsys.readouterr().err
    assert drelay_main(["generate", "--target", str(target_dir), "--prompt", "hi"]) == 2
    assert "give --drafter DIR (or --model" in capsys.readouterr().err
