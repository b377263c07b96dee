"""Joint training (DESIGN §1.6-§1.7): a trained DFlash drafter gets `extra_steps` more optimizer steps,
either alone with its own CE (`dflash`, the fair baseline) or together with a fresh DRelay reader +
causal selector under the joint loss (`drelay`: backbone, reader and selector in one optimizer).

Fairness: both methods start from the same drafter, draw the same batches (same seed -> same anchors),
run the same schedule for the same number of steps, and are scored the same way: held-out losses and
replay statistics with the method's own repair (native top-1 for `dflash`, the head's `select` for the
others) next to the native and oracle τ. The baselines of DESIGN §1.7 (`dflash2`, `domino`, `dspark`,
drelay/models/heads.py) train the same way with their own joint losses. At the last step the drelay run
picks its repair margin δ by held-out replay τ. The final weights go to <out_dir>/<method>/drafter and
the head to <out_dir>/<method>/head (<out_dir>/drelay/relay for DRelay).
Resumable like the trainer: <checkpoint_dir>/<method>/last.pt, written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from drelay.config import JOINT_METHODS, JointConfig, TrainConfig
from drelay.decoding.generate import Repair
from drelay.decoding.replay import ORACLE, ReplayStats, replay
from drelay.kernels.reference import kernel, use_triton
from drelay.models.drafter import BlockDrafter
from drelay.models.heads import RepairHead, load_head, make_head
from drelay.models.relay import DRelay, candidate_pool
from drelay.training.data import BlockBatch, make_batch
from drelay.training.distill import Sequence
from drelay.training.losses import dflash_ce, drelay_loss, drelay_loss_from_terms
from drelay.training.trainer import (CHECKPOINT, Logger, block_hidden, load_checkpoint, lr_at, optimizer_step,
                                     sample_batch, save_checkpoint)

# The train-section settings a joint run reads (batch shape, CE decay, optimizer); they enter the resume hash.
TRAIN_KEYS = ("blocks_per_step", "anchors_per_sequence", "gamma", "weight_decay", "min_lr_ratio", "grad_clip")
LOG_EVERY = 10  # steps between training-loss logs (and step 1, and the last step)


@dataclass
class JointResult:
    method: str
    steps: int  # optimizer steps done (= cfg.extra_steps)
    resumed_from: int  # step of the checkpoint this run continued from (0: a fresh run)
    margin: float | None  # the chosen δ (drelay); None for dflash
    margin_taus: dict[float, float]  # held-out replay τ for every δ candidate (drelay)
    blocks_per_s: float  # training throughput of this process (0 when nothing was left to train)
    out_dir: Path  # <out_dir>/<method>: drafter/ (and relay/)
    history: list[dict] = field(default_factory=list)  # every evaluation; step 0 (the shared start) first

    @property
    def final(self) -> dict:
        return self.history[-1]


def make_relay(drafter: BlockDrafter, cfg: JointConfig, pool_size: int, seed: int) -> DRelay:
    """A fresh relay for `drafter`, its initial weights fixed by `seed` (the caller's RNG is untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DRelay.for_drafter(drafter, reader_dim=cfg.reader_dim, reader_layers=cfg.reader_layers,
                                  reader_heads=cfg.reader_heads, pool_size=pool_size, prefix_model=cfg.prefix_model,
                                  residual=cfg.residual_score, bilinear_rank=cfg.bilinear_rank)


Head = DRelay | RepairHead  # what a method adds to the backbone (None: dflash, the backbone alone)
HEAD_FOLDER = "head"  # <out_dir>/<method>/head for the baselines; DRelay keeps <out_dir>/drelay/relay


def make_method_head(method: str, drafter: BlockDrafter, cfg: JointConfig, pool_size: int, seed: int) -> Head | None:
    """A fresh head for `method` (None for dflash), its initial weights fixed by `seed`."""
    if method == "dflash":
        return None
    if method == "drelay":
        return make_relay(drafter, cfg, pool_size, seed)
    settings = {"dflash2": dict(rank=cfg.dflash2_rank),
                "domino": dict(gru_size=cfg.domino_gru_size, rank=cfg.domino_rank,
                               anneal_fraction=cfg.domino_anneal_fraction),
                "dspark": dict(rank=cfg.dspark_rank, lambda_conf=cfg.dspark_lambda_conf)}[method]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make_head(method, drafter, pool_size, **settings)


def head_folder(method: str) -> str:
    return "relay" if method == "drelay" else HEAD_FOLDER


def load_method_head(method: str, out_dir: str | Path, embed_tokens: torch.nn.Module) -> Head | None:
    """The trained head of `method` saved under `out_dir` (<joint.out_dir>/<method>), bound to `embed_tokens`."""
    if method == "dflash":
        return None
    path = Path(out_dir) / head_folder(method)
    head = DRelay.load(path, embed_tokens) if method == "drelay" else load_head(method, path, embed_tokens)
    return head.eval()


def joint_loss(drafter: BlockDrafter, head: Head | None, batch: BlockBatch, cfg: JointConfig, gamma: float,
               pool_size: int, progress: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One batch's loss and its terms (detached): the DFlash CE alone (head None), `drelay_loss` (the pool
    taken from the detached logits, σ teacher-forced on the labels) or a baseline head's own joint loss
    (`progress`, the share of training done, drives schedules such as Domino's λ)."""
    hidden = block_hidden(drafter, batch)  # (b, nA, B-1, H)
    with torch.autocast(batch.features.device.type, dtype=torch.bfloat16):
        if isinstance(head, DRelay) and use_triton(hidden):  # fused: CE, hinge and pool without the logits
            return _fused_drelay_loss(drafter, head, hidden, batch, cfg, gamma, pool_size)
        logits = drafter.logits(hidden)  # (b, nA, B-1, V)
        if head is None:
            ce, _ = dflash_ce(logits, batch.labels, gamma)
            return ce, {"loss": ce.detach(), "ce": ce.detach()}
        if isinstance(head, RepairHead):
            return head.training_loss(hidden, logits, batch.labels, batch.anchor_ids, gamma=gamma, progress=progress)
        relay = head
        pool_ids, pool_logprobs = candidate_pool(logits.detach(), pool_size)  # (b, nA, B-1, k)
        sigma, support = relay.score(hidden, pool_ids, pool_logprobs, batch.anchor_ids, batch.labels)
    return drelay_loss(logits, batch.labels, sigma, support, pool_ids, gamma=gamma,
                       lambda_support=cfg.lambda_support, lambda_repair=cfg.lambda_repair,
                       hinge_margin=cfg.hinge_margin, eps=cfg.eps)


def _fused_drelay_loss(drafter: BlockDrafter, relay: DRelay, hidden: torch.Tensor, batch: BlockBatch,
                       cfg: JointConfig, gamma: float, pool_size: int):
    """`drelay_loss` through the support_loss kernel: the same terms, the logits never materialised (they
    stay fp32 inside the kernel, where autocast would round them to bf16)."""
    normed = drafter.norm(hidden)
    weight = drafter.shared.lm_head.weight
    ce, hinge, pool_ids, pool_logprobs = kernel("support_loss", normed)(
        normed.to(weight.dtype), weight, batch.labels, pool_size, gamma, cfg.hinge_margin)
    sigma, support = relay.score(hidden, pool_ids, pool_logprobs, batch.anchor_ids, batch.labels)
    return drelay_loss_from_terms(ce, hinge, batch.labels, sigma, support, pool_ids, lambda_support=cfg.lambda_support,
                                  lambda_repair=cfg.lambda_repair, eps=cfg.eps)


def replay_bf16(drafter: BlockDrafter, sequences: list[Sequence], pool_size: int,
                repair: Repair | str | None = None) -> ReplayStats:
    """`replay` under the same bf16 autocast as training and the trainer's evaluation."""
    with torch.autocast(drafter.fc.weight.device.type, dtype=torch.bfloat16):
        return replay(drafter, sequences, pool_size=pool_size, repair=repair)


@contextmanager
def _eval_mode(*modules: torch.nn.Module | None):
    """Modules in eval mode inside the block, each back to its own mode after it."""
    modules = [m for m in modules if m is not None]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


@torch.no_grad()
def choose_margin(drafter: BlockDrafter, relay: DRelay, val: list[Sequence], margins, pool_size: int,
                  ) -> tuple[float, dict[float, float]]:
    """(δ with the highest held-out replay τ of `relay.select`, {δ: τ}); ties go to the smallest δ.
    Every δ replays the same sequences with the same drafter and relay, from the same first anchors."""
    with _eval_mode(drafter, relay):
        taus = {float(m): replay_bf16(drafter, val, pool_size, partial(relay.select, margin=float(m))).tau
                for m in sorted(margins)}
    return max(taus, key=lambda m: (taus[m], -m)), taus


@torch.no_grad()
def evaluate_joint(drafter: BlockDrafter, head: Head | None, val: list[Sequence], cfg: JointConfig,
                   train_cfg: TrainConfig, pool_size: int, seed: int) -> dict[str, float]:
    """Held-out loss terms (val_*) on fixed anchors, replay statistics of the method's repair
    (replay_tau, replay_pool_hit, replay_replace_rate, replay_repair_precision, replay_harm_rate,
    replay_accept_pos<i>, ...), and the native and oracle τ of the same backbone."""
    rng, sums, batches = random.Random(seed), {}, 0
    B, device = drafter.config.block_size, drafter.fc.weight.device
    with _eval_mode(drafter, head):
        for start in range(0, len(val), 8):
            batch = make_batch(val[start: start + 8], train_cfg.anchors_per_sequence, B, rng).to(device)
            _, terms = joint_loss(drafter, head, batch, cfg, train_cfg.gamma, pool_size)
            for name, value in terms.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            batches += 1
        out = {f"val_{name}": total / batches for name, total in sums.items()}
        seqs = val[: cfg.replay_sequences]
        out.update(replay_bf16(drafter, seqs, pool_size, head.select if head else None).summary("replay_"))
        out["native_tau"] = replay_bf16(drafter, seqs, pool_size).tau if head else out["replay_tau"]
        out["oracle_tau"] = replay_bf16(drafter, seqs, pool_size, ORACLE).tau
        if isinstance(head, DRelay):
            out["margin"] = head.config.margin
    return out


def _weights_digest(module: torch.nn.Module) -> str:
    """sha256 of a module's weights: a checkpoint never resumes on top of a different starting drafter."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _state_hash(method: str, cfg: JointConfig, train_cfg: TrainConfig, drafter: BlockDrafter, n_train: int,
                pool_size: int, seed: int) -> str:
    joint = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "methods"}  # one method's run
    train = {k: getattr(train_cfg, k) for k in TRAIN_KEYS}
    blob = json.dumps([method, joint, train, dataclasses.asdict(drafter.config), n_train, pool_size, seed,
                       _weights_digest(drafter)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train_joint(method: str, drafter: BlockDrafter, train: list[Sequence], val: list[Sequence], cfg: JointConfig,
                train_cfg: TrainConfig, *, pool_size: int, seed: int, log: Logger | None = None,
                progress: Callable[[int, dict], None] | None = None) -> JointResult:
    """Continue the trained `drafter` (in place) for cfg.extra_steps with `method`; see the module doc."""
    if method not in JOINT_METHODS:
        raise ValueError(f"unknown joint method {method!r} (valid: {', '.join(JOINT_METHODS)})")
    log = log or (lambda metrics, step: None)
    out_dir, ckpt_dir = Path(cfg.out_dir) / method, Path(cfg.checkpoint_dir) / method
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state_hash = _state_hash(method, cfg, train_cfg, drafter, len(train), pool_size, seed)  # before any step
    head = make_method_head(method, drafter, cfg, pool_size, seed)
    relay = head if isinstance(head, DRelay) else None  # the one head with a repair margin δ
    modules = [m for m in (drafter, head) if m is not None]
    groups = [{"params": [p for p in m.parameters() if p.requires_grad],
               "lr_scale": 1.0 if m is drafter else cfg.head_lr_scale} for m in modules]
    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=train_cfg.weight_decay, betas=(0.9, 0.95))
    schedule = dataclasses.replace(train_cfg, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.extra_steps)
    rng = random.Random(seed)  # the batches: same seed, same anchors for every method
    step, history, margin_taus, resumed_from = 0, [], {}, 0

    ckpt_path = ckpt_dir / CHECKPOINT
    ckpt = load_checkpoint(ckpt_path, state_hash)
    if ckpt is not None:
        drafter.load_state_dict(ckpt["drafter"])
        if head is not None:
            head.load_state_dict(ckpt["head"])
        if relay is not None:
            relay.config = dataclasses.replace(relay.config, margin=ckpt["margin"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rng.setstate(ckpt["rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        step, history, margin_taus, resumed_from = ckpt["step"], ckpt["history"], ckpt["margin_taus"], ckpt["step"]

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, {
            "hash": state_hash, "drafter": drafter.state_dict(), "head": head.state_dict() if head else None,
            "margin": relay.config.margin if relay else None, "optimizer": optimizer.state_dict(),
            "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "step": step, "history": history,
            "margin_taus": margin_taus})

    def evaluation() -> None:
        metrics = evaluate_joint(drafter, head, val, cfg, train_cfg, pool_size, seed)
        history.append({"step": step, **metrics})
        log(metrics, step)

    if step == 0:
        evaluation()  # the shared starting point: every head starts as the native top-1
    device = drafter.fc.weight.device
    for m in modules:
        m.train()
    blocks_done, train_seconds = 0, 0.0
    while step < cfg.extra_steps:
        t_step = time.perf_counter()
        batch = sample_batch(train, train_cfg, drafter.config.block_size, rng).to(device)
        loss, terms = joint_loss(drafter, head, batch, cfg, train_cfg.gamma, pool_size, step / cfg.extra_steps)
        grad_norm = optimizer_step(optimizer, params, loss, lr_at(step, schedule), train_cfg.grad_clip)
        step += 1
        blocks_done += batch.anchors.numel()
        train_seconds += time.perf_counter() - t_step
        metrics = {**{f"train_{name}": float(value) for name, value in terms.items()},
                   "grad_norm": float(grad_norm), "lr": lr_at(step - 1, schedule)}
        last = step == cfg.extra_steps
        if step % LOG_EVERY == 0 or step == 1 or last:
            log(metrics, step)
        if progress:
            progress(step, metrics)

        if last and relay is not None:  # δ first, so the final evaluation uses the δ that is saved
            margin, margin_taus = choose_margin(drafter, relay, val[: cfg.replay_sequences], cfg.margins, pool_size)
            relay.config = dataclasses.replace(relay.config, margin=margin)
            log({f"margin_tau_{m:g}".replace("+", ""): tau for m, tau in margin_taus.items()}, step)  # MLflow: no "+"
        if step % cfg.eval_every == 0 or last:
            evaluation()
        if step % cfg.checkpoint_every == 0 or last:
            checkpoint()

    shutil.rmtree(out_dir, ignore_errors=True)
    drafter.save(out_dir / "drafter")
    if head is not None:
        head.save(out_dir / head_folder(method))
    return JointResult(method, step, resumed_from, relay.config.margin if relay else None, margin_taus,
                       blocks_done / train_seconds if train_seconds else 0.0, out_dir, history)
