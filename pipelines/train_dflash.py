"""train_dflash: the block drafter on the distilled data with the DFlash objective (random anchors,
position-decayed CE), early stopping on held-out loss, resumable checkpoints; at the end, live τ
with the engine on validation prompts. With run.nproc_per_node / run.nnodes > 1 it trains under torchrun
(DistributedDataParallel, the same global batch split over the processes)."""

from pipelines.common import apply_run_settings, configure_environment, stage_main, write_metrics

configure_environment()

from pathlib import Path  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from prefect import flow, task  # noqa: E402
from tqdm import tqdm  # noqa: E402

from drelay.config import load_params  # noqa: E402
from drelay.data.records import load_distilled, response_token_counts, split_sequences  # noqa: E402
from drelay.eval.live import live_compare  # noqa: E402
from drelay.io import read_jsonl  # noqa: E402
from drelay.models.drafter import BlockDrafter, draft_vocabulary  # noqa: E402
from drelay.models.methods import Speculator  # noqa: E402
from drelay.models.repair import Native  # noqa: E402
from drelay.models.target import Target  # noqa: E402
from drelay.training import distributed  # noqa: E402
from drelay.training.trainer import train_dflash  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

STAGE = "train_dflash"
PLOT = Path("reports/train_dflash.png")


def plot_history(history: list[dict], train_curve: list[tuple[int, float]], path: Path) -> plt.Figure:
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 3.6))
    if train_curve:
        ax_loss.plot(*zip(*train_curve), label="train", alpha=0.6)
    ax_loss.plot([h["step"] for h in history], [h["val_loss"] for h in history], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="weighted CE", title="DFlash loss")
    ax_loss.legend()
    ax_tau.plot([h["step"] for h in history], [h["replay_tau"] for h in history], "o-", label="replay τ (top-1)")
    ax_tau.plot([h["step"] for h in history], [h["oracle_tau"] for h in history], "s--", label="oracle top-k τ")
    ax_tau.set(xlabel="step", ylabel="τ", title="acceptance length (held-out)")
    ax_tau.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return fig


@task
def live_tau(target: Target, drafter: BlockDrafter, prompts: list[dict], max_new_tokens: int, pool_size: int) -> dict:
    """Live greedy τ, tokens/s and speedup against plain AR on the validation prompts (same process);
    a divergence from AR that is not a bf16 near-tie fails the stage."""
    ids = [target.encode_chat(record["messages"]) for record in prompts]
    result = live_compare(target, {"dflash": Speculator(drafter, Native())}, ids, max_new_tokens, pool_size,
                          desc="live τ")
    return result.get("dflash", {})


def load_inputs(params) -> tuple[Target, BlockDrafter, list, list]:
    """The target, a fresh drafter for it (fp32 master weights; matmuls run in bf16 autocast) and the
    distilled train / held-out split."""
    target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
    d = params.drafter
    train, val = split_sequences(load_distilled(params.distill.out_dir), params.train.val_fraction, params.run.seed)
    vocab_ids = None
    if d.draft_vocab:  # the training responses' most frequent ids (the stop tokens always), then by id
        vocab_ids = draft_vocabulary(response_token_counts(train, target.vocab_size),
                                     min(d.draft_vocab, target.vocab_size), target.stop_token_ids())
    drafter = BlockDrafter.for_target(target, vocab_ids=vocab_ids, num_layers=d.num_layers,
                                      block_size=d.block_size, num_context_layers=d.num_context_layers,
                                      num_heads=d.num_heads, num_kv_heads=d.num_kv_heads,
                                      intermediate_size=d.intermediate_size)
    return target, drafter.float(), train, val


def train_dflash_worker(params):
    """A torchrun rank other than 0: the same training, nothing tracked or written (rank 0 runs the flow)."""
    apply_run_settings(params)
    _, drafter, train, val = load_inputs(params)
    return train_dflash(drafter, train, val, params.train, pool_size=params.decode.pool_size, seed=params.run.seed)


@flow(name=STAGE)
def train_dflash_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Train the drafter into train.out_dir."""
    params = load_params(params_path, overrides)
    cfg = params.train
    apply_run_settings(params)
    with stage_run(STAGE, params, ["target", "drafter", "train"]) as tracker:
        target, drafter, train, val = load_inputs(params)
        d = params.drafter
        curve: list[tuple[int, float]] = []

        def log(metrics: dict, step: int) -> None:
            tracker.log_metrics(metrics, step=step)
            if "train_loss" in metrics:
                curve.append((step, metrics["train_loss"]))

        bar = tqdm(total=cfg.max_steps, desc="train_dflash", unit="step", dynamic_ncols=True)

        def progress(step: int, metrics: dict) -> None:
            bar.n = step
            bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")
            bar.refresh()

        result = train_dflash(drafter, train, val, cfg, pool_size=params.decode.pool_size,
                              seed=params.run.seed, log=log, progress=progress)
        bar.close()
        best = BlockDrafter.load(cfg.out_dir, target)  # bf16 like the target, as it will be served
        val_prompts = read_jsonl(f"{params.data.out_dir}/val.jsonl")[: cfg.live_prompts]
        live = live_tau(target, best, val_prompts, cfg.live_max_new_tokens, params.decode.pool_size)
        last = result.best
        metrics = {"steps": result.steps, "best_step": result.best_step, "best_val_loss": result.best_val_loss,
                   "stopped_early": int(result.stopped_early), "resumed_from_step": result.resumed_from,
                   "train_sequences": len(train), "val_sequences": len(val),
                   "train_blocks_per_s": result.blocks_per_s, "processes": distributed.world_size(),
                   "train_tokens_per_s": result.blocks_per_s * (d.block_size - 1),
                   "replay_tau": last["replay_tau"], "oracle_tau": last["oracle_tau"],
                   **{k: v for k, v in last.items() if k.startswith("val_t")}, **live}
        tracker.log_metrics({k: v for k, v in metrics.items() if k.startswith("live") or k == "ar_tokens_per_s"},
                            step=result.steps)
        fig = plot_history(result.history, curve, PLOT)
        tracker.log_figure(fig, "plots/train_dflash.png")
        tracker.log_artifacts(cfg.out_dir, "drafter")
        write_metrics(STAGE, metrics)
    return metrics


if __name__ == "__main__":
    stage_main(train_dflash_flow, worker=train_dflash_worker,
               process_group=lambda params: distributed.process_group(params.target.device))
