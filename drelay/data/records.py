"""The records every layer shares: distilled sequences (and their shard files) and training blocks.

A sequence is the target's own text for one prompt: token ids (prompt + response), the prompt length
and the raw outputs of the drafter's context layers at every position (the last row is zeros: a
block anchored at position a reads positions < a only). Sequences live in safetensors shards written
atomically, listed by a manifest written last.

A block is anchored at a response position a (the anchor is a committed token, P <= a <= T-2):
its context is the target features at positions < a, its input [tokens[a], MASK, ...], and its
labels the target's own tokens tokens[a+1 .. a+B-1] (IGNORE past the sequence end).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"  # written last: its presence means the distillation finished
SETTINGS = "settings.json"  # what the shards were made with; other settings start over


@dataclass
class Sequence:
    tokens: torch.Tensor  # (T,) int64: prompt + response
    prompt_len: int  # P: response tokens are tokens[P:]
    features: torch.Tensor  # (T, m*H) raw context-layer outputs; row T-1 is zeros

    @property
    def response_len(self) -> int:
        return self.tokens.shape[0] - self.prompt_len



def save_shard(sequences: list[Sequence], path: Path, feature_dtype: torch.dtype) -> None:
    lengths = torch.tensor([s.tokens.shape[0] for s in sequences])
    tensors = {
        "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int32),
        "features": torch.cat([s.features for s in sequences]).to(feature_dtype).contiguous(),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in sequences]),
    }
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, tmp)
    tmp.rename(path)


def load_shard(path: Path) -> list[Sequence]:
    try:
        t = load_file(path)
    except Exception as err:  # safetensors raises several types on truncated files
        raise ValueError(f"corrupt distilled shard {path}: {err}; delete it and rerun distill") from err
    offsets = t["offsets"].tolist()
    return [Sequence(t["tokens"][s:e].long(), int(p), t["features"][s:e])
            for s, e, p in zip(offsets[:-1], offsets[1:], t["prompt_lens"].tolist())]


def load_distilled(out_dir: str | Path) -> list[Sequence]:
    """Every sequence of a finished distillation, in shard order."""
    out_dir = Path(out_dir)
    manifest = out_dir / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"no finished distillation in {out_dir} ({MANIFEST} missing): run the distill stage")
    info = json.loads(manifest.read_text())
    return [seq for name in info["shards"] for seq in load_shard(out_dir / name)]



def summarize(out_dir: Path, shards: list[str]) -> dict:
    """Counts from the shards' small index tensors (the features are not read)."""
    n_seq = n_resp = n_total = 0
    for name in shards:
        with safe_open(str(out_dir / name), framework="pt") as f:
            offsets, prompt_lens = f.get_tensor("offsets"), f.get_tensor("prompt_lens")
        lengths = offsets[1:] - offsets[:-1]
        n_seq += len(lengths)
        n_total += int(lengths.sum())
        n_resp += int((lengths - prompt_lens).sum())
    return {"sequences": n_seq, "response_tokens": n_resp, "total_tokens": n_total,
            "mean_response_tokens": n_resp / n_seq if n_seq else 0.0}


def response_token_counts(sequences: list[Sequence], vocab_size: int) -> torch.Tensor:
    """(V,) how often each token id occurs in the sequences' responses."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.tokens[s.prompt_len:].long(), minlength=vocab_size)[:vocab_size]
    return counts


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
