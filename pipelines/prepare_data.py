"""prepare_data: training prompts (with a held-out validation split) and the eight benchmark sets,
normalised to JSONL, from the mirror directory (data.mirror) or the HF hub; the prompts the target
writes itself when data.writer asks for some; the data card (metrics/prepare_data.json,
reports/data_card.md)."""

from pipelines.common import apply_run_settings, configure_environment, resolve_from_repo, stage_main, write_metrics

configure_environment()

import time  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow  # noqa: E402

from drelay.config import load_params  # noqa: E402
from drelay.data.prompts import WrittenPrompts, prepare_prompts  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

STAGE = "prepare_data"
REPORT = Path("reports/data_card.md")


def _writer(params):
    """The call that has the target write data.writer's prompts (None when it asks for none); the target is
    loaded only then, after the mirror was read."""
    cfg = params.data.writer
    if not cfg.total:
        return None

    def write() -> WrittenPrompts:
        from drelay.models.target import Target
        from drelay.training.write_prompts import write_prompts

        apply_run_settings(params)
        target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
        return write_prompts(target, cfg.prompts.counts(), temperature=cfg.temperature,
                             max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, seed=params.run.seed)

    return write


@flow(name=STAGE)
def prepare_data_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Write data.out_dir/{train,val}.jsonl, data.out_dir/benchmarks/<name>.jsonl and the data card."""
    params = load_params(params_path, overrides)
    sections = ["data", "target"] if params.data.writer.total else ["data"]
    with stage_run(STAGE, params, sections) as tracker:
        t0 = time.perf_counter()
        card = prepare_prompts(params.data, resolve_from_repo(params.data.mirror), params.data.out_dir,
                               seed=params.run.seed, write=_writer(params))
        metrics = {**card.metrics(), "wall_s": time.perf_counter() - t0}
        tracker.log_metrics(metrics)
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(card.markdown())
        tracker.log_artifact(REPORT)
        write_metrics(STAGE, metrics)
    return metrics


if __name__ == "__main__":
    stage_main(prepare_data_flow)
