"""register: each trained method's drafter (+ relay or head) as a version of the MLflow registered model
`<registry.model_prefix>-<run.profile>-<method>`, with its evaluation (pipelines/registry.py). The promotion
gate (the `champion` alias) is not moved here: the scheduled retrain flow runs it after a whole reproduction
(pipelines/schedule.py), or by hand `python -m pipelines.promote`.

    python -m pipelines.register [--params P]
"""

from pipelines.common import configure_environment, stage_main, write_metrics

configure_environment()

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow, get_run_logger  # noqa: E402

from drelay.config import load_params  # noqa: E402
from drelay.io import folder_fingerprint  # noqa: E402
from pipelines.registry import register_methods  # noqa: E402
from pipelines.tracking import git_commit, pipeline_run_tag, stage_run  # noqa: E402

STAGE = "register"
EVAL_METRICS = Path("metrics/eval.json")


@flow(name=STAGE)
def register_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Register every trained method's models with their evaluation in the MLflow model registry."""
    params = load_params(params_path, overrides)
    logger = get_run_logger()
    with stage_run(STAGE, params, ["registry"]) as tracker:
        joint = Path(params.joint.common.out_dir)
        commit = git_commit()
        registered = register_methods(
            tracker.client, tracker.run_id, params, joint, json.loads(EVAL_METRICS.read_text()),
            json.loads(params.eval.sample_taus_path.read_text()), commit=commit,
            pipeline_run=pipeline_run_tag(params, commit),
            fingerprints={m: folder_fingerprint(joint / m) for m in params.joint.methods})
        for method, info in registered.items():
            logger.info(f"{info['name']} v{info['version']}" + ("" if info["new"] else " (already registered)"))
        tracker.log_metrics({f"{m}.version": info["version"] for m, info in registered.items()})
        write_metrics(STAGE, {"models": registered})
    return registered


def require_inputs(params) -> None:
    for path in (EVAL_METRICS, params.eval.sample_taus_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (the evaluate stage writes it): needed by register")
    for method in params.joint.methods:
        path = Path(params.joint.common.out_dir) / method / "drafter" / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (the train@{method} stage makes it): needed by register")


if __name__ == "__main__":
    stage_main(register_flow, precheck=require_inputs)
