"""Drafter training loop: DFlash objective, AdamW with warmup + cosine decay, gradient clipping,
held-out evaluation with early stopping, and resumable checkpoints.

The loop is plain: sample a batch of blocks, forward, loss, step. Every `eval_every` steps it
scores held-out sequences (loss, per-position top-1 / top-k hit rates, replay τ and oracle τ) and
keeps the best drafter (lowest held-out loss), copied to `out_dir` at the end. A checkpoint (`last.pt`: weights,
optimizer, step, RNG, history) is written atomically every `checkpoint_every` steps; a killed run
started again with the same settings continues from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from drelay.config import TrainConfig
from drelay.decoding.replay import ORACLE, replay
from drelay.models.drafter import BlockDrafter
from drelay.training.data import BlockBatch, make_batch, usable
from drelay.training.distill import Sequence
from drelay.training.losses import dflash_ce, hit_rates

CHECKPOINT = "last.pt"
Logger = Callable[[dict, int], None]


@dataclass
class TrainResult:
    steps: int
    best_step: int
    best_val_loss: float
    stopped_early: bool
    resumed_from: int
    blocks_per_s: float
    history: list[dict] = field(default_factory=list)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def split_sequences(sequences: list[Sequence], val_fraction: float, seed: int):
    """Deterministic train / held-out split by sequence."""
    seqs = usable(sequences)
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(seqs) * val_fraction))
    val = [seqs[i] for i in sorted(order[:n_val])]
    train = [seqs[i] for i in sorted(order[n_val:])]
    if not train:
        raise ValueError(f"only {len(seqs)} usable distilled sequences: nothing left to train on")
    return train, val


def block_hidden(drafter: BlockDrafter, batch: BlockBatch) -> torch.Tensor:
    """Hidden h_i (b, nA, B-1, H) of every block in the batch, bf16 autocast on the matmuls."""
    b, T = batch.tokens.shape
    with torch.autocast(batch.features.device.type, dtype=torch.bfloat16):
        positions = torch.arange(T, device=batch.tokens.device).expand(b, T)
        ctx_kv = drafter.context_kv(batch.features, positions)
        return drafter.forward_anchored(ctx_kv, batch.anchors, batch.anchor_ids, batch.labels.shape[-1] + 1)


def block_forward(drafter: BlockDrafter, batch: BlockBatch):
    """Logits (b, nA, B-1, V) of every block in the batch, bf16 autocast on the matmuls."""
    with torch.autocast(batch.features.device.type, dtype=torch.bfloat16):
        return drafter.logits(block_hidden(drafter, batch))


def sample_batch(train: list[Sequence], cfg: TrainConfig, block_size: int, rng: random.Random) -> BlockBatch:
    """One step's blocks: blocks_per_step // anchors_per_sequence sequences (distinct when there are
    enough), anchors_per_sequence random anchors each. Same rng state -> same batch."""
    n = max(1, cfg.blocks_per_step // cfg.anchors_per_sequence)
    seqs = rng.sample(train, n) if len(train) >= n else [rng.choice(train) for _ in range(n)]
    return make_batch(seqs, cfg.anchors_per_sequence, block_size, rng)


@torch.no_grad()
def evaluate(drafter: BlockDrafter, val: list[Sequence], cfg: TrainConfig, pool_size: int, seed: int,
             replay_sequences: int = 16) -> dict[str, float]:
    """Held-out loss and hit rates on fixed anchors, plus replay τ and oracle τ."""
    drafter.eval()
    rng = random.Random(seed)
    B = drafter.config.block_size
    losses, top1, topk, count = [], 0.0, 0.0, 0.0
    for start in range(0, len(val), 8):
        batch = make_batch(val[start: start + 8], cfg.anchors_per_sequence, B, rng).to(drafter.fc.weight.device)
        logits = block_forward(drafter, batch)
        loss, _ = dflash_ce(logits, batch.labels, cfg.gamma)
        rates = hit_rates(logits, batch.labels, pool_size)
        losses.append(float(loss))
        top1 = top1 + rates["top1"] * rates["count"]
        topk = topk + rates["topk"] * rates["count"]
        count = count + rates["count"]
    out = {"val_loss": sum(losses) / len(losses)}
    count = count.clamp(min=1)
    for i, (a, k) in enumerate(zip((top1 / count).tolist(), (topk / count).tolist())):
        out[f"val_top1_pos{i + 1}"], out[f"val_topk_pos{i + 1}"] = a, k
    with torch.autocast(drafter.fc.weight.device.type, dtype=torch.bfloat16):
        out["replay_tau"] = replay(drafter, val[:replay_sequences], pool_size=pool_size).tau
        out["oracle_tau"] = replay(drafter, val[:replay_sequences], pool_size=pool_size, repair=ORACLE).tau
    drafter.train()
    return out


def config_hash(cfg: TrainConfig, drafter: BlockDrafter, n_train: int, seed: int) -> str:
    """What a checkpoint must match to be resumed: settings, drafter shape, data size, seed."""
    blob = json.dumps([asdict(cfg), asdict(drafter.config), n_train, seed], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    """One AdamW update at learning rate `lr` (x a group's "lr_scale", if it has one) with global
    grad-norm clipping; returns the norm."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return grad_norm


def train_drafter(drafter: BlockDrafter, train: list[Sequence], val: list[Sequence], cfg: TrainConfig, *,
                  pool_size: int = 8, seed: int = 0, log: Logger | None = None,
                  progress: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Train `drafter` (bound to its target) in place; the best weights are saved to cfg.out_dir."""
    log = log or (lambda metrics, step: None)
    out_dir, ckpt_dir = Path(cfg.out_dir), Path(cfg.checkpoint_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    rng = random.Random(seed)
    state_hash = config_hash(cfg, drafter, len(train), seed)
    step, best_val, best_step, bad_evals, history, resumed_from = 0, float("inf"), 0, 0, [], 0

    ckpt_path = ckpt_dir / CHECKPOINT
    ckpt = load_checkpoint(ckpt_path, state_hash)
    if ckpt is not None:
        drafter.load_state_dict(ckpt["drafter"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rng.setstate(ckpt["rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        step, best_val, best_step = ckpt["step"], ckpt["best_val"], ckpt["best_step"]
        bad_evals, history, resumed_from = ckpt["bad_evals"], ckpt["history"], ckpt["step"]

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, {
            "hash": state_hash, "drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "step": step, "best_val": best_val,
            "best_step": best_step, "bad_evals": bad_evals, "history": history})

    device = drafter.fc.weight.device
    drafter.train()
    stopped_early, blocks_done, train_seconds = False, 0, 0.0
    while step < cfg.max_steps:
        t_step = time.perf_counter()
        batch = sample_batch(train, cfg, drafter.config.block_size, rng).to(device)
        logits = block_forward(drafter, batch)
        loss, _ = dflash_ce(logits, batch.labels, cfg.gamma)
        grad_norm = optimizer_step(optimizer, params, loss, lr_at(step, cfg), cfg.grad_clip)
        step += 1
        blocks_done += batch.anchors.numel()
        train_seconds += time.perf_counter() - t_step
        train_metrics = {"train_loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr_at(step - 1, cfg)}
        if step % 10 == 0 or step == 1:
            log(train_metrics, step)
        if progress:
            progress(step, train_metrics)

        last = step == cfg.max_steps
        if step % cfg.eval_every == 0 or last:
            metrics = evaluate(drafter, val, cfg, pool_size, seed)
            metrics["blocks_per_s"] = blocks_done / train_seconds if train_seconds else 0.0
            metrics["train_tokens_per_s"] = metrics["blocks_per_s"] * (drafter.config.block_size - 1)
            history.append({"step": step, **metrics})
            log(metrics, step)
            if metrics["val_loss"] < best_val:
                best_val, best_step, bad_evals = metrics["val_loss"], step, 0
                drafter.save(ckpt_dir / "best")
            else:
                bad_evals += 1
            if cfg.patience and bad_evals >= cfg.patience:
                stopped_early = True
        if step % cfg.checkpoint_every == 0 or last or stopped_early:
            checkpoint()
        if stopped_early:
            break
    shutil.rmtree(out_dir, ignore_errors=True)  # the best weights, wherever training stopped
    shutil.copytree(ckpt_dir / "best", out_dir)
    return TrainResult(step, best_step, best_val, stopped_early, resumed_from,
                       blocks_done / train_seconds if train_seconds else 0.0, history)
