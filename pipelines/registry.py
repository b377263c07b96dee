"""The MLflow model registry and the promotion gate of scheduled retraining.

Every reproduction's `register` stage (pipelines/register.py) registers each trained method as a version of
the registered model `<registry.model_prefix>-<run.profile>-<method>`: its folder (drafter + relay/head) as
the version's artifacts, its evaluation (mean τ and live speedup at each temperature, per-sample τ in
`eval_samples.json`) and where it came from (git commit, pipeline_run = commit + params digest, model
fingerprint) as tags. The same models evaluated the same way are not registered twice.

The gate (`promote`, run by the scheduled retrain flow after the pipeline succeeded) compares the new version
of `registry.champion_method` with the one holding the alias `registry.alias` ("champion") on the same
evaluation: per-sample τ at `registry.temperature`, paired over samples with a bootstrap interval (the
champion is re-replayed on the new evaluation's continuations when the two evaluations differ), and mean
live speedup. It moves the alias only when the interval of (new - champion) mean τ lies above
`registry.min_tau_gain` and the new speedup is at least the champion's x (1 - `registry.speedup_tolerance`);
otherwise it keeps the champion. Either way the version gets `gate.*` tags saying why.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipelines.common import configure_environment

configure_environment()

from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from drelay.config import temperature_key  # noqa: E402
from drelay.eval.paired import MEAN, paired_bootstrap  # noqa: E402
from drelay.io import json_digest  # noqa: E402

BUNDLE_PATH = "model"  # the version's artifacts: <run>/model/<method>/ (drafter/ + relay/ or head/)
SAMPLES_FILE = "eval_samples.json"  # {T: {"taus": {bench: [τ]}, "stamps": {bench: digest}}}
BUNDLE_INFO = "drelay_bundle.json"  # inside the bundle: which method, from which reproduction


class RegistryError(RuntimeError):
    """A registry state the gate cannot work with (no registered version, a version without its evaluation)."""


def model_name(params: Any, method: str) -> str:
    return f"{params.registry.model_prefix}-{params.run.profile}-{method}"


# ---- registration --------------------------------------------------------------------------------


def _ensure_model(client: MlflowClient, name: str, method: str, profile: str) -> None:
    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, tags={"method": method, "profile": profile}, description=(
                f"DRelay {method} drafter (+ its repair head) trained by the {profile} profile's train@{method} "
                f"stage. Alias 'champion': the version the promotion gate last accepted."))
        except MlflowException:  # made meanwhile by another process
            pass


def _same_version(client: MlflowClient, name: str, fingerprint: str, eval_digest: str):
    """An existing version of `name` with the same model and evaluation (None if there is none)."""
    for version in client.search_model_versions(f"name = '{name}'"):
        tags = version.tags or {}
        if tags.get("model_fingerprint") == fingerprint and tags.get("eval_digest") == eval_digest:
            return version
    return None


def version_tags(method: str, tables: dict, temperatures: list[str]) -> dict[str, str]:
    """The evaluation's headline numbers for one method, as version tags (shown in the registry UI)."""
    tags = {}
    for t in temperatures:
        row = tables.get(t, {}).get("mean", {}).get(method, {})
        for metric in ("tau", "speedup", "oracle_gap_closed"):
            if isinstance(row.get(metric), (int, float)):
                tags[f"{t}.{metric}"] = f"{row[metric]:.4f}"
    return tags


def register_methods(client: MlflowClient, run_id: str, params: Any, joint_dir: Path, eval_metrics: dict,
                     samples: dict, *, commit: str, pipeline_run: str, fingerprints: dict[str, str]) -> dict:
    """Register every trained method of `params.joint.methods` (see the module docstring); returns
    {method: {"name", "version", "new"}}. `samples` is evaluate's sample_taus.json ({"taus": {T: {method:
    {bench: [τ]}}}, "stamps": {T: {bench: digest}}}); `fingerprints` each method folder's hash."""
    temperatures = [t for t in eval_metrics if t.startswith("T")]
    out = {}
    for method in params.joint.methods:
        name = model_name(params, method)
        per_t = {t: {"taus": samples["taus"].get(t, {}).get(method, {}), "stamps": samples["stamps"].get(t, {})}
                 for t in temperatures}
        if not any(v["taus"] for v in per_t.values()):
            raise RegistryError(f"the evaluation has no per-sample τ for {method}: is it in eval.methods?")
        eval_digest = json_digest(per_t)
        _ensure_model(client, name, method, params.run.profile)
        existing = _same_version(client, name, fingerprints[method], eval_digest)
        if existing is not None:
            out[method] = {"name": name, "version": int(existing.version), "new": False}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            bundle = Path(tmp) / method
            shutil.copytree(joint_dir / method, bundle)
            (bundle / BUNDLE_INFO).write_text(json.dumps({"method": method, "profile": params.run.profile,
                                                          "git_commit": commit, "pipeline_run": pipeline_run,
                                                          "model_fingerprint": fingerprints[method]}, indent=2))
            (Path(tmp) / SAMPLES_FILE).write_text(json.dumps(per_t))
            client.log_artifacts(run_id, str(bundle), f"{BUNDLE_PATH}/{method}")
            client.log_artifact(run_id, str(Path(tmp) / SAMPLES_FILE), f"evaluation/{method}")
        tags = {"method": method, "git_commit": commit, "pipeline_run": pipeline_run,
                "model_fingerprint": fingerprints[method], "eval_digest": eval_digest,
                **version_tags(method, eval_metrics, temperatures)}
        version = client.create_model_version(name, f"runs:/{run_id}/{BUNDLE_PATH}/{method}", run_id=run_id, tags=tags,
                                              description=f"pipeline_run {pipeline_run}")
        out[method] = {"name": name, "version": int(version.version), "new": True}
    return out


# ---- the gate ------------------------------------------------------------------------------------


@dataclass
class Decision:
    """What the gate decided, and why (logged as tags on the challenger and in the run summary)."""

    model: str
    challenger: int | None
    champion_before: int | None
    champion_after: int | None
    promoted: bool
    reason: str
    tau_diff: float | None = None
    tau_low: float | None = None
    tau_high: float | None = None
    speedup_challenger: float | None = None
    speedup_champion: float | None = None
    reevaluated: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def _champion(client: MlflowClient, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def version_samples(client: MlflowClient, version) -> dict:
    """The per-sample τ a version was registered with ({T: {"taus", "stamps"}})."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(version.run_id, f"evaluation/{version.tags['method']}/{SAMPLES_FILE}", tmp)
        except (MlflowException, OSError, KeyError) as err:
            raise RegistryError(f"{version.name} v{version.version} has no {SAMPLES_FILE} ({err})") from err
        return json.loads(Path(path).read_text())


def download_bundle(client: MlflowClient, version, dst: Path) -> Path:
    """A version's method folder (drafter/ + relay/ or head/) under `dst`."""
    method = version.tags["method"]
    return Path(client.download_artifacts(version.run_id, f"{BUNDLE_PATH}/{method}", str(dst)))


def _speedup(version, tkey: str) -> float | None:
    value = (version.tags or {}).get(f"{tkey}.speedup")
    return float(value) if value is not None else None


def decide(challenger_taus: dict[str, list[float]], champion_taus: dict[str, list[float]],
           speedup_challenger: float | None, speedup_champion: float | None, cfg,
           seed: int = 0) -> tuple[bool, str, Any]:
    """The rule on two methods' per-sample τ on the same samples: (promote, reason, the paired mean)."""
    paired = paired_bootstrap(challenger_taus, champion_taus, seed=seed)[MEAN]
    interval = f"mean τ {paired.diff:+.4f} [{paired.low:+.4f}, {paired.high:+.4f}] over {paired.n} samples"
    if paired.low <= cfg.min_tau_gain:
        return False, f"not better: new - champion {interval}, interval not above {cfg.min_tau_gain:g}", paired
    if speedup_challenger is not None and speedup_champion is not None and \
            speedup_challenger < speedup_champion * (1 - cfg.speedup_tolerance):
        return False, (f"τ better ({interval}) but live speedup {speedup_challenger:.3f} < champion's "
                       f"{speedup_champion:.3f} x (1 - {cfg.speedup_tolerance:g})"), paired
    speed = "" if speedup_challenger is None or speedup_champion is None else \
        f"; live speedup {speedup_challenger:.3f} vs {speedup_champion:.3f}"
    return True, f"better: new - champion {interval}{speed}", paired


def promote(client: MlflowClient, params: Any, registered: dict, reevaluate=None) -> Decision:
    """The promotion gate for `registry.champion_method` (see the module docstring). `registered` is the
    register stage's {method: {"name", "version"}}; `reevaluate(bundle_dir) -> ({bench: [τ]}, {bench: stamp})`
    replays a downloaded champion on this evaluation when the two evaluations differ (None: such a champion
    is kept, with the reason)."""
    cfg = params.registry
    method = cfg.champion_method
    if method not in registered:
        raise RegistryError(f"the register stage registered no {method} (registry.champion_method); "
                            f"registered: {', '.join(registered) or 'nothing'}")
    name, number = registered[method]["name"], int(registered[method]["version"])
    challenger = client.get_model_version(name, str(number))
    champion = _champion(client, name, cfg.alias)
    tkey = temperature_key(cfg.temperature)
    decision = Decision(model=name, challenger=number, champion_before=champion and int(champion.version),
                        champion_after=champion and int(champion.version), promoted=False, reason="",
                        speedup_challenger=_speedup(challenger, tkey),
                        speedup_champion=champion and _speedup(champion, tkey))
    if champion is None:
        decision.promoted, decision.reason = True, f"no {cfg.alias} yet: the first registered version becomes it"
    elif int(champion.version) == number:
        decision.reason = f"v{number} already holds {cfg.alias} (the same models, evaluated the same way)"
    else:
        new = version_samples(client, challenger).get(tkey)
        old = version_samples(client, champion).get(tkey)
        if not new or not new["taus"]:
            raise RegistryError(f"{name} v{number} has no per-sample τ at {tkey} (registry.temperature)")
        old_taus = old["taus"] if old and old["stamps"] == new["stamps"] else None
        if old_taus is None and reevaluate is not None:
            with tempfile.TemporaryDirectory() as tmp:
                old_taus, stamps = reevaluate(download_bundle(client, champion, Path(tmp)))
            if stamps != new["stamps"]:
                raise RegistryError(f"re-replaying the {cfg.alias} gave a different evaluation than v{number}'s")
            decision.reevaluated = True
        if old_taus is None:
            decision.reason = (f"v{champion.version} ({cfg.alias}) was evaluated differently and cannot be re-replayed "
                               f"here: kept")
        else:
            decision.promoted, decision.reason, paired = decide(new["taus"], old_taus, decision.speedup_challenger,
                                                                decision.speedup_champion, cfg, seed=params.run.seed)
            decision.tau_diff, decision.tau_low, decision.tau_high = paired.diff, paired.low, paired.high
    if decision.promoted:
        client.set_registered_model_alias(name, cfg.alias, str(number))
        decision.champion_after = number
    for key, value in (("gate.decision", "promoted" if decision.promoted else "kept"), ("gate.reason", decision.reason),
                       ("gate.champion_before", str(decision.champion_before))):
        client.set_model_version_tag(name, str(number), key, value)
    return decision
