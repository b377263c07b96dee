"""The one training loop: the DFlash drafter (train_dflash) and every joint method (train@<method>) are
the same loop with a repair method (drelay/models/repair.py) and its settings; `dflash` is the method
whose joint loss is the backbone's DFlash CE alone.

    for step in 1..steps:  batch of random anchors -> hidden -> method.joint_loss -> AdamW step
    every eval_every    :  the evaluation hook (held-out loss terms, hit rates, replay statistics of the
                           method next to the native and oracle τ); early stopping on held-out loss
    at the last step    :  method.tune (DRelay's δ by held-out replay τ), then the final evaluation
    every checkpoint_every: last.pt (weights, optimizer, RNG, history), written atomically

A killed run started again with the same settings, data, starting drafter and library code resumes from
last.pt; any other run starts over (a stage DVC re-runs after a code change retrains, it never reloads the
last run's final step).

Under torchrun (several processes, drelay/training/distributed.py) the loop is data parallel: every rank
draws the same global batch (same rng), takes its slice (`shard_batch`) and runs the step inside
DistributedDataParallel; the batch means divide by the global denominators (`batch_shard`), so the
averaged gradient, and so every update, is the one process's on the same global batch. Every rank
evaluates (rank 0's numbers are the ones kept); rank 0 alone writes checkpoints and the trained folders.
Fairness (DESIGN §1.7): every joint method starts from the same drafter, draws the same batches (same
seed -> same anchors) and runs the same schedule for the same number of steps.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import random
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from drelay.config import JointConfig, TrainConfig
from drelay.data.records import BlockBatch, IGNORE, Sequence, make_batch
from drelay.kernels.reference import batch_shard
from drelay.decoding.replay import ReplayBlocks, ReplayStats, precompute_blocks, replay
from drelay.models.drafter import BlockDrafter
from drelay.models.methods import DRAFTER_FOLDER, create_method, save_method
from drelay.models.repair import Native, Oracle, Repair, RepairMethod
from drelay.training import distributed

CHECKPOINT = "last.pt"
VAL_BATCH = 8  # held-out sequences per evaluation batch
Logger = Callable[[dict, int], None]
Progress = Callable[[int, dict], None]


@dataclass(frozen=True)
class LoopSettings:
    """Everything the loop reads; `for_dflash` / `for_joint` map the params sections onto it."""

    steps: int  # optimizer steps (an upper bound when patience > 0)
    lr: float  # peak AdamW learning rate of the backbone
    warmup_steps: int  # linear warmup, then cosine decay to lr * min_lr_ratio at `steps`
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float  # max global grad norm
    blocks_per_step: int  # training blocks (random anchors) per step
    anchors_per_sequence: int  # blocks drawn from one sequence per visit
    gamma: float  # position decay of the CE weight
    eval_every: int
    checkpoint_every: int
    replay_sequences: int  # held-out sequences replayed at each evaluation (and by `tune`)
    head_lr_scale: float = 1.0  # the method's own weights train at lr x this
    patience: int = 0  # evaluations without held-out loss improvement before stopping (0: never)
    keep_best: bool = False  # save the best held-out-loss drafter (train_dflash) instead of the last
    eval_at_start: bool = False  # evaluate before the first step (the joint methods' shared start)
    log_every: int = 10  # steps between training-loss logs (and step 1, and the last step)
    precision: str = "bfloat16"  # bfloat16: autocast on the matmuls (fp32 master weights); float32: none

    @classmethod
    def for_dflash(cls, cfg: TrainConfig) -> "LoopSettings":
        return cls(cfg.max_steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.grad_clip,
                   cfg.blocks_per_step, cfg.anchors_per_sequence, cfg.gamma, cfg.eval_every, cfg.checkpoint_every,
                   replay_sequences=16, patience=cfg.patience, keep_best=True, precision=cfg.precision)

    @classmethod
    def for_joint(cls, joint: JointConfig, train: TrainConfig) -> "LoopSettings":
        """The joint schedule: joint.common's steps and learning rates, train's batch shape and CE decay."""
        c = joint.common
        return cls(c.extra_steps, c.lr, c.warmup_steps, train.min_lr_ratio, train.weight_decay, train.grad_clip,
                   train.blocks_per_step, train.anchors_per_sequence, train.gamma, c.eval_every, c.checkpoint_every,
                   c.replay_sequences, head_lr_scale=c.head_lr_scale, eval_at_start=True, precision=train.precision)


@dataclass
class FitResult:
    method: str
    steps: int  # optimizer steps done
    best_step: int  # the evaluation with the lowest held-out loss
    best_val_loss: float
    stopped_early: bool
    resumed_from: int  # step of the checkpoint this run continued from (0: a fresh run)
    blocks_per_s: float  # training throughput of this process (0 when nothing was left to train)
    tuned: dict[float, float]  # what `method.tune` tried ({δ: held-out replay τ} for drelay)
    method_metrics: dict[str, float]  # the method's own numbers at the end (δ for drelay)
    history: list[dict] = field(default_factory=list)  # every evaluation, in order

    @property
    def final(self) -> dict:
        return self.history[-1]

    @property
    def best(self) -> dict:
        return next(h for h in reversed(self.history) if h["step"] == self.best_step)


def lr_at(step: int, s: LoopSettings) -> float:
    """Linear warmup to s.lr, then cosine decay to s.lr * min_lr_ratio at s.steps."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def mixed_precision(device: torch.device | str, precision: str):
    """The autocast every step of the loop runs under: bf16 matmuls with fp32 master weights, or none."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bfloat16")


def block_hidden(drafter: BlockDrafter, batch: BlockBatch) -> torch.Tensor:
    """Hidden h_i (b, nA, B-1, H) of every block in the batch (under the caller's `mixed_precision`)."""
    b, T = batch.tokens.shape
    positions = torch.arange(T, device=batch.tokens.device).expand(b, T)
    ctx_kv = drafter.context_kv(batch.features, positions)
    return drafter.forward_anchored(ctx_kv, batch.anchors, batch.anchor_ids, batch.labels.shape[-1] + 1)


def shard_batch(batch: BlockBatch, rank: int, world: int) -> BlockBatch:
    """Rank `rank`'s slice of a global batch split over `world` ranks: contiguous groups of sequences when
    there are at least `world` of them (padding trimmed to the slice's longest), else groups of each
    sequence's anchors. Slices may differ in size by one; the global batch means weigh them right."""
    b, nA = batch.anchors.shape
    if b >= world:
        rows = torch.tensor_split(torch.arange(b), world)[rank]
        T = int(batch.lengths[rows].max())
        return BlockBatch(batch.features[rows, :T], batch.tokens[rows, :T], batch.lengths[rows],
                          batch.anchors[rows], batch.anchor_ids[rows], batch.labels[rows])
    if nA < world:
        raise ValueError(f"a step of {b} x {nA} blocks cannot be split over {world} processes: "
                         f"raise train.blocks_per_step or train.anchors_per_sequence")
    cols = torch.tensor_split(torch.arange(nA), world)[rank]
    return BlockBatch(batch.features, batch.tokens, batch.lengths, batch.anchors[:, cols],
                      batch.anchor_ids[:, cols], batch.labels[:, cols])


class JointStep(torch.nn.Module):
    """One training step's forward, blocks -> (the method's joint loss, its terms): the module that
    DistributedDataParallel wraps under torchrun (its gradient hooks need the forward to go through it)."""

    def __init__(self, drafter: BlockDrafter, method: RepairMethod):
        super().__init__()
        self.drafter, self.method = drafter, method

    def forward(self, batch: BlockBatch, gamma: float, progress: float):
        hidden = block_hidden(self.drafter, batch)
        return self.method.joint_loss(self.drafter, hidden, batch.labels, batch.anchor_ids, gamma=gamma,
                                      progress=progress)


def sample_batch(train: list[Sequence], s: LoopSettings, block_size: int, rng: random.Random) -> BlockBatch:
    """One step's blocks: blocks_per_step // anchors_per_sequence sequences (distinct when there are
    enough), anchors_per_sequence random anchors each. Same rng state -> same batch."""
    n = max(1, s.blocks_per_step // s.anchors_per_sequence)
    seqs = rng.sample(train, n) if len(train) >= n else [rng.choice(train) for _ in range(n)]
    return make_batch(seqs, s.anchors_per_sequence, block_size, rng)


def scorable(batch: BlockBatch, drafter: BlockDrafter) -> BlockBatch:
    """The batch with the labels a drafter with a draft vocabulary cannot score set to IGNORE (the losses
    and hit rates then count only positions it can draft; replay τ still counts every position)."""
    if drafter.vocab_ids is None:
        return batch
    return dataclasses.replace(batch, labels=drafter.drafts_only_vocab(batch.labels, IGNORE))


@torch.no_grad()
def hit_rates(logits: torch.Tensor, labels: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Per-position top-1 accuracy and top-k hit rate (the label inside the pool): (B-1,) each."""
    valid = (labels != IGNORE).float()
    topk = logits.topk(k, dim=-1).indices  # (..., B-1, k)
    top1 = (topk[..., 0] == labels).float() * valid
    in_pool = (topk == labels[..., None]).any(-1).float() * valid
    dims = tuple(range(labels.dim() - 1))
    count = valid.sum(dims).clamp(min=1)
    return {"top1": top1.sum(dims) / count, "topk": in_pool.sum(dims) / count, "count": valid.sum(dims)}


@contextmanager
def eval_mode(*modules: torch.nn.Module):
    """Modules in eval mode inside the block, each back to its own mode after it."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def replay_as_trained(drafter: BlockDrafter, sequences: list[Sequence], pool_size: int, precision: str,
                      repair: Repair | None = None, blocks: ReplayBlocks | None = None) -> ReplayStats:
    """`replay` under the same mixed precision as training (`blocks`: precomputed by `blocks_as_trained`)."""
    with mixed_precision(drafter.fc.weight.device, precision):
        return replay(drafter, sequences, pool_size=pool_size, repair=repair, blocks=blocks)


def blocks_as_trained(drafter: BlockDrafter, sequences: list[Sequence], pool_size: int, precision: str) -> ReplayBlocks:
    """`precompute_blocks` under the same mixed precision as training."""
    with mixed_precision(drafter.fc.weight.device, precision):
        return precompute_blocks(drafter, sequences, pool_size=pool_size)


@torch.no_grad()
def evaluate(drafter: BlockDrafter, method: RepairMethod, val: list[Sequence], s: LoopSettings, pool_size: int,
             seed: int) -> dict[str, float]:
    """The evaluation hook: held-out loss terms (val_*) and per-position top-1 / top-k hit rates of the
    backbone on fixed anchors; replay statistics of the method (replay_tau, replay_pool_hit,
    replay_replace_rate, ..., per position), the native and oracle τ of the same backbone, and the
    method's own numbers (δ)."""
    rng, sums, batches = random.Random(seed), {}, 0
    top1 = topk = count = 0.0
    B, device = drafter.config.block_size, drafter.fc.weight.device
    with eval_mode(drafter, method):
        for start in range(0, len(val), VAL_BATCH):
            batch = scorable(make_batch(val[start: start + VAL_BATCH], s.anchors_per_sequence, B, rng).to(device),
                             drafter)
            with mixed_precision(device, s.precision):
                hidden = block_hidden(drafter, batch)
                _, terms = method.joint_loss(drafter, hidden, batch.labels, batch.anchor_ids, gamma=s.gamma,
                                             progress=1.0)
                rates = hit_rates(drafter.logits(hidden), batch.labels, pool_size)
            for name, value in terms.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            batches += 1
            top1, topk = top1 + rates["top1"] * rates["count"], topk + rates["topk"] * rates["count"]
            count = count + rates["count"]
        out = {f"val_{name}": total / batches for name, total in sums.items()}
        count = count.clamp(min=1)
        for i, (a, k) in enumerate(zip((top1 / count).tolist(), (topk / count).tolist())):
            out[f"val_top1_pos{i + 1}"], out[f"val_topk_pos{i + 1}"] = a, k
        seqs = val[: s.replay_sequences]
        p = s.precision
        out.update(replay_as_trained(drafter, seqs, pool_size, p, method if method.repairs else None).summary("replay_"))
        out["native_tau"] = replay_as_trained(drafter, seqs, pool_size, p).tau if method.repairs else out["replay_tau"]
        out["oracle_tau"] = replay_as_trained(drafter, seqs, pool_size, p, Oracle()).tau
        out.update(method.eval_metrics())
    return out


@functools.lru_cache(maxsize=None)
def source_digest(root: Path = Path(__file__).resolve().parents[1]) -> str:
    """sha256 of a package's Python source (default: drelay's), part of what a checkpoint must match."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 of a module's weights: a checkpoint never resumes on top of a different starting drafter."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save to a .partial file, then rename: a kill mid-write never leaves a torn checkpoint."""
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    tmp.rename(path)


def load_checkpoint(path: Path, state_hash: str) -> dict | None:
    """The checkpoint at `path` if it was written under the same settings (`state_hash`); None when
    there is none or its settings differ (training starts over); a corrupt file is an error."""
    if not path.is_file():
        return None
    try:
        ckpt = torch.load(path, weights_only=False)
    except Exception as err:
        raise ValueError(f"corrupt checkpoint {path}: {err}; delete it to start over") from err
    return ckpt if ckpt.get("hash") == state_hash else None


def optimizer_step(optimizer: torch.optim.Optimizer, params, loss: torch.Tensor, lr: float,
                   grad_clip: float) -> torch.Tensor:
    """One AdamW update at learning rate `lr` (x a group's "lr_scale") with global grad-norm clipping."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return grad_norm


def fit(drafter: BlockDrafter, method: RepairMethod, train: list[Sequence], val: list[Sequence], s: LoopSettings, *,
        drafter_dir: str | Path, method_dir: str | Path | None, checkpoint_dir: str | Path, pool_size: int,
        seed: int, settings_key=None, log: Logger | None = None, progress: Progress | None = None) -> FitResult:
    """Train `drafter` and `method` together in place (see the module docstring). Writes the drafter to
    `drafter_dir` and the method's weights (if it has any) to its folder under `method_dir`.
    settings_key: the method's own settings, part of what a checkpoint must match to be resumed (with the
    loop settings, the data size, the starting drafter's weights and `source_digest()`).
    Under torchrun every rank calls it with the same arguments (`log` and `progress` matter on rank 0)."""
    log = log or (lambda metrics, step: None)
    rank, world = distributed.rank(), distributed.world_size()
    main = rank == 0
    drafter_dir, ckpt_dir = Path(drafter_dir), Path(checkpoint_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    blob = json.dumps([method.name, settings_key, dataclasses.asdict(s), dataclasses.asdict(drafter.config),
                       len(train), pool_size, seed, weights_digest(drafter), source_digest()], sort_keys=True,
                      default=str)
    state_hash = hashlib.sha256(blob.encode()).hexdigest()[:16]
    modules = [drafter, method]
    groups = [{"params": [p for p in m.parameters() if p.requires_grad],
               "lr_scale": 1.0 if m is drafter else s.head_lr_scale} for m in modules]
    groups = [g for g in groups if g["params"]]
    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))
    rng = random.Random(seed)  # the batches: same seed, same anchors for every method
    step, history, tuned, resumed_from = 0, [], {}, 0
    best_val, best_step, bad_evals = float("inf"), 0, 0

    ckpt_path = ckpt_dir / CHECKPOINT
    ckpt = load_checkpoint(ckpt_path, state_hash)
    if ckpt is not None:
        drafter.load_state_dict(ckpt["drafter"])
        method.load_state_dict(ckpt["method"])
        method.load_method_state(ckpt["method_state"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rng.setstate(ckpt["rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        step, history, tuned, resumed_from = ckpt["step"], ckpt["history"], ckpt["tuned"], ckpt["step"]
        best_val, best_step, bad_evals = ckpt["best_val"], ckpt["best_step"], ckpt["bad_evals"]
    if world > 1 and len(set(distributed.gather_objects(step))) > 1:
        raise RuntimeError(f"the ranks found different checkpoints in {ckpt_dir}: on several nodes, "
                           f"checkpoint_dir must be on a filesystem they all share")

    def checkpoint() -> None:
        if not main:
            return
        save_checkpoint(ckpt_path, {
            "hash": state_hash, "drafter": drafter.state_dict(), "method": method.state_dict(),
            "method_state": method.method_state(), "optimizer": optimizer.state_dict(), "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(), "step": step, "history": history, "tuned": tuned,
            "best_val": best_val, "best_step": best_step, "bad_evals": bad_evals})

    def evaluation() -> dict:
        metrics = distributed.broadcast_object(evaluate(drafter, method, val, s, pool_size, seed))  # rank 0's
        history.append({"step": step, **metrics})
        return metrics

    if step == 0 and s.eval_at_start:
        log(evaluation(), step)  # the shared starting point: every method starts as the native top-1
    device = drafter.fc.weight.device
    for m in modules:
        m.train()
    joint_step = JointStep(drafter, method)
    if world > 1:  # gradients averaged over the ranks; each rank's batch means use the global denominators
        joint_step = distributed.data_parallel(joint_step)
        global_means = lambda: batch_shard(world, distributed.sum_over_ranks)  # noqa: E731
    else:
        global_means = nullcontext
    stopped_early, blocks_done, train_seconds = False, 0, 0.0
    while step < s.steps:
        t_step = time.perf_counter()
        batch = sample_batch(train, s, drafter.config.block_size, rng)
        n_blocks = batch.anchors.numel()  # the global batch's, on every rank
        if world > 1:
            batch = shard_batch(batch, rank, world)
        batch = scorable(batch.to(device), drafter)
        with mixed_precision(device, s.precision), global_means():
            loss, terms = joint_step(batch, s.gamma, step / s.steps)
        grad_norm = optimizer_step(optimizer, params, loss, lr_at(step, s), s.grad_clip)
        terms = distributed.mean_over_ranks(terms)  # the global batch's terms (each rank's is world x its share)
        step += 1
        blocks_done += n_blocks
        train_seconds += time.perf_counter() - t_step
        metrics = {**{f"train_{name}": float(value) for name, value in terms.items()},
                   "grad_norm": float(grad_norm), "lr": lr_at(step - 1, s)}
        last = step == s.steps
        if step % s.log_every == 0 or step == 1 or last:
            log(metrics, step)
        if progress:
            progress(step, metrics)

        if last:  # tuning first, so the final evaluation uses the settings that are saved
            with eval_mode(drafter, method):  # every δ replays the same drafter blocks: computed once
                seqs = val[: s.replay_sequences]
                blocks = None if method.needs_logits else blocks_as_trained(drafter, seqs, pool_size, s.precision)
                tuned = method.tune(lambda hook: replay_as_trained(drafter, seqs, pool_size, s.precision, hook,
                                                                   blocks).tau)
            if world > 1:  # every rank tuned the same weights; rank 0's choice is the one kept
                tuned = distributed.broadcast_object(tuned)
                method.load_method_state(distributed.broadcast_object(method.method_state()))
            if tuned:
                log({f"tune_tau_{m:g}".replace("+", ""): tau for m, tau in tuned.items()}, step)  # MLflow: no "+"
        if step % s.eval_every == 0 or last:
            metrics = evaluation()
            metrics["blocks_per_s"] = blocks_done / train_seconds if train_seconds else 0.0
            metrics["train_tokens_per_s"] = metrics["blocks_per_s"] * (drafter.config.block_size - 1)
            log(metrics, step)
            if metrics["val_loss"] < best_val:
                best_val, best_step, bad_evals = metrics["val_loss"], step, 0
                if s.keep_best and main:
                    drafter.save(ckpt_dir / "best")
            else:
                bad_evals += 1
            if s.patience and bad_evals >= s.patience:
                stopped_early = True
        if step % s.checkpoint_every == 0 or last or stopped_early:
            checkpoint()
        if stopped_early:
            break

    if main:
        for folder in (drafter_dir, method_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        if s.keep_best:  # the best weights, wherever training stopped
            shutil.copytree(ckpt_dir / "best", drafter_dir)
        else:
            drafter.save(drafter_dir)
        if method_dir is not None:
            save_method(method, method_dir)
    distributed.barrier()  # every rank returns once the trained folders are written
    return FitResult(method.name, step, best_step, best_val, stopped_early, resumed_from,
                     blocks_done / train_seconds if train_seconds else 0.0, tuned, method.eval_metrics(), history)


def train_dflash(drafter: BlockDrafter, train: list[Sequence], val: list[Sequence], cfg: TrainConfig, *,
                 pool_size: int, seed: int, log: Logger | None = None, progress: Progress | None = None) -> FitResult:
    """The DFlash drafter: the native method under the train section (early stopping, best weights kept)
    into cfg.out_dir."""
    return fit(drafter, Native(), train, val, LoopSettings.for_dflash(cfg), drafter_dir=cfg.out_dir, method_dir=None,
               checkpoint_dir=cfg.checkpoint_dir, pool_size=pool_size, seed=seed, log=log, progress=progress)


def train_method(name: str, drafter: BlockDrafter, train: list[Sequence], val: list[Sequence], joint: JointConfig,
                 train_cfg: TrainConfig, *, pool_size: int, seed: int, log: Logger | None = None,
                 progress: Progress | None = None) -> FitResult:
    """Joint method `name`: the trained `drafter` continued for joint.common.extra_steps with a fresh method
    (its weights fixed by `seed`) into <joint.common.out_dir>/<name>/."""
    settings = joint.settings(name)
    method = create_method(name, drafter, settings, pool_size, seed)
    out_dir = Path(joint.common.out_dir) / name
    return fit(drafter, method, train, val, LoopSettings.for_joint(joint, train_cfg),
               drafter_dir=out_dir / DRAFTER_FOLDER, method_dir=out_dir, checkpoint_dir=Path(joint.common.checkpoint_dir) / name,
               pool_size=pool_size, seed=seed, settings_key=dataclasses.asdict(settings), log=log, progress=progress)
