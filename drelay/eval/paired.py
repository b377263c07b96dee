"""Paired comparisons of two methods on the same samples: the difference of mean τ with a percentile
bootstrap interval over samples (issue: "a claim of 'ahead' needs the interval above 0").

Every method replays the same target continuations, so the per-sample τ of two methods are paired:
the difference d_s = τ_A(s) - τ_B(s) is resampled, not the two τ separately (which would ignore that
both are high on easy samples and low on hard ones, and give intervals several times too wide).
The mean over benchmarks is the mean of the per-benchmark means (each benchmark weighs the same, as in
the tables), so its bootstrap resamples within each benchmark and averages the resampled means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEAN = "mean"


@dataclass(frozen=True)
class Paired:
    """Mean difference A - B and its bootstrap interval; `n` samples (summed over benchmarks for the mean)."""

    diff: float
    low: float
    high: float
    n: int

    @property
    def ahead(self) -> bool:
        """A is ahead of B: the whole interval above 0."""
        return self.low > 0

    def as_dict(self) -> dict[str, float]:
        return {"diff": self.diff, "low": self.low, "high": self.high, "n": float(self.n)}


def paired_bootstrap(a: dict[str, list[float]], b: dict[str, list[float]], *, resamples: int = 2000,
                     level: float = 0.95, seed: int = 0) -> dict[str, Paired]:
    """{benchmark: per-sample τ of A}, the same for B (same samples in the same order) ->
    {benchmark: Paired, "mean": Paired over the benchmark means}. Deterministic given `seed`."""
    if set(a) != set(b):
        raise ValueError(f"the two methods were replayed on different benchmarks: {sorted(a)} vs {sorted(b)}")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"need 0 < level < 1 and resamples >= 1, got {level}, {resamples}")
    gen = torch.Generator().manual_seed(seed)
    tail = (1 - level) / 2
    out, means = {}, []
    for bench in a:
        if len(a[bench]) != len(b[bench]):
            raise ValueError(f"{bench}: {len(a[bench])} vs {len(b[bench])} samples: not the same samples")
        if not a[bench]:
            continue
        d = torch.tensor(a[bench], dtype=torch.float64) - torch.tensor(b[bench], dtype=torch.float64)
        idx = torch.randint(0, len(d), (resamples, len(d)), generator=gen)
        boot = d[idx].mean(-1)  # (resamples,)
        means.append(boot)
        lo, hi = torch.quantile(boot, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
        out[bench] = Paired(float(d.mean()), lo, hi, len(d))
    if means:
        boot = torch.stack(means).mean(0)
        lo, hi = torch.quantile(boot, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
        diff = sum(p.diff for p in out.values()) / len(out)
        out[MEAN] = Paired(diff, lo, hi, sum(p.n for p in out.values()))
    return out
