"""MLflow tracking for the stage flows: one run per stage execution, one experiment per profile.

Default store: `sqlite:///<repo>/mlflow.db` with artifacts in `<repo>/mlartifacts/<experiment>/`
(both git-ignored); MLFLOW_TRACKING_URI overrides it. Every profile logs into the same store, into
experiment `drelay-<run.profile>`, under the same metric names, so runs compare side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pipelines.common import REPO_ROOT, configure_environment, stage_clock

configure_environment()  # before mlflow is imported: it reads MLFLOW_DISABLE_TELEMETRY early

import mlflow  # noqa: E402
from mlflow.entities import Metric, Param, RunStatus  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from drelay.config import SECTIONS, flatten, to_dict  # noqa: E402
from drelay.io import json_digest  # noqa: E402


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO_ROOT / 'mlflow.db'}"


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment keeps its artifacts: `mlartifacts/<experiment>/` next to a sqlite db
    (so a test's tmp store keeps its files in tmp too); None lets a tracking server choose."""
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        return (db.parent / "mlartifacts" / experiment).as_uri()
    return None


def experiment_name(profile: str) -> str:
    return f"drelay-{profile}"


# Without this tag the MLflow UI opens an experiment on its generic "traces" overview, empty for us;
# with it, on the runs table where the stages' runs are.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


def _experiment_id(client: MlflowClient, name: str, location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=location, tags={KIND_TAG: KIND})
        except MlflowException:  # created meanwhile by another process
            experiment = client.get_experiment_by_name(name)
    if experiment.tags.get(KIND_TAG) != KIND:  # made before the tag was set
        client.set_experiment_tag(experiment.experiment_id, KIND_TAG, KIND)
    return experiment.experiment_id


def profile_experiment(client: MlflowClient, uri: str, profile: str) -> str:
    """The id of experiment `drelay-<profile>` in the store at `uri`, made (tagged, with its artifact place) if new."""
    name = experiment_name(profile)
    return _experiment_id(client, name, artifact_location(uri, name))


def pipeline_run_tag(params: Any, commit: str) -> str:
    """One reproduction's mark, the same on each of its stage runs: the commit and a digest of the whole
    params (not only the stage's sections), so `tags.pipeline_run = '...'` filters one reproduction."""
    return f"{commit[:12]}-{json_digest(to_dict(params), 12)}"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def _param_value(value: Any) -> str:
    # Lists (tuples in the dataclasses) as JSON, the rest as MLflow would print them.
    return json.dumps(list(value)) if isinstance(value, (tuple, list)) else str(value)


def stage_params(params: Any, sections: list[str]) -> dict[str, str]:
    """{"distill.batch_size": "16", ..., "run.profile": "default"} for the named sections."""
    flat = {"run.profile": params.run.profile}
    for name in sections:
        if name not in SECTIONS:
            raise ValueError(f"unknown params section {name!r} (valid: {', '.join(SECTIONS)})")
        flat.update(flatten(to_dict(getattr(params, name)), prefix=f"{name}."))
    return {key: _param_value(value) for key, value in flat.items()}


class Tracker:
    """Logs into one MLflow run (the stage's); what a stage flow gets from `stage_run`."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client, self.run_id = client, run_id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step or 0) for key, value in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's per-request limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, directory: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(directory), artifact_path)

    def log_figure(self, fig: Any, filename: str) -> None:
        """A matplotlib figure saved as `filename` (e.g. "plots/tau.png") among the artifacts."""
        self.client.log_figure(self.run_id, fig, filename)

    def log_dict(self, d: dict, filename: str) -> None:
        """A dict saved as JSON or YAML (by `filename`'s extension) among the artifacts."""
        self.client.log_dict(self.run_id, d, filename)


@contextmanager
def stage_run(stage: str, params: Any, sections: list[str]) -> Iterator[Tracker]:
    """An MLflow run named `stage` in experiment `drelay-<profile>`, logging the flattened params
    of `sections`; FINISHED on normal exit, FAILED (KILLED on Ctrl-C) if the block raises. The block
    is the stage's clock: `write_metrics` inside it records the stage's `wall_s`."""
    with stage_clock():
        with _mlflow_run(stage, params, sections) as tracker:
            yield tracker


@contextmanager
def _mlflow_run(stage: str, params: Any, sections: list[str]) -> Iterator[Tracker]:
    logged = stage_params(params, sections)  # a bad section name fails before any run exists
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)  # also for any fluent mlflow call a stage makes
    client = MlflowClient(tracking_uri=uri)
    experiment_id = profile_experiment(client, uri, params.run.profile)
    commit = git_commit()
    tags = {"stage": stage, "profile": params.run.profile, "git_commit": commit,
            "pipeline_run": pipeline_run_tag(params, commit), "workspace": os.getcwd()}
    run = client.create_run(experiment_id, run_name=stage, tags=tags)
    run_id = run.info.run_id
    try:
        batch = [Param(key, value) for key, value in logged.items()]
        for i in range(0, len(batch), 100):  # MLflow's per-request limit for params
            client.log_batch(run_id, params=batch[i:i + 100])
        yield Tracker(client, run_id)
    except BaseException as e:
        status = RunStatus.KILLED if isinstance(e, KeyboardInterrupt) else RunStatus.FAILED
        client.set_terminated(run_id, RunStatus.to_string(status))
        raise
    client.set_terminated(run_id, "FINISHED")
