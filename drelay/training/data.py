"""Training blocks drawn from distilled sequences.

A block is anchored at a response position a (the anchor is a committed token, P <= a <= T-2):
its context is the target features at positions < a, its input [tokens[a], MASK, ...], and its
labels the target's own tokens tokens[a+1 .. a+B-1] (-100 past the sequence end).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from drelay.training.distill import Sequence

IGNORE = -100


@dataclass
class BlockBatch:
    features: torch.Tensor  # (b, T, m*H) context features, zero-padded
    tokens: torch.Tensor  # (b, T) token ids, padded with 0
    lengths: torch.Tensor  # (b,) true T of each sequence
    anchors: torch.Tensor  # (b, nA) anchor positions
    anchor_ids: torch.Tensor  # (b, nA) anchor tokens
    labels: torch.Tensor  # (b, nA, B-1) target tokens, IGNORE where past the end

    def to(self, device) -> "BlockBatch":
        return BlockBatch(*(t.to(device) for t in (self.features, self.tokens, self.lengths,
                                                   self.anchors, self.anchor_ids, self.labels)))


def usable(sequences: list[Sequence]) -> list[Sequence]:
    """Sequences with at least one anchor (a response of two tokens or more)."""
    return [s for s in sequences if s.response_len >= 2]


def pad_sequences(seqs: list[Sequence]):
    T = max(s.tokens.shape[0] for s in seqs)
    features = torch.zeros(len(seqs), T, seqs[0].features.shape[-1], dtype=seqs[0].features.dtype)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = s.tokens.shape[0]
        features[i, :n], tokens[i, :n] = s.features, s.tokens
    return features, tokens, torch.tensor([s.tokens.shape[0] for s in seqs])


def block_labels(tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(b, T) tokens, (b, nA) anchors -> (b, nA, B-1) labels tokens[a+i], IGNORE past each end."""
    idx = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)  # (b, nA, B-1)
    valid = idx < lengths[:, None, None]
    labels = tokens.gather(1, idx.clamp(max=tokens.shape[1] - 1).flatten(1)).view(idx.shape)
    return torch.where(valid, labels, torch.full_like(labels, IGNORE))


def make_batch(seqs: list[Sequence], anchors_per_sequence: int, block_size: int, rng: random.Random) -> BlockBatch:
    """Random anchors (with replacement when a response is short) from each sequence."""
    features, tokens, lengths = pad_sequences(seqs)
    anchors = torch.tensor([[rng.randint(s.prompt_len, s.tokens.shape[0] - 2) for _ in range(anchors_per_sequence)]
                            for s in seqs])
    anchor_ids = tokens.gather(1, anchors)
    return BlockBatch(features, tokens, lengths, anchors, anchor_ids, block_labels(tokens, lengths, anchors, block_size))
