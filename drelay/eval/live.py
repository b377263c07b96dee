"""Live decoding against plain AR on the same prompts in the same process: τ, tokens/s, speedup, the
identical-output check, and where a step's wall time goes (draft / repair / verify).

At T=0 in low precision a method's output may part from AR's at a near-tie of the target's top-2
logits (counted); any other divergence is an engine bug and raises `LosslessnessError`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable

from tqdm import tqdm

from drelay.decoding.check import compare_to_ar
from drelay.decoding.generate import GenerationStats, Repair, ar_generate, speculative_generate
from drelay.models.drafter import BlockDrafter
from drelay.models.target import Target


class LosslessnessError(RuntimeError):
    """A T=0 output that diverged from AR decoding where rounding cannot explain it."""


@dataclass
class LiveMethod:
    """One method of a live comparison: its drafter and its repair hook (None: the native top-1)."""

    drafter: BlockDrafter
    repair: Repair | None = None


@dataclass
class _Tally:
    stats: list[GenerationStats] = field(default_factory=list)
    identical: int = 0
    near_ties: int = 0

    def summary(self, ar_tokens_per_s: float) -> dict[str, float]:
        s = self.stats
        step_s = sum(x.draft_s + x.repair_s + x.verify_s for x in s) or 1.0
        tps = statistics.mean(x.tokens_per_s for x in s)
        return {"live_tau": statistics.mean(x.tau for x in s), "live_tokens_per_s": tps,
                "live_speedup": tps / ar_tokens_per_s if ar_tokens_per_s else 0.0,
                "live_identical_rate": self.identical / len(s), "live_near_tie_divergences": self.near_ties,
                "live_draft_share": sum(x.draft_s for x in s) / step_s,
                "live_repair_share": sum(x.repair_s for x in s) / step_s,
                "live_verify_share": sum(x.verify_s for x in s) / step_s,
                "live_steps": sum(x.steps for x in s), "live_prompts": len(s)}


def live_compare(target: Target, methods: dict[str, LiveMethod], prompts: Iterable[list[int]], max_new_tokens: int,
                 pool_size: int = 8, desc: str = "live decoding") -> dict[str, dict[str, float]]:
    """Greedy AR and every method on each prompt (token ids), one after the other, so all see the
    same machine state. Returns {method: metrics} with `ar_tokens_per_s` in each; {} for no prompts.

    Speedup is mean tokens/s of the method over mean tokens/s of AR on the same prompts. A step's time
    splits into draft (drafter forward + pool), repair (the method's hook) and verify (target forward
    + acceptance + cache bookkeeping): `live_repair_share` is the selector's share of a step."""
    stop = target.stop_token_ids()
    tallies, ar_tps = {name: _Tally() for name in methods}, []
    for ids in tqdm(list(prompts), desc=desc, unit="prompt", dynamic_ncols=True):
        ar = ar_generate(target, ids, max_new_tokens, stop_token_ids=stop)
        ar_tps.append(ar.stats.tokens_per_s)
        for name, method in methods.items():
            out = speculative_generate(target, method.drafter, ids, max_new_tokens, stop_token_ids=stop,
                                       repair=method.repair, pool_size=pool_size)
            report = compare_to_ar(target, ids, ar.tokens, out.tokens)
            if report.is_bug:
                raise LosslessnessError(f"{name}: output diverged from AR decoding without a near-tie: "
                                        f"{report.describe()}")
            tally = tallies[name]
            tally.stats.append(out.stats)
            tally.identical += report.identical
            tally.near_ties += bool(report.near_tie)
    if not ar_tps:
        return {}
    ar_mean = statistics.mean(ar_tps)
    return {name: {**tally.summary(ar_mean), "ar_tokens_per_s": ar_mean} for name, tally in tallies.items()}
