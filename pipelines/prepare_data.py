"""prepare_data: training prompts (with a held-out validation split) and the eight benchmark sets,
normalised to JSONL, from the mirror directory (data.mirror) or the HF hub."""

from pipelines.common import configure_environment, resolve_from_repo, stage_main, write_metrics

configure_environment()

from prefect import flow  # noqa: E402

from drelay.config import load_params  # noqa: E402
from drelay.data.prompts import prepare_prompts  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

STAGE = "prepare_data"


@flow(name=STAGE)
def prepare_data_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Write data.out_dir/{train,val}.jsonl and data.out_dir/benchmarks/<name>.jsonl."""
    params = load_params(params_path, overrides)
    with stage_run(STAGE, params, ["data"]) as tracker:
        counts = prepare_prompts(params.data, resolve_from_repo(params.data.mirror), params.data.out_dir,
                                 seed=params.run.seed)
        tracker.log_metrics(counts)
        write_metrics(STAGE, counts)
    return counts


if __name__ == "__main__":
    stage_main(prepare_data_flow)
