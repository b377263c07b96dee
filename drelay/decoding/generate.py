"""Decoding loops: plain autoregressive decoding and speculative decoding with draft repair.

One speculative step (DESIGN §1, batch rows independent; the loop here runs batch 1):

    committed: x_0 .. x_{n-1}, anchor = x_{n-1} (sampled by the target, not yet fed to it)
    draft    : drafter([anchor, MASK..]) -> logits z_1..z_{B-1} -> pool (top-k) -> repair -> d_1..d_{B-1}
    verify   : target([anchor, d_1..d_{B-1}]) -> rows 0..B-1; accept a prefix of length a,
               then one token from row a (correction, or bonus when a = B-1)
    commit   : d_1..d_a, next; crop the target cache by the B-1-a rejected positions; feed the
               features of anchor, d_1..d_a (now committed) to the drafter's context cache
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from drelay.decoding.verify import rejection_accept, residual_noise, sample_tokens
from drelay.kernels.ops import kernel_ops
from drelay.kernels.acceptance import target_probs
from drelay.models.cpu_linear import decoding_products
from drelay.models.drafter import BlockDrafter, DraftContextCache
from drelay.models.repair import DraftBlock, RepairMethod
from drelay.models.target import Target


class ContextTooLongError(ValueError):
    """A prompt (plus the tokens asked for) longer than the target's context."""


@dataclass
class GenerationStats:
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per verify step
    new_tokens: int = 0
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter forward + pool
    repair_s: float = 0.0  # selector / head
    verify_s: float = 0.0  # target forward + acceptance + cache bookkeeping
    wall_s: float = 0.0  # whole call, prefill included

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification step: accepted drafts + 1 (DESIGN §1.8)."""
        return sum(self.accept_lengths) / self.steps + 1 if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "tau": round(self.tau, 4),
                "tokens_per_s": round(self.tokens_per_s, 2), "wall_s": round(self.wall_s, 4),
                "prefill_s": round(self.prefill_s, 4), "draft_s": round(self.draft_s, 4),
                "repair_s": round(self.repair_s, 4), "verify_s": round(self.verify_s, 4)}


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only (the prompt excluded), stop token included if hit
    stats: GenerationStats


def check_context(target: Target, prompt_len: int, max_new_tokens: int, lookahead: int = 0) -> None:
    if prompt_len < 1:
        raise ValueError("the prompt must contain at least one token")
    need = prompt_len + max_new_tokens + lookahead
    if need > target.max_positions:
        raise ContextTooLongError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens (+{lookahead} for a draft block) "
            f"exceeds the target's context of {target.max_positions} positions")


def _truncate(tokens: list[int], stop_token_ids, limit: int) -> tuple[list[int], bool]:
    """Cut at the first stop token (kept) or at `limit` tokens; returns (tokens, finished)."""
    for i, tok in enumerate(tokens[:limit]):
        if tok in stop_token_ids:
            return tokens[: i + 1], True
    return tokens[:limit], len(tokens) >= limit


@decoding_products()
def ar_generate(target: Target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                stop_token_ids=(), generator: torch.Generator | None = None) -> GenerationResult:
    """Plain autoregressive decoding of the target alone: the reference every method must match."""
    check_context(target, len(prompt_ids), max_new_tokens)
    target.measure_few_row_orders()  # once per process, before the timer (cpu_linear.py's auto mode)
    stats, stop = GenerationStats(prompt_tokens=len(prompt_ids)), set(stop_token_ids)
    start = time.perf_counter()
    cache = target.new_cache()
    logits = target.forward(torch.tensor([prompt_ids], device=target.device), cache,
                            logits_to_keep=1, capture=False).logits[:, -1]
    stats.prefill_s = time.perf_counter() - start
    tokens: list[int] = []
    while True:
        token = sample_tokens(logits, temperature, generator)
        tokens.append(int(token))
        if tokens[-1] in stop or len(tokens) >= max_new_tokens:
            break
        logits = target.forward(token[:, None], cache, capture=False).logits[:, -1]
    stats.new_tokens, stats.wall_s = len(tokens), time.perf_counter() - start
    stats.accept_lengths = [0] * max(len(tokens) - 1, 0)  # one token per target step
    return GenerationResult(tokens, stats)


@dataclass
class DecodeState:
    """Everything one speculative decoding run carries between steps (batch 1)."""

    target_cache: object
    draft_cache: DraftContextCache
    anchor: torch.Tensor  # (1,)
    anchor_pos: int
    tokens: list[int]  # committed new tokens, the anchor included
    prompt_len: int = 0


@dataclass
class StepRecord:
    draft_tokens: torch.Tensor  # (1, verify_size - 1): the verified drafts, after repair
    target_logits: torch.Tensor  # (1, verify_size, V) verification rows
    accept_len: int
    next_token: int


class SpeculativeDecoder:
    """Draft -> repair -> verify -> commit, with the target's and the drafter's caches kept in step.

    `method`: any repair method (drelay/models/repair.py); None verifies the native top-1 (DFlash).
    `reference`: the target's own new tokens for this prompt, for a method that reads the truth (the
    oracle, T = 0 only). `verify_size`: tokens per verification forward (the anchor and the first
    verify_size - 1 drafts after repair; None or 0: the whole block): the drafter still drafts and the method
    still repairs its whole block, so the drafts are the same, and the target checks fewer of them, which
    costs less per step when the late positions are rarely accepted. The fused ops are chosen once, here,
    for the target's device."""

    def __init__(self, target: Target, drafter: BlockDrafter, method: RepairMethod | None = None,
                 block_size: int | None = None, pool_size: int = 8, temperature: float = 0.0,
                 sampling_rule: str = "residual", generator: torch.Generator | None = None,
                 reference: list[int] | None = None, verify_size: int | None = None):
        self.target, self.drafter, self.method = target, drafter, method
        self.block_size = block_size or drafter.config.block_size
        if not 2 <= self.block_size <= drafter.config.block_size:
            raise ValueError(f"block_size must be in [2, {drafter.config.block_size}] (anchor + at least one "
                             f"draft, at most the drafter's block), got {self.block_size}")
        self.verify_size = verify_size or self.block_size
        if not 2 <= self.verify_size <= self.block_size:
            raise ValueError(f"verify_size must be in [2, {self.block_size}] (anchor + at least one draft, at most "
                             f"the drafted block), got {self.verify_size}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if method is not None and method.needs_truth and (reference is None or temperature > 0):
            raise ValueError(f"the {method.name} method reads the target's greedy output: pass `reference` "
                             f"(AR's new tokens) and decode at T = 0")
        self.pool_size, self.temperature = pool_size, temperature
        self.sampling_rule, self.generator = sampling_rule, generator
        self.reference = None if reference is None else torch.tensor(reference, dtype=torch.long)
        self.needs_logits = method is not None and method.needs_logits
        self.widen = method is None or not method.narrow_logits  # logits over all V, or the draft vocabulary's
        ops = kernel_ops(target.device)
        if temperature == 0:
            self.accept = ops.verify  # greedy: the verify op itself
        elif sampling_rule == "residual" and ops.fused:  # the verify kernel, fed the draws rejection_accept makes
            self.accept = self._fused_residual_accept
        else:
            self.accept = self._rejection_accept
        self._verify = ops.verify

    def start(self, prompt_ids: list[int], stats: GenerationStats | None = None) -> DecodeState:
        """Prefill the target (capturing context features) and sample the first token (the anchor)."""
        stats = stats or GenerationStats()
        t0 = time.perf_counter()
        target, device = self.target, self.target.device
        cache = target.new_cache()
        out = target.forward(torch.tensor([prompt_ids], device=device), cache, logits_to_keep=1)
        anchor = sample_tokens(out.logits[:, -1], self.temperature, self.generator)
        draft_cache = DraftContextCache(len(self.drafter.layers))
        positions = torch.arange(len(prompt_ids), device=device)[None]
        self.drafter.extend_context(draft_cache, out.features, positions)
        stats.prefill_s += time.perf_counter() - t0
        return DecodeState(cache, draft_cache, anchor, len(prompt_ids), [int(anchor)], len(prompt_ids))

    def _truth(self, state: DecodeState, n: int) -> torch.Tensor | None:
        """(1, n) the reference's tokens at the block's positions, -1 past its end (a method reading them)."""
        if self.reference is None:
            return None
        index = state.anchor_pos + 1 + torch.arange(n) - state.prompt_len  # new-token index of draft i
        known = (index >= 0) & (index < len(self.reference))
        truth = torch.where(known, self.reference[index.clamp(0, max(len(self.reference) - 1, 0))], -1)
        return truth[None].to(self.target.device)

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftBlock:
        """Drafter forward and candidate pool for the next block."""
        anchor_pos = torch.tensor([state.anchor_pos], device=self.target.device)
        hidden = self.drafter.draft_hidden(state.draft_cache, state.anchor, anchor_pos, self.block_size)
        logits, pool_ids, pool_logprobs = self.drafter.pool(hidden, self.pool_size, self.needs_logits,
                                                            self.widen)  # (b, B-1, k)
        return DraftBlock(state.anchor, anchor_pos, hidden, logits, pool_ids, pool_logprobs,
                          self._truth(state, self.block_size - 1), checked=self.verify_size - 1,
                          logit_ids=self.drafter.logit_ids(self.widen))

    def _fused_residual_accept(self, draft_tokens: torch.Tensor, target_logits: torch.Tensor):
        uniforms, noise = residual_noise(draft_tokens.shape, target_logits.shape[-1], self.generator,
                                         target_logits.device)
        return self._verify(draft_tokens, target_logits, self.temperature, uniforms, noise)

    def _rejection_accept(self, draft_tokens: torch.Tensor, target_logits: torch.Tensor):
        probs = target_probs(target_logits, self.temperature)
        return rejection_accept(draft_tokens, probs, self.generator, self.sampling_rule)

    @torch.inference_mode()
    def step(self, state: DecodeState, stats: GenerationStats | None = None) -> StepRecord:
        stats = stats or GenerationStats()
        t0 = time.perf_counter()
        block = self.propose(state)
        t1 = time.perf_counter()
        draft_tokens = block.pool_ids[..., 0] if self.method is None else self.method.select(block)
        t2 = time.perf_counter()

        n = self.verify_size - 1
        draft_tokens = draft_tokens[:, :n]  # the drafts the target checks
        inputs = torch.cat([state.anchor[:, None], draft_tokens], dim=1)  # (1, verify_size)
        positions = state.anchor_pos + torch.arange(self.verify_size, device=inputs.device)[None]
        out = self.target.forward(inputs, state.target_cache, position_ids=positions)
        accept_len, next_token = self.accept(draft_tokens, out.logits)
        a = int(accept_len[0])
        # Commit: the target cache keeps anchor + d_1..d_a; the drafter learns their features.
        self.target.crop(state.target_cache, n - a)
        self.drafter.extend_context(state.draft_cache, out.features[:, : a + 1], positions[:, : a + 1])
        state.tokens.extend(draft_tokens[0, :a].tolist() + [int(next_token[0])])
        state.anchor, state.anchor_pos = next_token, state.anchor_pos + a + 1
        stats.draft_s += t1 - t0
        stats.repair_s += t2 - t1
        stats.verify_s += time.perf_counter() - t2
        stats.accept_lengths.append(a)
        return StepRecord(draft_tokens, out.logits, a, int(next_token[0]))

    @decoding_products()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_token_ids=()) -> GenerationResult:
        check_context(self.target, len(prompt_ids), max_new_tokens, lookahead=self.block_size)
        self.target.measure_few_row_orders()  # once per process, before the timer (cpu_linear.py's auto mode)
        if self.method is not None:
            self.method.prepare_inference()  # its grad-free tables, before the timer (built once, then kept)
        stats, stop = GenerationStats(prompt_tokens=len(prompt_ids)), set(stop_token_ids)
        start = time.perf_counter()
        state = self.start(prompt_ids, stats)
        tokens, finished = _truncate(state.tokens, stop, max_new_tokens)
        while not finished:
            self.step(state, stats)
            tokens, finished = _truncate(state.tokens, stop, max_new_tokens)
        stats.new_tokens, stats.wall_s = len(tokens), time.perf_counter() - start
        return GenerationResult(tokens, stats)


def speculative_generate(target: Target, drafter: BlockDrafter, prompt_ids: list[int], max_new_tokens: int,
                         method: RepairMethod | None = None, block_size: int | None = None, temperature: float = 0.0,
                         pool_size: int = 8, stop_token_ids=(), sampling_rule: str = "residual",
                         generator: torch.Generator | None = None, reference: list[int] | None = None,
                         verify_size: int | None = None) -> GenerationResult:
    """Speculative decoding; `method=None` verifies the drafter's native top-1 (DFlash)."""
    decoder = SpeculativeDecoder(target, drafter, method, block_size, pool_size, temperature,
                                 sampling_rule, generator, reference, verify_size)
    return decoder.generate(prompt_ids, max_new_tokens, stop_token_ids)
