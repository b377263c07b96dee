"""Live decoding against plain AR on the same prompts in the same process: τ, tokens/s, speedup, the
identical-output check, and where a step's wall time goes (draft / repair / verify).

At T=0 in low precision a method's output may part from AR's at a near-tie of the target's top-2
logits (counted); any other divergence is an engine bug and raises `LosslessnessError`. At T > 0
every method samples with its own generator seeded like AR's; outputs are not compared (they are
equal in distribution, not token for token).

A method that reads the truth (the oracle) runs live at T=0 only: the engine hands it AR's greedy
output of the same prompt, and it picks that token whenever it is in the pool, at no repair cost.
"""

from __future__ import annotations

import statistics
from typing import Iterable

import torch
from tqdm import tqdm

from drelay.decoding.check import compare_to_ar
from drelay.decoding.generate import ar_generate, speculative_generate
from drelay.models.methods import Speculator
from drelay.models.target import Target


class LosslessnessError(RuntimeError):
    """A T=0 output that diverged from AR decoding where rounding cannot explain it."""


def live_prompt(target: Target, methods: dict[str, Speculator], prompt_ids: list[int], max_new_tokens: int,
                pool_size: int = 8, temperature: float = 0.0, seed: int = 0,
                sampling_rule: str = "residual", verify_size: int = 0) -> dict[str, dict]:
    """AR, then every method, on one prompt. Returns {"ar": {...}, method: {...}} of plain numbers:
    tokens/s, τ, step-time split and (T=0) the identical-output check with its divergence, if any.
    `verify_size`: tokens the target checks per step (0: the drafter's whole block)."""
    stop = target.stop_token_ids()

    def generator() -> torch.Generator | None:
        return torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None

    ar = ar_generate(target, prompt_ids, max_new_tokens, temperature, stop_token_ids=stop, generator=generator())
    out = {"ar": {"tokens_per_s": ar.stats.tokens_per_s, "new_tokens": ar.stats.new_tokens, "wall_s": ar.stats.wall_s}}
    for name, spec in methods.items():
        reference = ar.tokens if spec.method.needs_truth else None  # the oracle reads AR's output (T = 0)
        res = speculative_generate(target, spec.drafter, prompt_ids, max_new_tokens, method=spec.method,
                                   temperature=temperature, pool_size=pool_size, stop_token_ids=stop,
                                   sampling_rule=sampling_rule, generator=generator(), reference=reference,
                                   verify_size=verify_size)
        s = res.stats
        record = {"tau": s.tau, "tokens_per_s": s.tokens_per_s, "new_tokens": s.new_tokens, "wall_s": s.wall_s,
                  "steps": s.steps, "draft_s": s.draft_s, "repair_s": s.repair_s, "verify_s": s.verify_s}
        if temperature == 0:
            report = compare_to_ar(target, prompt_ids, ar.tokens, res.tokens)
            if report.is_bug:
                raise LosslessnessError(f"{name}: output diverged from AR decoding without a near-tie: "
                                        f"{report.describe()}")
            record |= {"identical": report.identical, "near_tie": bool(report.near_tie),
                       "divergence": report.describe() if not report.identical else None}
        out[name] = record
    return out


def summarize_live(records: list[dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Per-prompt records of `live_prompt` -> {method: metrics}, `ar_tokens_per_s` in each.

    Speedup is mean tokens/s of the method over mean tokens/s of AR on the same prompts. A step's time
    splits into draft (drafter forward + pool), repair (the method's hook) and verify (target forward
    + acceptance + cache bookkeeping): `live_repair_share` is the selector's share of a step.

    The cost model's inputs: `live_step_ms` (a step's mean time) and `ar_ms_per_token` (AR's), so
    that speedup ≈ τ · ar_ms_per_token / live_step_ms for any τ (`predicted_speedup`); the live
    prompts' own spread is `live_speedup_min` / `live_speedup_max` (per prompt, method over AR)."""
    if not records:
        return {}
    ar_mean = statistics.mean(r["ar"]["tokens_per_s"] for r in records)
    ar_ms = 1000 * sum(r["ar"]["wall_s"] for r in records) / max(sum(r["ar"]["new_tokens"] for r in records), 1)
    out = {}
    for name in (n for n in records[0] if n != "ar"):
        rows = [r[name] for r in records]
        step_s = sum(x["draft_s"] + x["repair_s"] + x["verify_s"] for x in rows) or 1.0
        steps = sum(x["steps"] for x in rows)
        tps = statistics.mean(x["tokens_per_s"] for x in rows)
        per_prompt = [x["tokens_per_s"] / r["ar"]["tokens_per_s"] for x, r in zip(rows, records)
                      if r["ar"]["tokens_per_s"]]
        summary = {"live_tau": statistics.mean(x["tau"] for x in rows), "live_tokens_per_s": tps,
                   "live_speedup": tps / ar_mean if ar_mean else 0.0,
                   "live_speedup_min": min(per_prompt, default=0.0), "live_speedup_max": max(per_prompt, default=0.0),
                   "live_draft_share": sum(x["draft_s"] for x in rows) / step_s,
                   "live_repair_share": sum(x["repair_s"] for x in rows) / step_s,
                   "live_verify_share": sum(x["verify_s"] for x in rows) / step_s,
                   "live_step_ms": 1000 * step_s / max(steps, 1), "ar_ms_per_token": ar_ms,
                   "live_steps": steps, "live_prompts": len(rows),
                   "ar_tokens_per_s": ar_mean}
        if "identical" in rows[0]:
            summary |= {"live_identical_rate": sum(x["identical"] for x in rows) / len(rows),
                        "live_near_tie_divergences": sum(x["near_tie"] for x in rows)}
        out[name] = summary
    return out


def predicted_speedup(tau: float, live: dict[str, float]) -> float:
    """The cost model: τ tokens per step of `live_step_ms`, against AR's `ar_ms_per_token` (DESIGN §1.8:
    a step = draft + repair + verify, measured live; τ may come from replay over many more prompts)."""
    return tau * live["ar_ms_per_token"] / live["live_step_ms"] if live.get("live_step_ms") else 0.0


def live_compare(target: Target, methods: dict[str, Speculator], prompts: Iterable[list[int]], max_new_tokens: int,
                 pool_size: int = 8, desc: str = "live decoding", temperature: float = 0.0,
                 seed: int = 0) -> dict[str, dict[str, float]]:
    """`live_prompt` on each prompt (token ids), one after the other, so all methods see the same
    machine state; `summarize_live` of the lot. {} for no prompts."""
    records = [live_prompt(target, methods, ids, max_new_tokens, pool_size, temperature, seed + i)
               for i, ids in enumerate(tqdm(list(prompts), desc=desc, unit="prompt", dynamic_ncols=True))]
    return summarize_live(records)
