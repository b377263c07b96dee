"""evaluate: the eight benchmarks x methods (ar, the trained train@ methods, oracle) x temperatures.

τ and the repair statistics by replay along one target continuation per prompt (many samples);
speedup, tokens/s and the identical-to-AR check by live decoding of a few prompts, AR in the same
process (drelay/eval/run.py says why replay is exact at T=0 and unbiased at T>0). Writes
metrics/eval.json ({T: {benchmark: {method: {metric: value}}}} with a `mean` row), reports/eval.md,
reports/eval_{tau,acceptance,repair}.png, and logs all of it to MLflow (metric `<T>/<benchmark>/<method>/<metric>`).
Finished cells are kept under eval.out_dir: a killed run continues where it stopped. eval.out_dir/sample_taus.json
holds every method's per-sample replay τ (what the register stage attaches to each model version).

    python -m pipelines.evaluate [--params P] [--set eval.live_max_new_tokens=64]
"""

from pipelines.common import apply_run_settings, configure_environment, stage_main, write_json_atomic, write_metrics

configure_environment()

import time  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow  # noqa: E402
from tqdm import tqdm  # noqa: E402

from drelay.config import ConfigError, load_params  # noqa: E402
from drelay.eval.report import markdown, plot_acceptance, plot_repair, plot_tau  # noqa: E402
from drelay.eval.run import AR, load_methods, nonfinite, run_grid  # noqa: E402
from drelay.models import cpu_linear  # noqa: E402
from drelay.models.methods import method_class  # noqa: E402
from drelay.models.target import Target  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

REPORT = Path("reports/eval.md")
PLOTS = {"tau": Path("reports/eval_tau.png"), "acceptance": Path("reports/eval_acceptance.png"),
         "repair": Path("reports/eval_repair.png")}


def trained_methods(params) -> list[str]:
    """The eval methods that need a train@ stage's output (the oracle needs its drafter's)."""
    names = {m for m in params.eval.methods if m != AR and method_class(m).trainable}
    if any(m != AR and not method_class(m).trainable for m in params.eval.methods):  # the oracle
        names.add(params.eval.oracle_drafter)
    return sorted(names)


@flow(name="evaluate")
def evaluate_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Benchmarks x methods x temperatures: replay τ + repair statistics, live speedup, report and plots."""
    params = load_params(params_path, overrides)
    cfg = params.eval
    apply_run_settings(params)
    start = time.perf_counter()
    with stage_run("evaluate", params, ["target", "decode", "eval"]) as tracker:
        target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
        methods = load_methods(target, params.joint.common.out_dir, cfg.methods, cfg.oracle_drafter)
        bar = tqdm(desc="evaluate", unit="cell", dynamic_ncols=True)

        def on_cell(done: int, total: int, what: str) -> None:
            bar.total = total
            bar.n = done
            bar.set_postfix_str(what)
            bar.refresh()

        result = run_grid(target, methods, cfg, benchmarks_dir=Path(params.data.out_dir) / "benchmarks",
                          pool_size=params.decode.pool_size, sampling_rule=params.decode.sampling_rule,
                          max_prompt_tokens=params.distill.max_prompt_tokens, seed=params.run.seed,
                          precision=params.train.precision, log=bar.write, on_cell=on_cell,
                          verify_size=params.decode.verify_size)
        bar.close()
        bad = nonfinite(result.tables)
        if bad:
            raise RuntimeError(f"non-finite evaluation numbers: {', '.join(bad[:10])}")
        # per-sample τ and the evaluation's stamps: what the register stage gives each model version, so the
        # promotion gate can compare two versions sample by sample (pipelines/registry.py)
        write_json_atomic(cfg.sample_taus_path, {"taus": result.sample_taus, "stamps": result.stamps})
        any_method = next(iter(methods.values()), None)
        info = {"target": params.target.path, "dtype": params.target.dtype, "device": str(target.device),
                "pool_size": params.decode.pool_size, "sampling_rule": params.decode.sampling_rule,
                "verify_size": params.decode.verify_size,
                "block_size": any_method.drafter.config.block_size if any_method else "?",
                "oracle_drafter": cfg.oracle_drafter, "live_max_new_tokens": cfg.live_max_new_tokens,
                "plots": [str(p) for p in PLOTS.values()],
                "benchmarks": {b: {"samples": cfg.per_benchmark("samples", b),
                                   "sequences": result.sequences[next(iter(result.sequences))].get(b, 0),
                                   "live_samples": cfg.per_benchmark("live_samples", b),
                                   "max_new_tokens": cfg.per_benchmark("max_new_tokens", b)}
                               for b in cfg.benchmarks}}
        figures = {"tau": plot_tau(result, PLOTS["tau"]), "acceptance": plot_acceptance(result, PLOTS["acceptance"]),
                   "repair": plot_repair(result, PLOTS["repair"])}
        for name, fig in figures.items():
            tracker.log_figure(fig, f"plots/eval_{name}.png")
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(markdown(result, info))
        tracker.log_artifact(REPORT)
        tracker.log_dict({"tables": result.tables, "live_records": result.live_records}, "eval_full.json")
        tracker.log_metrics({f"{t}/{b}/{m}/{k}": v for t, rows in result.tables.items() for b, cells in rows.items()
                             for m, metrics in cells.items() for k, v in metrics.items()})
        metrics = {**result.tables, "cells_computed": result.computed, "cells_reused": result.reused,
                   **{f"{phase}_s": seconds for phase, seconds in result.seconds.items()},
                   "paired": {t: {other: {b: p.as_dict() for b, p in rows.items()} for other, rows in per.items()}
                              for t, per in result.paired.items()},
                   "wall_s": time.perf_counter() - start}
        if cpu_linear.measured_orders():  # the live cells' few-row product orders, as measured in this process
            metrics["few_row_orders"] = cpu_linear.measured_orders()
        tracker.log_metrics({k: metrics[k] for k in ("cells_computed", "cells_reused", "wall_s",
                                                      *(f"{phase}_s" for phase in result.seconds))})
        write_metrics("eval", metrics)
    return metrics


def require_inputs(params) -> None:
    """Each evaluated method's train@ output, and consistent method lists, checked before Prefect starts."""
    missing_stage = [m for m in trained_methods(params) if m not in params.joint.methods]
    if missing_stage:
        raise ConfigError(f"eval.methods needs {', '.join(missing_stage)}, which joint.methods does not train "
                          f"(joint.methods: {', '.join(params.joint.methods)}; the oracle uses eval.oracle_drafter)")
    for method in trained_methods(params):
        path = Path(params.joint.common.out_dir) / method / "drafter" / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (the train@{method} stage makes it): needed by evaluate")
    if not Path(params.target.path, "config.json").is_file():
        raise FileNotFoundError(f"{params.target.path}/config.json is missing (the prepare_target stage makes it)")
    benchmarks = Path(params.data.out_dir) / "benchmarks"
    for name in params.eval.benchmarks:
        if not (benchmarks / f"{name}.jsonl").is_file():
            raise FileNotFoundError(f"{benchmarks / name}.jsonl is missing (the prepare_data stage writes it): "
                                    f"needed by evaluate")


if __name__ == "__main__":
    stage_main(evaluate_flow, precheck=require_inputs)
