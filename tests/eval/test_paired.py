"""Paired bootstrap of the difference of mean τ: exact on a constant difference, resolves a small
difference that an unpaired comparison of the same numbers could not, covers zero on pure noise,
and refuses samples that are not paired."""

import random

import pytest

from drelay.eval.paired import paired_bootstrap


def test_a_constant_difference_has_a_zero_width_interval_and_the_mean_is_over_benchmarks():
    a = {"gsm8k": [2.0, 3.0, 1.5], "mbpp": [1.0, 1.2]}
    b = {"gsm8k": [1.5, 2.5, 1.0], "mbpp": [1.1, 1.3]}
    out = paired_bootstrap(a, b, resamples=200)
    assert out["gsm8k"].diff == pytest.approx(0.5) and out["gsm8k"].low == pytest.approx(0.5)
    assert out["gsm8k"].high == pytest.approx(0.5) and out["gsm8k"].ahead
    assert out["mbpp"].diff == pytest.approx(-0.1) and not out["mbpp"].ahead
    assert out["mean"].diff == pytest.approx(0.2) and out["mean"].n == 5  # (0.5 - 0.1) / 2
    assert out["mean"].low == pytest.approx(0.2) and out["mean"].high == pytest.approx(0.2)
    assert paired_bootstrap(a, b, seed=3)["mean"] == paired_bootstrap(a, b, seed=3)["mean"]  # deterministic


def test_pairing_resolves_a_small_gain_on_samples_of_very_different_difficulty():
    rng = random.Random(0)
    base = [rng.uniform(1.0, 4.0) for _ in range(48)]  # hard and easy samples: large spread of τ
    better = [t + 0.05 + rng.gauss(0, 0.02) for t in base]  # +5% of a step, on every sample
    paired = paired_bootstrap({"x": better}, {"x": base})["x"]
    assert paired.ahead and paired.low > 0.03 and paired.high < 0.07
    # the unpaired view of the same numbers: the spread of τ swamps the gain
    spread = (sum((t - sum(base) / 48) ** 2 for t in base) / 47) ** 0.5
    assert 1.96 * spread * (2 / 48) ** 0.5 > 0.05


def test_noise_alone_is_not_ahead_and_unpaired_samples_are_refused():
    rng = random.Random(1)
    a = [rng.gauss(2, 0.5) for _ in range(64)]
    b = [x + rng.gauss(0, 0.3) for x in a]
    p = paired_bootstrap({"x": a}, {"x": b})["x"]
    assert p.low < p.diff < p.high and p.low < 0 < p.high
    with pytest.raises(ValueError, match="not the same samples"):
        paired_bootstrap({"x": a}, {"x": b[:-1]})
    with pytest.raises(ValueError, match="different benchmarks"):
        paired_bootstrap({"x": a}, {"y": b})
