"""Exact T=0 evaluation by replay (DESIGN §1.8): the target's own greedy continuation of each
benchmark prompt is generated once (with its context features, like distillation), then every
method's decode loop is simulated along it. A lossless greedy decoder commits exactly that
continuation, so the acceptance lengths are the live ones, and all methods are scored on identical
blocks from one target pass per prompt.

Continuations are stored like distilled data (`<dir>/<benchmark>/turn<t>/`, resumable shards), so a
second evaluation with the same target and settings reuses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from drelay.data.benchmarks import BenchmarkSample, conversation
from drelay.data.records import Sequence, load_distilled
from drelay.decoding.replay import ReplayStats, replay
from drelay.models.methods import Speculator
from drelay.models.target import Target
from drelay.training.distill import distill


def continuations(target: Target, samples: list[BenchmarkSample], out_dir: str | Path, *, max_new_tokens: int,
                  max_prompt_tokens: int, batch_size: int = 16, turns: int | None = None, temperature: float = 0.0,
                  seed: int = 0, progress: Callable[[int, int], None] | None = None) -> list[Sequence]:
    """The target's continuation of every turn of every sample (greedy at T=0, sampled at `temperature`
    otherwise; turn t+1 follows the target's own answer to turn t), with context features for the layers
    `target` captures. Prompts longer than `max_prompt_tokens` are skipped. Returns turn 1 of every kept
    sample, then turn 2, ... Stored in shards of `batch_size` prompts: a killed run keeps finished ones."""
    return [seq for _, seq in _continue(target, samples, out_dir, max_new_tokens=max_new_tokens,
                                        max_prompt_tokens=max_prompt_tokens, batch_size=batch_size, turns=turns,
                                        temperature=temperature, seed=seed, progress=progress)]


def grouped_continuations(target: Target, groups: dict[str, list[BenchmarkSample]], out_dir: str | Path, *,
                          max_new_tokens: int, max_prompt_tokens: int, batch_size: int = 16, temperature: float = 0.0,
                          seed: int = 0, progress: Callable[[int, int], None] | None = None
                          ) -> dict[str, list[Sequence]]:
    """`continuations` of several groups of samples (e.g. one per benchmark) generated together, so that the
    target decodes up to `batch_size` rows at a time whatever the size of each group (64 rows decode several
    times faster per token than 8 on a CPU). Each group's list is what `continuations` of that group alone
    returns (turn 1 of its kept samples, then turn 2, ...). The shards hold every group's prompts: changing
    one group's samples regenerates them all."""
    owner = {id(sample): name for name, samples in groups.items() for sample in samples}
    out: dict[str, list[Sequence]] = {name: [] for name in groups}
    for sample, seq in _continue(target, [s for samples in groups.values() for s in samples], out_dir,
                                 max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                 batch_size=batch_size, temperature=temperature, seed=seed, progress=progress):
        out[owner[id(sample)]].append(seq)
    return out


def _continue(target: Target, samples: list[BenchmarkSample], out_dir: str | Path, *, max_new_tokens: int,
              max_prompt_tokens: int, batch_size: int, turns: int | None = None, temperature: float,
              seed: int, progress: Callable[[int, int], None] | None) -> list[tuple[BenchmarkSample, Sequence]]:
    """(sample, continuation) of every turn of `samples`, turn by turn (see `continuations`)."""
    out_dir = Path(out_dir)
    answers: dict[int, list[str]] = {id(s): [] for s in samples}
    live = list(samples)
    result: list[tuple[BenchmarkSample, Sequence]] = []
    n_turns = max((len(s.turns) for s in samples), default=0) if turns is None else turns
    for turn in range(n_turns):
        live = [s for s in live if len(s.turns) > turn and len(answers[id(s)]) == turn]
        prompts, kept = [], []
        for sample in live:
            ids = target.encode_chat(conversation(sample, answers[id(sample)]))
            if len(ids) <= max_prompt_tokens:
                prompts.append(ids)
                kept.append(sample)
        if not prompts:
            break
        folder = out_dir / f"turn{turn + 1}"
        distill(target, prompts, folder, max_new_tokens=max_new_tokens, batch_size=batch_size,
                shard_size=batch_size, temperature=temperature, seed=seed + turn, stop_ids=target.stop_token_ids(),
                settings={"target": target.fingerprint(), "layers": list(target.layer_ids)}, progress=progress)
        seqs = load_distilled(folder)
        stop = set(target.stop_token_ids())
        for sample, seq in zip(kept, seqs):
            reply = [t for t in seq.tokens[seq.prompt_len:].tolist() if t not in stop]
            answers[id(sample)].append(target.tokenizer.decode(reply, skip_special_tokens=True))
        result.extend(zip(kept, seqs))
        live = kept
    return result


@torch.no_grad()
def replay_methods(methods: dict[str, Speculator], sequences: list[Sequence], pool_size: int,
                   autocast: bool = True, verify_size: int = 0) -> dict[str, ReplayStats]:
    """Every method replayed on the same sequences (bf16 autocast, as in training, when `autocast`);
    `verify_size` drafts checked per step as in the live engine (0: the whole block)."""
    out = {}
    for name, spec in methods.items():
        device = spec.drafter.fc.weight.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out[name] = replay(spec.drafter, sequences, pool_size=pool_size,
                               repair=spec.method if spec.method.repairs else None, verify_size=verify_size)
    return out
