"""What tests/training/test_distributed.py runs in 1 process (imported) and in 2 gloo processes (under
torchrun: `python -m torch.distributed.run --nproc-per-node 2 -m tests.training.ddp_script <what> <out> ...`):
distillation and a few training steps of tiny random models, the results saved under <out>.

    distill OUT                          distil PROMPTS with a tiny target into OUT
    train OUT METHOD STEPS [KILL_AT]     STEPS steps of METHOD (dflash | drelay) from a fresh drafter; OUT/state.pt
                                         holds the weights and the logged metrics; KILL_AT: rank 1 SIGKILLs
                                         itself after that step (a killed run)
    all OUT                              in one launch (each costs seconds of imports): distill OUT/distill,
                                         train OUT/STEP_RUNS[i] for each, then the killed run (KILLED)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from drelay.config import DRelaySettings
from drelay.models.drafter import BlockDrafter
from drelay.models.methods import create_method
from drelay.models.repair import Native
from drelay.training import distributed
from drelay.training.distill import distill, generate_batch
from drelay.training.trainer import LoopSettings, fit
from tests.conftest import make_tiny_target

# prompts of varied lengths; 5 shards of 3 (the last of 2): ranks 0 and 1 make 3 and 2 of them
PROMPTS = [[1, 5, 7, 9, 3], [1, 40, 41], [1, 17, 18, 19, 20, 21, 22], [1, 88], [1, 3, 3, 60, 22], [40],
           [1, 50, 51, 52], [7, 7, 7, 7], [1, 9, 30, 31, 32, 33], [1, 66, 67], [1, 12, 13, 14, 15], [1, 70],
           [1, 80, 81, 82]]
SHARD_SIZE = 3
STEP_RUNS = {"dflash": ("dflash", 2), "drelay": ("drelay", 2)}  # folder: (method, steps)
KILLED = ("resume", "dflash", 6, 3)  # folder, method, steps, killed after this step (checkpoints every 2)


def run_distill(out: str | Path, temperature: float = 0.0) -> dict:
    target = make_tiny_target(dtype=torch.float32)
    target.set_layer_ids([1, 3, 5])
    return distill(target, PROMPTS, out, max_new_tokens=10, batch_size=2, shard_size=SHARD_SIZE,
                   temperature=temperature, feature_dtype="float32", seed=3, stop_ids={2})


def training_setup():
    """A tiny target, distilled sequences of varied lengths (so the ranks' slices hold different numbers of
    valid positions) and a fresh drafter, the same in every process."""
    target = make_tiny_target(vocab_size=24, dtype=torch.float32, seed=2, init=0.12)
    target.set_layer_ids([1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 24, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 9, (24,), generator=gen)]
    seqs = generate_batch(target, prompts, 16, {5})  # token 5 stops some responses early
    seqs = [s for s in seqs if s.response_len >= 2]
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=4).float()
    return drafter, seqs[:-4], seqs[-4:]


def settings(steps: int) -> LoopSettings:
    return LoopSettings(steps=steps, lr=3e-3, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.01, grad_clip=1.0,
                        blocks_per_step=20, anchors_per_sequence=4, gamma=4.0, eval_every=100, checkpoint_every=2,
                        replay_sequences=2, head_lr_scale=2.0, precision="float32")


def run_train(out: str | Path, method_name: str, steps: int, kill_at: int = 0) -> dict:
    """`steps` steps of `method_name` into `out`; returns (and rank 0 saves to out/state.pt) the final weights,
    the last step's gradients, every logged metric and the run's step counts."""
    out = Path(out)
    drafter, train, val = training_setup()
    if method_name == "dflash":
        method = Native()
    else:
        method = create_method(method_name, drafter, DRelaySettings(reader_dim=16, reader_layers=1, reader_heads=2,
                                                                    repair_margins=(0.0, 1.0)), 4, seed=0)
    logged: list[tuple[int, dict]] = []

    def progress(step: int, metrics: dict) -> None:
        if step == kill_at and distributed.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    result = fit(drafter, method, train, val, settings(steps), drafter_dir=out / "drafter",
                 method_dir=None if method_name == "dflash" else out / "method",
                 checkpoint_dir=out / "ckpt", pool_size=4, seed=0,
                 log=lambda metrics, step: logged.append((step, dict(metrics))), progress=progress)
    grads = {f"{prefix}.{name}": p.grad.clone() for prefix, module in (("drafter", drafter), ("method", method))
             for name, p in module.named_parameters() if p.grad is not None}  # the last step's (averaged over ranks)
    state = {"drafter": drafter.state_dict(), "method": method.state_dict(), "grads": grads, "logged": logged,
             "steps": result.steps, "resumed_from": result.resumed_from, "world": distributed.world_size()}
    if distributed.is_main():
        torch.save(state, out / "state.pt")
    return state


def main(argv: list[str]) -> None:
    what, out, *rest = argv
    with distributed.process_group("cpu"):
        if what == "distill":
            summary = run_distill(out)
            if distributed.is_main():
                Path(out, "summary.json").write_text(json.dumps(summary))
        elif what == "train":
            method, steps, *kill = rest
            run_train(out, method, int(steps), int(kill[0]) if kill else 0)
        elif what == "all":
            summary = run_distill(Path(out, "distill"))
            if distributed.is_main():
                Path(out, "distill", "summary.json").write_text(json.dumps(summary))
            for folder, (method, steps) in STEP_RUNS.items():
                run_train(Path(out, folder), method, steps)
            folder, method, steps, kill_at = KILLED
            run_train(Path(out, folder), method, steps, kill_at)
        else:
            raise SystemExit(f"unknown: {what}")


if __name__ == "__main__":
    main(sys.argv[1:])
