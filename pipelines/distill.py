"""distill: the target regenerates responses to the training prompts (chat template, batched,
greedy by default) and the context-layer features captured during that same generation are stored
with the tokens, in shards. An interrupted run resumes from the last complete shard. With
run.nproc_per_node / run.nnodes > 1 it runs under torchrun, each process making its share of the shards."""

from pipelines.common import configure_environment, stage_main, write_metrics

configure_environment()

import time  # noqa: E402

import torch  # noqa: E402
from prefect import flow  # noqa: E402
from tqdm import tqdm  # noqa: E402

from drelay.config import load_params  # noqa: E402
from drelay.data.datacard import response_tokens_by_group  # noqa: E402
from drelay.io import read_jsonl  # noqa: E402
from drelay.models.target import Target, context_layer_ids  # noqa: E402
from drelay.training import distributed  # noqa: E402
from drelay.training.distill import distill, encode_prompts, shard_prompts  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

STAGE = "distill"


def load_inputs(params) -> tuple[Target, list[dict], list[list[int]], int]:
    """The target (capturing the drafter's context layers), the prompt records, their token ids and how many
    were too long."""
    target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
    target.set_layer_ids(context_layer_ids(target.num_layers, params.drafter.num_context_layers))
    records = read_jsonl(f"{params.data.out_dir}/train.jsonl")
    prompts, dropped = encode_prompts(target, records, params.distill.max_prompt_tokens)
    return target, records, prompts, dropped


def run_distill(params, target: Target, prompts: list[list[int]], progress=None) -> dict:
    cfg = params.distill
    return distill(target, prompts, cfg.out_dir, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                   shard_size=cfg.shard_size, temperature=cfg.temperature, feature_dtype=cfg.feature_dtype,
                   seed=params.run.seed, stop_ids=target.stop_token_ids(), progress=progress,
                   settings={"target": target.fingerprint(), "layer_ids": target.layer_ids})


def distill_worker(params) -> dict:
    """A torchrun rank other than 0: its shards, nothing tracked (rank 0 runs `distill_flow`)."""
    if params.run.threads:
        torch.set_num_threads(params.run.threads)
    target, _, prompts, _ = load_inputs(params)
    return run_distill(params, target, prompts)


@flow(name=STAGE)
def distill_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Distill data.out_dir/train.jsonl into distill.out_dir shards."""
    params = load_params(params_path, overrides)
    cfg = params.distill
    if params.run.threads:
        torch.set_num_threads(params.run.threads)
    with stage_run(STAGE, params, ["target", "distill", "data"]) as tracker:
        target, records, prompts, dropped = load_inputs(params)
        # this process's prompts (under torchrun, those of its shards)
        bar = tqdm(total=shard_prompts(len(prompts), cfg.shard_size), desc="distill", unit="prompt",
                   dynamic_ncols=True)
        produced = {"tokens": 0}

        def progress(n_prompts: int, n_tokens: int) -> None:
            produced["tokens"] += n_tokens
            bar.update(n_prompts)
            bar.set_postfix(tokens=produced["tokens"])

        t0 = time.perf_counter()
        summary = run_distill(params, target, prompts, progress)
        bar.close()
        metrics = {**summary, "prompts": len(prompts), "prompts_too_long": dropped,
                   "processes": distributed.world_size(), "wall_s": time.perf_counter() - t0}
        groups = {tuple(target.encode_chat(r["messages"])): (r["source"], r.get("domain", "")) for r in records}
        metrics |= response_tokens_by_group(cfg.out_dir, groups)  # the data card's tokens per source/domain
        tracker.log_metrics(metrics)
        write_metrics(STAGE, metrics)
    return metrics


if __name__ == "__main__":
    stage_main(distill_flow, worker=distill_worker,
               process_group=lambda params: distributed.process_group(params.target.device))
