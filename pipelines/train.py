"""train@<method>: continue the trained DFlash drafter for joint.extra_steps with one method's objective
(`dflash`: its CE alone, the equal-budget baseline; `drelay`: backbone + global reader + causal
selector jointly), same data, same batches, same schedule (DESIGN §1.7). Logs every loss term and the
held-out replay statistics per block position to MLflow, chooses δ on held-out replay τ (drelay),
and measures live τ / speedup / the repair's share of a step on the validation prompts. With
run.nproc_per_node / run.nnodes > 1 it trains under torchrun (DistributedDataParallel).

    python -m pipelines.train --method drelay [--params P] [--set joint.common.extra_steps=50]
"""

from pipelines.common import apply_run_settings, configure_environment, stage_main, write_metrics

configure_environment()

from pathlib import Path  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from prefect import flow, task  # noqa: E402
from tqdm import tqdm  # noqa: E402

from drelay.config import JOINT_METHODS, load_params  # noqa: E402
from drelay.data.records import load_distilled, split_sequences  # noqa: E402
from drelay.eval.live import live_compare  # noqa: E402
from drelay.io import read_jsonl  # noqa: E402
from drelay.models.drafter import BlockDrafter, DrafterError  # noqa: E402
from drelay.models.methods import load_speculator  # noqa: E402
from drelay.models.target import Target  # noqa: E402
from drelay.training import distributed  # noqa: E402
from drelay.training.trainer import FitResult, train_method  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

PER_POSITION = ("accept", "pool_hit", "replace_rate", "repair_precision", "harm_rate")
LOSS_TERMS = ("loss", "ce", "support", "hinge", "reader_bce", "repair",  # drelay
              "selector", "final", "markov_ce", "conf_bce")  # dflash2, domino, dspark


def stage_name(method: str) -> str:
    return f"train@{method}"


def per_position(record: dict, name: str, prefix: str = "replay_") -> list[float]:
    values, i = [], 1
    while f"{prefix}{name}_pos{i}" in record:
        values.append(record[f"{prefix}{name}_pos{i}"])
        i += 1
    return values


def oracle_gap_closed(tau: float, native_tau: float, oracle_tau: float) -> float:
    """(τ - τ_native) / (τ_oracle - τ_native): the share of what a perfect repair would add (DESIGN §1.8)."""
    gap = oracle_tau - native_tau
    return (tau - native_tau) / gap if gap > 1e-9 else 0.0


def plot_joint(method: str, result: FitResult, curve: dict[str, list[tuple[int, float]]], path: Path) -> plt.Figure:
    """Loss terms, held-out τ over training, the final per-position statistics and (drelay) τ by δ."""
    final, history = result.final, result.history
    fig, axes = plt.subplots(1, 4 if result.tuned else 3, figsize=(18 if result.tuned else 14, 3.8))
    ax = axes[0]
    for name, points in curve.items():
        ax.plot(*zip(*points), label=name, alpha=0.8)
    ax.set(xlabel="extra step", ylabel="loss", title=f"{method}: training loss terms")
    ax.legend(fontsize=8)
    ax = axes[1]
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["replay_tau"] for h in history], "o-", label=f"{method}")
    ax.plot(steps, [h["native_tau"] for h in history], "s--", label="native top-1")
    ax.plot(steps, [h["oracle_tau"] for h in history], "^:", label="oracle (true token if in pool)")
    ax.set(xlabel="extra step", ylabel="τ", title="held-out replay τ")
    ax.legend(fontsize=8)
    ax = axes[2]
    for name in PER_POSITION:
        values = per_position(final, name)
        ax.plot(range(1, len(values) + 1), values, "o-", label=name)
    ax.set(xlabel="block position", ylabel="rate", ylim=(0, 1.02), title="held-out, per position (final)")
    ax.legend(fontsize=8)
    if result.tuned:
        ax = axes[3]
        deltas = sorted(result.tuned)
        ax.plot(deltas, [result.tuned[m] for m in deltas], "o-", label="relay τ")
        ax.axhline(final["native_tau"], ls="--", color="gray", label="native τ")
        chosen = result.method_metrics.get("repair_margin")
        if chosen is not None:
            ax.axvline(chosen, ls=":", color="k", label=f"chosen δ = {chosen:g}")
        ax.set(xlabel="δ (repair margin)", ylabel="held-out replay τ", title="choice of δ")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return fig


@task
def live_method_tau(target: Target, method: str, joint_dir: Path, prompts: list[dict], max_new_tokens: int,
                    pool_size: int) -> dict:
    """Live greedy decoding of the trained method (bf16, as served) against AR on the validation prompts."""
    spec = load_speculator(target, joint_dir, method)
    ids = [target.encode_chat(record["messages"]) for record in prompts]
    result = live_compare(target, {method: spec}, ids, max_new_tokens, pool_size, desc=f"live τ ({method})")
    return result.get(method, {})


def load_inputs(params) -> tuple[Target, BlockDrafter, list, list]:
    """The target, the train_dflash drafter (fp32 master weights, bf16 autocast) and the distilled split."""
    target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
    try:
        drafter = BlockDrafter.load(params.train.out_dir, target).float()
    except DrafterError as err:
        raise FileNotFoundError(f"{err} (the train_dflash stage makes it)") from err
    train, val = split_sequences(load_distilled(params.distill.out_dir), params.train.val_fraction, params.run.seed)
    return target, drafter, train, val


def train_worker(params, method: str):
    """A torchrun rank other than 0: the same joint training, nothing tracked or written."""
    apply_run_settings(params)
    _, drafter, train, val = load_inputs(params)
    return train_method(method, drafter, train, val, params.joint, params.train, pool_size=params.decode.pool_size,
                        seed=params.run.seed)


@flow(name="train")
def train_flow(params_path: str = "params.yaml", overrides: list[str] | None = None, method: str = "drelay") -> dict:
    """Joint training of one method from the train_dflash drafter into joint.out_dir/<method>."""
    params = load_params(params_path, overrides)
    cfg, train_cfg = params.joint, params.train
    apply_run_settings(params)
    stage = stage_name(method)
    with stage_run(stage, params, ["target", "drafter", "train", "joint"]) as tracker:
        tracker.client.set_tag(tracker.run_id, "method", method)
        target, drafter, train, val = load_inputs(params)
        curve: dict[str, list[tuple[int, float]]] = {}

        def log(metrics: dict, step: int) -> None:
            tracker.log_metrics(metrics, step=step)
            for name in LOSS_TERMS:
                if f"train_{name}" in metrics:
                    curve.setdefault(name, []).append((step, metrics[f"train_{name}"]))

        bar = tqdm(total=cfg.common.extra_steps, desc=stage, unit="step", dynamic_ncols=True)

        def progress(step: int, metrics: dict) -> None:
            bar.n = step
            bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")
            bar.refresh()

        result = train_method(method, drafter, train, val, cfg, train_cfg, pool_size=params.decode.pool_size,
                              seed=params.run.seed, log=log, progress=progress)
        bar.close()
        val_prompts = read_jsonl(f"{params.data.out_dir}/val.jsonl")[: train_cfg.live_prompts]
        live = live_method_tau(target, method, Path(cfg.common.out_dir), val_prompts, train_cfg.live_max_new_tokens,
                               params.decode.pool_size)
        final = result.final
        metrics = {
            "steps": result.steps, "resumed_from_step": result.resumed_from,
            "train_sequences": len(train), "val_sequences": len(val), "train_blocks_per_s": result.blocks_per_s,
            "processes": distributed.world_size(),
            "replay_tau": final["replay_tau"], "native_tau": final["native_tau"], "oracle_tau": final["oracle_tau"],
            "start_native_tau": result.history[0]["native_tau"],
            "oracle_gap_closed": oracle_gap_closed(final["replay_tau"], final["native_tau"], final["oracle_tau"]),
            **{k: v for k, v in final.items() if k.startswith(("val_", "replay_"))},
            **live,
        }
        metrics.update(result.method_metrics)  # e.g. drelay's repair margin δ
        if result.tuned:
            metrics["tune_taus"] = {f"{m:g}": tau for m, tau in result.tuned.items()}
        tracker.log_metrics({k: v for k, v in metrics.items() if k.startswith("live") or k.endswith("_closed")
                             or k == "ar_tokens_per_s"}, step=result.steps)
        fig = plot_joint(method, result, curve, Path(f"reports/joint_{method}.png"))
        tracker.log_figure(fig, f"plots/joint_{method}.png")
        tracker.log_dict({"history": result.history, "tuned": {str(k): v for k, v in result.tuned.items()}},
                         "history.json")
        tracker.log_artifacts(Path(cfg.common.out_dir) / method, method)
        write_metrics(f"joint_{method}", metrics)
    return metrics


def require_inputs(params, method: str) -> None:
    """The trained drafter and the distilled data this stage starts from, checked before Prefect starts."""
    needed = {Path(params.train.out_dir) / "config.json": "the train_dflash stage makes it",
              Path(params.distill.out_dir) / "manifest.json": "the distill stage makes it"}
    for path, maker in needed.items():
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing ({maker}): needed by {stage_name(method)}")


if __name__ == "__main__":
    stage_main(train_flow, options={"method": dict(required=True, choices=JOINT_METHODS,
                                                   help="the head to train (joint.methods lists the stages)")},
               precheck=require_inputs, worker=train_worker,
               process_group=lambda params: distributed.process_group(params.target.device))
