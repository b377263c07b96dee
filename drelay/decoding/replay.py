"""Replay: the decode loop simulated along the target's own continuation (teacher-forced).

At T=0 a lossless decoder commits exactly the target's greedy continuation, so running
anchor -> draft -> repair -> accept -> next anchor along a distilled sequence gives the same
acceptance lengths as live decoding, without running the target. One context pass per batch of
sequences serves every step; being teacher-forced, each anchor's block is independent of the steps before it,
so the blocks of several anchors per sequence are drafted and repaired in one pass and the loop then walks their
acceptance lengths. Any repair method plugs in (the same `DraftBlock -> tokens` hook as the live engine,
drelay/models/repair.py); each block
carries the true tokens, so the oracle method picks the true token whenever it is in the pool (the
upper bound for any repair).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drelay.data.records import IGNORE, Sequence, block_labels, pad_sequences
from drelay.models.drafter import BlockDrafter
from drelay.models.repair import DraftBlock, Repair

_COUNTERS = ("accepted_at", "reached", "pool_hit", "replaced_at", "replaced_right_at", "harmed_at")


@dataclass
class ReplayStats:
    taus: list[float] = field(default_factory=list)  # per sequence: mean (accepted + 1) per step
    accept_lengths: list[list[int]] = field(default_factory=list)  # per sequence, per step
    steps: int = 0
    accepted_at: torch.Tensor | None = None  # (B-1,) blocks whose draft i was accepted
    reached: torch.Tensor | None = None  # (B-1,) blocks where position i was checked (prefix correct)
    pool_hit: torch.Tensor | None = None  # (B-1,) reached positions whose true token was in the pool
    replaced_at: torch.Tensor | None = None  # (B-1,) reached drafts that differ from the native top-1
    replaced_right_at: torch.Tensor | None = None  # (B-1,) ... and equal the true token
    harmed_at: torch.Tensor | None = None  # (B-1,) ... where the native top-1 was the true token

    @property
    def tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    @property
    def replaced(self) -> int:
        return int(self.replaced_at.sum()) if self.replaced_at is not None else 0

    @property
    def replaced_right(self) -> int:
        return int(self.replaced_right_at.sum()) if self.replaced_right_at is not None else 0

    @property
    def harmed(self) -> int:
        return int(self.harmed_at.sum()) if self.harmed_at is not None else 0

    @property
    def positions(self) -> int:  # reached positions
        return int(self.reached.sum()) if self.reached is not None else 0

    def merge(self, other: "ReplayStats") -> "ReplayStats":
        """Both runs' statistics as one (e.g. several benchmarks' replays pooled)."""
        def add(a, b):
            return b.clone() if a is None else a if b is None else a + b
        return ReplayStats(self.taus + other.taus, self.accept_lengths + other.accept_lengths,
                           self.steps + other.steps,
                           *(add(getattr(self, f), getattr(other, f)) for f in _COUNTERS))

    def summary(self, prefix: str = "") -> dict[str, float]:
        out = {f"{prefix}tau": self.tau, f"{prefix}steps": float(self.steps)}
        if self.reached is not None:
            reached = self.reached.clamp(min=1)
            replaced = self.replaced_at.clamp(min=1)
            per_position = {"accept": self.accepted_at / reached, "pool_hit": self.pool_hit / reached,
                            "replace_rate": self.replaced_at / reached,
                            "repair_precision": self.replaced_right_at / replaced,
                            "harm_rate": self.harmed_at / reached}
            for name, values in per_position.items():
                for i, value in enumerate(values.tolist()):
                    out[f"{prefix}{name}_pos{i + 1}"] = value
            out[f"{prefix}pool_hit"] = float(self.pool_hit.sum() / self.reached.sum().clamp(min=1))
            out[f"{prefix}replace_rate"] = self.replaced / max(self.positions, 1)
            out[f"{prefix}repair_precision"] = self.replaced_right / max(self.replaced, 1)
            out[f"{prefix}harm_rate"] = self.harmed / max(self.positions, 1)
        return out


@dataclass
class ReplayBlocks:
    """The drafter's block at every anchor of every sequence (positions prompt_len .. len-2), computed once
    for replays that differ only in the repair hook (δ tuning: one drafter pass instead of one per δ).
    Blocks carry no logits (a full-vocabulary hook cannot use them): hidden, pool ids and log-probs only."""

    sequences: list[Sequence]
    block_size: int
    pool_size: int
    hidden: list[torch.Tensor | None]  # per sequence (A, B-1, H); None: a response too short to replay
    pool_ids: list[torch.Tensor | None]  # (A, B-1, k)
    pool_logprobs: list[torch.Tensor | None]  # (A, B-1, k)

    def batch(self, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks of sequences `indices`, padded to the longest: (b, A, B-1, H), (b, A, B-1, k) x 2."""
        def stack(parts):
            A = max(p.shape[0] for p in parts)
            out = parts[0].new_zeros((len(parts), A, *parts[0].shape[1:]))
            for row, p in enumerate(parts):
                out[row, : p.shape[0]] = p
            return out.to(device)
        return tuple(stack([getattr(self, name)[i] for i in indices]) for name in ("hidden", "pool_ids", "pool_logprobs"))


def _batches(sequences: list[Sequence], batch_size: int, device):
    """Batches of the sequences with >= 2 response tokens: their indices, the sequences, and padded features,
    tokens and lengths on `device`."""
    for start in range(0, len(sequences), batch_size):
        rows = [i for i in range(start, min(start + batch_size, len(sequences))) if sequences[i].response_len >= 2]
        if rows:
            seqs = [sequences[i] for i in rows]
            yield (rows, seqs, *(t.to(device) for t in pad_sequences(seqs)))


@torch.no_grad()
def precompute_blocks(drafter: BlockDrafter, sequences: list[Sequence], block_size: int | None = None,
                      pool_size: int = 8, batch_size: int = 16, anchors_per_pass: int = 8) -> ReplayBlocks:
    """`ReplayBlocks` of `sequences`: every anchor's block, `anchors_per_pass` anchors of each sequence per
    drafter pass (each block sees only its own context, exactly as in `replay`)."""
    B = block_size or drafter.config.block_size
    device = drafter.fc.weight.device
    out = ReplayBlocks(sequences, B, pool_size, [None] * len(sequences), [None] * len(sequences),
                       [None] * len(sequences))
    for rows, seqs, features, tokens, lengths in _batches(sequences, batch_size, device):
        b, T = tokens.shape
        ctx_kv = drafter.context_kv(features, torch.arange(T, device=device).expand(b, T))
        first = torch.tensor([s.prompt_len for s in seqs], device=device)
        count = lengths - 1 - first  # anchors prompt_len .. len-2 of each sequence
        parts: list[list[tuple]] = [[] for _ in seqs]
        for offset in range(0, int(count.max()), anchors_per_pass):
            steps = torch.arange(offset, offset + anchors_per_pass, device=device)
            a = (first[:, None] + steps).clamp(max=T - 2)  # (b, c); past a sequence's end: computed, dropped
            hidden = drafter.forward_anchored(ctx_kv, a, tokens.gather(1, a), B)  # (b, c, B-1, H)
            _, pool_ids, pool_logprobs = drafter.pool(hidden, pool_size, with_logits=False)
            for row in range(b):
                keep = int((count[row] - offset).clamp(min=0, max=anchors_per_pass))
                if keep:
                    parts[row].append((hidden[row, :keep].cpu(), pool_ids[row, :keep].cpu(),
                                       pool_logprobs[row, :keep].cpu()))
        for row, i in enumerate(rows):
            out.hidden[i], out.pool_ids[i], out.pool_logprobs[i] = (torch.cat(t) for t in zip(*parts[row]))
    return out


@torch.no_grad()
def replay(drafter: BlockDrafter, sequences: list[Sequence], block_size: int | None = None, pool_size: int = 8,
           repair: Repair | None = None, batch_size: int = 16, max_steps: int | None = None,
           blocks: ReplayBlocks | None = None, verify_size: int | None = None,
           anchors_per_pass: int = 32) -> ReplayStats:
    """Acceptance statistics of a method along each sequence's response (anchor starts at P).
    `repair`: a repair method or any `DraftBlock -> tokens` hook; None: the native top-1.
    `blocks`: these sequences' precomputed blocks (`precompute_blocks`): no drafter pass here.
    `verify_size`: as the live engine's (SpeculativeDecoder): the whole block is drafted and repaired, the first
    verify_size - 1 drafts are checked (None or 0: all); later positions are never reached.

    Teacher forcing makes every anchor's block independent of the steps before it (its context is the
    sequence's own prefix), so the blocks of `anchors_per_pass` anchors of each sequence are drafted, repaired
    and checked in one batch, and the decode loop is then walked over the per-anchor acceptance lengths (anchor
    a -> a + accepted + 1): the statistics of the blocks the loop visits, in far fewer and larger drafter passes
    than one block per sequence per step. A hook must judge each block on its own (every repair method does)."""
    B = block_size or drafter.config.block_size
    V = verify_size or B
    if not 2 <= V <= B:
        raise ValueError(f"verify_size must be in [2, {B}] (anchor + at least one draft, at most the block), got {V}")
    if blocks is not None and (blocks.sequences is not sequences or blocks.block_size != B
                               or blocks.pool_size != pool_size):
        raise ValueError("precomputed blocks were made for other sequences, block size or pool size")
    stats = ReplayStats(**{name: torch.zeros(B - 1) for name in _COUNTERS})
    device = drafter.fc.weight.device
    verified = torch.arange(B - 1, device=device)[None] < V - 1  # (1, B-1): the drafts the target checks
    wants_logits = repair is not None and getattr(repair, "needs_logits", True)  # a plain hook: give them
    widen = not getattr(repair, "narrow_logits", False)  # V-wide unless the method takes the draft vocabulary's
    for rows, seqs, features, tokens, lengths in _batches(sequences, batch_size, device):
        b, T = tokens.shape
        if blocks is None:
            ctx_kv = drafter.context_kv(features, torch.arange(T, device=device).expand(b, T))
        else:
            cached = blocks.batch(rows, device)
        first = torch.tensor([s.prompt_len for s in seqs], device=device)
        count = lengths - 1 - first  # anchors prompt_len .. len-2 of each sequence
        accept_parts: list[list[torch.Tensor]] = [[] for _ in seqs]
        counter_parts: list[list[torch.Tensor]] = [[] for _ in seqs]
        for offset in range(0, int(count.max()), anchors_per_pass):
            a = (first[:, None] + torch.arange(offset, offset + anchors_per_pass, device=device)).clamp(max=T - 2)
            c = a.shape[1]  # (b, c) anchors; past a sequence's end: computed, dropped
            if blocks is None:
                hidden = drafter.forward_anchored(ctx_kv, a, tokens.gather(1, a), B).flatten(0, 1)  # (b c, B-1, H)
                logits, pool_ids, pool_logprobs = drafter.pool(hidden, pool_size, wants_logits, widen)
                logits = None if logits is None else logits.float()
            else:
                j = torch.minimum(a - first[:, None], (count - 1).clamp(min=0)[:, None])  # the anchor's index
                hidden, pool_ids, pool_logprobs = (t[torch.arange(b, device=device)[:, None], j].flatten(0, 1)
                                                   for t in cached)
                logits = None
            labels = block_labels(tokens, lengths, a, B).flatten(0, 1)  # (b c, B-1)
            block = DraftBlock(tokens.gather(1, a).flatten(), a.flatten(), hidden, logits, pool_ids, pool_logprobs,
                               labels, checked=V - 1, logit_ids=drafter.logit_ids(widen))
            draft = pool_ids[..., 0] if repair is None else repair(block)
            checked = (labels != IGNORE) & verified
            prefix_ok = torch.cumprod(((draft == labels) & checked).long(), dim=1)  # (b c, B-1): accepted positions
            reached = torch.cat([torch.ones_like(prefix_ok[:, :1]), prefix_ok[:, :-1]], 1).bool() & checked
            native = pool_ids[..., 0]
            replaced = (draft != native) & reached
            counters = torch.stack([prefix_ok.bool(), reached, (pool_ids == labels[..., None]).any(-1) & reached,
                                    replaced, replaced & (draft == labels), replaced & (native == labels)], 1)
            accept_len, counters = prefix_ok.sum(1).view(b, c).cpu(), counters.view(b, c, *counters.shape[1:]).cpu()
            for row in range(b):
                keep = int((count[row] - offset).clamp(min=0, max=c))
                if keep:
                    accept_parts[row].append(accept_len[row, :keep])
                    counter_parts[row].append(counters[row, :keep])
        for row in range(b):  # the decode loop over the anchors' acceptance lengths
            if not accept_parts[row]:
                continue
            accept, counters = torch.cat(accept_parts[row]).tolist(), torch.cat(counter_parts[row])
            visited, j = [], 0
            while j < len(accept) and (max_steps is None or len(visited) < max_steps):
                visited.append(j)
                j += accept[j] + 1
            totals = counters[visited].sum(0).float()  # (6, B-1)
            for k, name in enumerate(_COUNTERS):
                getattr(stats, name).add_(totals[k])
            lengths_run = [accept[v] for v in visited]
            stats.steps += len(visited)
            stats.taus.append(sum(lengths_run) / max(len(visited), 1) + 1)
            stats.accept_lengths.append(lengths_run)
    return stats
