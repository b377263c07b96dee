"""Baseline repair heads (DESIGN §1.7): DFlash2's causal candidate selector, Domino's GRU logit
correction and DSpark's Markov bigram bias, reimplemented on DRelay's backbone and interfaces.

All three repair a block left to right, each position conditioned on the token chosen before it
(ŷ_0 = the anchor), and differ only in the prefix context c_i and the score of position i:

    dflash2 : c_i = P[ŷ_{i-1}]               σ_i(c) = s_i(c) + <c_i ⊙ W_h h_i, S[c]>  for c in top-k(z_i)
    domino  : c_i = GRU(E(ŷ_0..ŷ_{i-1}))     σ_i    = z_i + W_b SiLU(W_a [h_i; c_i])   (full vocabulary)
    dspark  : c_i = W1[ŷ_{i-1}]              σ_i    = z_i + W2 c_i                      (full vocabulary)

(s_i = log_softmax(z_i); E = the target's frozen embedding.) The layer that produces each correction
starts at zero (S, W_b, W2), so an untrained head picks exactly the drafter's native top-1.

With a draft vocabulary (EAGLE-3's; the drafter scores only N of the V ids, every other logit is
OUT_OF_VOCAB) the heads take the logits over those N columns only (`columns`: the token id of each
column), as DRelay's pool does. A "full vocabulary" head then scores the N ids: an id outside them has
z = -1e9, never the argmax and exp() = 0 in a softmax, so the choices and losses are the V-wide ones
(up to float rounding), and the rows of its V-sized output layer for the other ids get no gradient.

Training is teacher-forced: the prefix is the true tokens (y_0 = anchor, y_1..y_{n-1}), every position in
one pass (`scores`); inference (`select`, the engine's `repair=` hook) runs the same `_context` / `_score`
step by step on the head's own choices. `training_loss` returns each method's whole joint loss, the
backbone's DFlash CE part included, as that method defines it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from drelay.data.records import IGNORE
from drelay.kernels.reference import candidate_pool, dflash_ce, mean_denominator, pool_index, position_weights
from drelay.models.folder import EmbeddingBoundFolder, SharedEmbedding
from drelay.models.repair import DraftBlock, RepairMethod

if TYPE_CHECKING:
    from drelay.models.drafter import BlockDrafter


class HeadError(RuntimeError):
    """A head folder that is missing or corrupt, or an embedding that does not fit the head."""


def _check_positive(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")


def _check_nonnegative(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")


@dataclass
class HeadConfig:
    hidden_size: int  # H, the drafter's (= target's) width
    vocab_size: int  # V, rows of the target's embedding (= the logits' width)
    block_size: int = 8  # B of the drafter it was made for (recorded; no head weight depends on it)

    def __post_init__(self):
        _check_positive(self, "hidden_size", "vocab_size")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + one draft), got {self.block_size}")


@dataclass
class DFlash2Config(HeadConfig):
    pool_size: int = 16  # k: the selector re-ranks the top-k of z_i (SpecForge: 16)
    rank: int = 64  # r of the predecessor / successor codebooks (SpecForge: 256)
    alpha: float = 1.0  # weight of the selector CE

    def __post_init__(self):
        super().__post_init__()
        _check_positive(self, "pool_size", "rank")
        _check_nonnegative(self, "alpha")


@dataclass
class DominoConfig(HeadConfig):
    gru_size: int = 256  # width of the prefix GRU (SpecForge: 1024)
    rank: int = 128  # width of the low-rank MLP into the vocabulary (SpecForge: 256)
    anneal_fraction: float = 0.5  # λ falls linearly from 1 to 0 over this share of training

    def __post_init__(self):
        super().__post_init__()
        _check_positive(self, "gru_size", "rank")
        if not 0.0 <= self.anneal_fraction <= 1.0:
            raise ValueError(f"anneal_fraction must be in [0, 1], got {self.anneal_fraction}")


@dataclass
class DSparkConfig(HeadConfig):
    rank: int = 256  # r of the Markov bigram W2(W1[prev]) (SpecForge: 256)
    lambda_conf: float = 1.0  # weight of the confidence BCE

    def __post_init__(self):
        super().__post_init__()
        _check_positive(self, "rank")
        _check_nonnegative(self, "lambda_conf")


class Columns(NamedTuple):
    """What a pass needs to know about the logits' columns, made once per pass (`RepairHead._columns`)."""

    ids: torch.Tensor | None  # (C,) sorted token id of each logits column; None: column j is token j (C = V)
    rows: torch.Tensor | None = None  # (C, ·) a full-vocabulary head's output-layer rows for those columns


class Scored(NamedTuple):
    """A teacher-forced pass over N blocks of n positions."""

    hidden: torch.Tensor  # (N, n, H) in the head's dtype
    logits: torch.Tensor  # (N, n, C) the drafter's z over the columns
    context: torch.Tensor  # (N, n, ·) c_i, the prefix context of each position
    scores: torch.Tensor  # (N, n, m) σ over m choices (k pool candidates, or the C columns)
    ids: torch.Tensor | None  # (N, n, m) the token of each choice; None: choice j is column j
    columns: Columns


def to_columns(tokens: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
    """Token ids -> their column index in `columns` (sorted ids; None: unchanged); IGNORE and ids outside
    the columns -> IGNORE."""
    if columns is None:
        return tokens
    at = torch.searchsorted(columns, tokens.clamp(min=0)).clamp(max=columns.numel() - 1)
    return torch.where((tokens >= 0) & (columns[at] == tokens), at, IGNORE)


def _columns_with_rows(ids: torch.Tensor | None, weight: torch.Tensor) -> Columns:
    """A full-vocabulary head's output layer (V, ·) restricted to the columns' rows."""
    return Columns(ids, weight if ids is None else weight.index_select(0, ids))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32 for a loss (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


class RepairHead(EmbeddingBoundFolder, RepairMethod):
    """What the three heads share: construction, save/load, the parallel teacher-forced pass, the
    sequential repair loop and the loss skeleton. A subclass defines `_context`, `_score`, `_loss`."""

    config_cls: type[HeadConfig] = HeadConfig
    folder_error = HeadError
    folder_name = "head"  # <joint.out_dir>/<name>/head
    narrow_logits = True  # block.logits may cover only the draft vocabulary (block.logit_ids)

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.config = cfg
        self.shared: SharedEmbedding | None = None

    # ------------------------------------------------------------------ construction, save, load
    @classmethod
    def for_drafter(cls, drafter: BlockDrafter, pool_size: int = 8, **kwargs) -> "RepairHead":
        """A fresh head sized for `drafter`, on its device and dtype, bound to its embedding.
        `pool_size` sets the pool of a head that re-ranks one (dflash2); full-vocabulary heads have none."""
        embed = drafter.shared.embed_tokens
        if "pool_size" in {f.name for f in fields(cls.config_cls)}:
            kwargs["pool_size"] = pool_size
        cfg = cls.config_cls(hidden_size=drafter.config.hidden_size, vocab_size=embed.weight.shape[0],
                             block_size=drafter.config.block_size, **kwargs)
        w = drafter.fc.weight
        return cls(cfg).to(device=w.device, dtype=w.dtype).attach(embed)

    @classmethod
    def _create(cls, drafter: BlockDrafter, settings, pool_size: int) -> "RepairHead":
        """`settings` (joint.<name>): its fields are this head's config fields of the same names."""
        return cls.for_drafter(drafter, pool_size=pool_size, **dataclasses.asdict(settings))

    def joint_loss(self, drafter, hidden, labels, anchor_ids, *, gamma, progress):
        logits, _ = drafter.scored_logits(hidden, labels, IGNORE)  # (..., n, C): the ids the drafter scores
        return self.training_loss(hidden, logits, labels, anchor_ids, gamma=gamma, progress=progress,
                                  columns=drafter.vocab_ids)

    def attach(self, embed_tokens: nn.Module) -> "RepairHead":
        shape, cfg = tuple(embed_tokens.weight.shape), self.config
        if shape != (cfg.vocab_size, cfg.hidden_size):
            raise HeadError(f"embedding of shape {shape} does not fit the {self.name} head's "
                            f"vocab_size x hidden_size = {cfg.vocab_size} x {cfg.hidden_size}")
        self.shared = SharedEmbedding(embed_tokens)
        return self

    @classmethod
    def folder_what(cls) -> str:
        return f"{cls.name} head"

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            raise HeadError(f"{self.name} head has no embedding: call head.attach(target.embed_tokens) first")
        return self.shared.embed_tokens(ids).to(self.dtype)

    # ------------------------------------------------------------------ what a subclass defines
    def _context(self, prev: torch.Tensor, state):
        """Predecessors ŷ_{i-1} (N, t), continuing from `state` (None: the block's start) ->
        contexts c_i (N, t, ·) and the state to continue from."""
        raise NotImplementedError

    def _score(self, hidden: torch.Tensor, logits: torch.Tensor, context: torch.Tensor, columns: Columns):
        """hidden (N, t, H), logits (N, t, C), context (N, t, ·) -> σ (N, t, m), ids (N, t, m) | None."""
        raise NotImplementedError

    def _columns(self, ids: torch.Tensor | None) -> Columns:
        """The per-pass view of the logits' columns (a full-vocabulary head adds its output rows)."""
        return Columns(ids)

    def _loss(self, out: Scored, labels: torch.Tensor, at: torch.Tensor, ce: torch.Tensor, gamma: float,
              progress: float):
        """The method's joint loss and its own terms; labels as token ids, `at` as column indices (both
        IGNORE where the other is); ce = the plain DFlash CE of the base logits."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ computation
    @staticmethod
    def _pick(scores: torch.Tensor, ids: torch.Tensor | None, native: torch.Tensor | None = None,
              columns: torch.Tensor | None = None) -> torch.Tensor:
        """The argmax choice of each position as a token id: (..., m) -> (...). ids None: choice j is
        column j, token `columns[j]` (j without columns). With `native` (...) (the engine's top-1, a
        full-vocabulary head only) a tie with the best score keeps the native: bf16 logits tie often, and
        argmax and top-k may break a tie differently. Columns are sorted, so the first maximum is the
        smallest id over the columns as over all V."""
        j = scores.argmax(-1, keepdim=True)
        if ids is not None:
            return ids.gather(-1, j).squeeze(-1)
        picked = (j if columns is None else columns[j]).squeeze(-1)
        if native is None:
            return picked
        at_native = scores.gather(-1, to_columns(native, columns)[..., None].clamp(min=0)).squeeze(-1)
        return torch.where(at_native >= scores.gather(-1, j).squeeze(-1), native, picked)

    def _forced(self, hidden, logits, anchor_ids, prefix_ids, columns: torch.Tensor | None = None) -> Scored:
        """Teacher-forced pass, every position at once, flattened to (N, n, ·); prefix_ids (..., n)
        are y_1..y_n (only y_1..y_{n-1} are read). IGNORE padding sits only at a block's end, so a
        padded predecessor only feeds a padded position: it is read as token 0."""
        n = prefix_ids.shape[-1]
        hidden = hidden.reshape(-1, n, hidden.shape[-1]).to(self.dtype)
        logits = logits.reshape(-1, n, logits.shape[-1])
        prev = torch.cat([anchor_ids.reshape(-1, 1), prefix_ids.reshape(-1, n)[:, : n - 1]], dim=1)
        context, _ = self._context(prev.clamp(min=0), None)
        cols = self._columns(columns)
        return Scored(hidden, logits, context, *self._score(hidden, logits, context, cols), cols)

    def scores(self, hidden, logits, anchor_ids, prefix_ids) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced σ (..., n, m) and choice ids (..., n, m) | None, all positions in parallel.
        hidden (..., n, H), logits (..., n, V) over all ids, anchor_ids (...), prefix_ids (..., n) the true tokens."""
        out = self._forced(hidden, logits, anchor_ids, prefix_ids)
        lead = prefix_ids.shape
        return out.scores.view(*lead, -1), None if out.ids is None else out.ids.view(*lead, -1)

    @torch.no_grad()
    def select(self, block: DraftBlock, return_scores: bool = False, prefix_ids: torch.Tensor | None = None):
        """Repair one block left to right on the head's own choices: tokens (b, n) [, σ (b, n, m)].
        prefix_ids (b, n), for tests and analysis: feed these tokens to the prefix instead of the choices."""
        hidden, n = block.hidden.to(self.dtype), block.hidden.shape[1]
        # only the drafts the target checks (block.checked); scores and a given prefix ask for every position
        walk = n if return_scores or prefix_ids is not None else block.walk_length()
        prev, state = block.anchor_ids[:, None], None
        tokens, scores = [], []
        cols = self._columns(block.logit_ids)
        for i in range(walk):
            context, state = self._context(prev, state)
            sigma, ids = self._score(hidden[:, i: i + 1], block.logits[:, i: i + 1], context, cols)  # (b, 1, m)
            tokens.append(self._pick(sigma, ids, block.pool_ids[:, i: i + 1, 0], cols.ids))  # (b, 1)
            scores.append(sigma[:, 0])
            prev = tokens[-1] if prefix_ids is None else prefix_ids[:, i: i + 1].clamp(min=0)
        tokens = torch.cat(tokens + [block.pool_ids[:, walk:, 0]], dim=1)  # unchecked drafts: the native
        return (tokens, torch.stack(scores, dim=1)) if return_scores else tokens

    @staticmethod
    def weights(labels: torch.Tensor, gamma: float) -> torch.Tensor:
        """Position weights exp(-(i-1)/γ) (..., n), zero on IGNORE padding."""
        return position_weights(labels.shape[-1], gamma, labels.device) * (labels != IGNORE)

    def training_loss(self, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                      anchor_ids: torch.Tensor, *, gamma: float, progress: float,
                      columns: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The method's whole joint loss, teacher-forced on the true tokens, and its terms (detached).

        hidden (..., n, H), logits (..., n, C): the drafter's over `columns` (sorted token ids; None: all V);
        labels (..., n) token ids with IGNORE padding (an id outside the columns counts as IGNORE in every
        loss: no score can lower its CE); anchor_ids (...); progress in [0, 1]: the share of training done
        (for schedules). Terms: "loss", "ce" (the plain DFlash CE of z, comparable across methods), "acc" /
        "native_acc" (teacher-forced top-1 accuracy of the head's choice / of z's argmax) and the method's own.
        """
        labels = labels.reshape(-1, labels.shape[-1])
        out = self._forced(hidden, logits, anchor_ids, labels, columns)
        at = to_columns(labels, columns)  # the labels as column indices (IGNORE: padding or outside the columns)
        labels = torch.where(at == IGNORE, IGNORE, labels)
        ce, _ = dflash_ce(out.logits, at, gamma)
        loss, terms = self._loss(out, labels, at, ce, gamma, progress)
        valid = labels != IGNORE
        count = mean_denominator(valid.sum(), 1)
        terms.update(loss=loss, ce=ce,
                     acc=((self._pick(out.scores, out.ids, columns=columns) == labels) & valid).sum() / count,
                     native_acc=((out.logits.argmax(-1) == at) & valid).sum() / count)
        return loss, {name: t.detach() for name, t in terms.items()}


class DFlash2Selector(RepairHead):
    """DFlash2: a greedy causal walk over the top-k of z_i, re-ranked by a low-rank trilinear term
    between the predecessor, the hidden state and the candidate. No global reader: position i sees only
    its own h_i, z_i and the token chosen at i-1. It re-ranks its own top-k (config.pool_size, what it
    was trained on) of block.logits, whatever pool size the engine uses."""

    name = "dflash2"
    config_cls = DFlash2Config

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        # P ~ N(0, 1), not SpecForge's N(0, 0.02): with S = 0 the score starts at s_i either way, but S's
        # gradient is proportional to P, and at 0.02 a few hundred steps here never moved a choice
        self.predecessor = nn.Parameter(torch.randn(cfg.vocab_size, cfg.rank))  # P
        # S starts at zero: σ = s_i, the native ranking. That also zeroes the first gradients of P and
        # W_h (each is multiplied by S), so S alone moves at the first step (as in SpecForge).
        self.successor = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.rank))  # S
        self.hidden_proj = nn.Linear(cfg.hidden_size, cfg.rank, bias=False)  # W_h

    def _context(self, prev, state):
        return self.predecessor[prev], None  # (N, t, r)

    def _score(self, hidden, logits, context, columns):
        # SpecForge adds the raw logit z_i(c); s_i(c) differs from it by a per-position constant, which
        # changes neither the argmax nor the pool CE
        pool_ids, pool_logprobs = candidate_pool(logits, self.config.pool_size)  # (N, t, k) column indices
        if columns.ids is not None:
            pool_ids = columns.ids[pool_ids]
        query = context * self.hidden_proj(hidden)  # (N, t, r): P[p] ⊙ W_h h_i
        bonus = torch.einsum("ntr,ntkr->ntk", query, self.successor[pool_ids])
        return _wide(pool_logprobs) + _wide(bonus), pool_ids

    def _loss(self, out, labels, at, ce, gamma, progress):
        """ce + α · selector CE over the pool (target: the true token's pool index), at positions whose
        true token is in the pool. As in SpecForge it is divided by the weight sum of ALL valid positions,
        so a low pool-hit rate dilutes it. Gradient reaches z (through s_i) and h (through W_h). α is
        constant (SpecForge's α warmup and ramp default to 0), so `progress` is not read."""
        index, in_pool = pool_index(out.ids, labels)
        nll = -torch.log_softmax(_wide(out.scores), -1).gather(-1, index[..., None]).squeeze(-1)
        w = self.weights(labels, gamma)
        selector = (nll * w * in_pool).sum() / mean_denominator(w.sum(), 1e-8)
        pool_hit = in_pool.sum() / mean_denominator((labels != IGNORE).sum(), 1)
        return ce + self.config.alpha * selector, {"selector": selector, "pool_hit": pool_hit}


class DominoHead(RepairHead):
    """Domino: a GRU over the frozen embeddings of the tokens chosen so far (anchor first); its state
    with h_i gives low-rank residual logits over the full vocabulary, added to z_i."""

    name = "domino"
    config_cls = DominoConfig

    def __init__(self, cfg: DominoConfig):
        super().__init__(cfg)
        H = cfg.hidden_size
        self.gru = nn.GRU(H, cfg.gru_size, batch_first=True, bias=False)  # bias-free as in SpecForge
        self.correction = nn.Sequential(nn.Linear(H + cfg.gru_size, cfg.rank, bias=False), nn.SiLU(),
                                        nn.Linear(cfg.rank, cfg.vocab_size, bias=False))
        # Zero output layer: an untrained Domino is exactly the native top-1, and at the first step only
        # this layer gets a gradient. SpecForge instead starts from a small random correction (N(0, 0.02)).
        nn.init.zeros_(self.correction[-1].weight)

    def lambda_at(self, progress: float) -> float:
        """λ of the base-anchored loss: 1 -> 0 linearly over the first anneal_fraction of training, then 0."""
        if not 0.0 <= progress <= 1.0:
            raise ValueError(f"progress must be in [0, 1], got {progress}")
        fraction = self.config.anneal_fraction
        return max(0.0, 1.0 - progress / fraction) if fraction > 0 else 0.0

    def _context(self, prev, state):
        return self.gru(self.embed(prev), state)  # r_i (N, t, G), state (1, N, G)

    def _columns(self, ids):
        return _columns_with_rows(ids, self.correction[-1].weight)

    def _score(self, hidden, logits, context, columns):
        residual = F.linear(self.correction[:-1](torch.cat([hidden, context], dim=-1)), columns.rows)  # (N, t, C)
        return _wide(logits) + _wide(residual), None  # not in bf16: its rounding would tie near-equal logits

    def _loss(self, out, labels, at, ce, gamma, progress):
        """(1-λ)·CE(z + Δ) + λ·CE(z), both position-weighted. At λ = 1 (the start) the head gets no
        gradient; the base CE trains only the backbone."""
        lam = self.lambda_at(progress)
        final, _ = dflash_ce(out.scores, at, gamma)
        return (1 - lam) * final + lam * ce, {"final": final, "lambda": torch.tensor(lam)}


class DSparkHead(RepairHead):
    """DSpark: a low-rank Markov bigram bias W2(W1[ŷ_{i-1}]) over the full vocabulary added to z_i, and a
    confidence head σ(Linear([h_i; W1[ŷ_{i-1}]])) predicting whether position i's choice is right."""

    name = "dspark"
    config_cls = DSparkConfig

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_in = nn.Embedding(cfg.vocab_size, cfg.rank)  # W1
        self.markov_out = nn.Linear(cfg.rank, cfg.vocab_size, bias=False)  # W2
        # Zero W2: an untrained DSpark is exactly the native top-1 (SpecForge: small random, N(0, 0.02))
        nn.init.zeros_(self.markov_out.weight)
        self.confidence_head = nn.Linear(cfg.hidden_size + cfg.rank, 1)

    def _context(self, prev, state):
        return self.markov_in(prev), None  # (N, t, r)

    def _columns(self, ids):
        return _columns_with_rows(ids, self.markov_out.weight)

    def _score(self, hidden, logits, context, columns):
        bias = F.linear(context, columns.rows)  # (N, t, C): depends on the predecessor only
        return _wide(logits) + _wide(bias), None  # not in bf16: its rounding would tie near-equal logits

    def confidence_logits(self, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """hidden (..., H), context W1[prev] (..., r) -> logit that the corrected argmax is right (...)."""
        return self.confidence_head(torch.cat([hidden, context], dim=-1)).squeeze(-1)

    @torch.no_grad()
    def confidence(self, block: DraftBlock) -> torch.Tensor:
        """Per-position probability (b, n) that each of `select`'s choices is right given a right prefix,
        along the chosen path (analysis only: nothing truncates on it)."""
        tokens = self.select(block)
        prev = torch.cat([block.anchor_ids[:, None], tokens[:, :-1]], dim=1)
        context, _ = self._context(prev, None)
        return torch.sigmoid(self.confidence_logits(block.hidden.to(self.dtype), context))

    def _loss(self, out, labels, at, ce, gamma, progress):
        """CE(z + b) + λ_conf · BCE(confidence, [argmax(z + b) == y]), both position-weighted.

        SpecForge's total is 0.1·CE + 0.9·||p_d - p_t||_1 + BCE against the soft 1 - TV(p_d, p_t); it needs
        the target's distribution p_t, which this interface does not have, so the confidence target here
        is the hard per-position event "the corrected argmax at i is the true token" (teacher-forced).
        No schedule: `progress` is not read.
        """
        markov, _ = dflash_ce(out.scores, at, gamma)
        conf = self.confidence_logits(out.hidden, out.context)  # (N, n)
        right = (out.scores.detach().argmax(-1) == at).to(conf.dtype)
        w = self.weights(labels, gamma)
        bce = (F.binary_cross_entropy_with_logits(conf, right, reduction="none") * w).sum() / mean_denominator(w.sum(), 1e-8)
        return markov + self.config.lambda_conf * bce, {"markov_ce": markov, "conf_bce": bce}


HEADS: dict[str, type[RepairHead]] = {cls.name: cls for cls in (DFlash2Selector, DominoHead, DSparkHead)}
