"""The live summary's cost model: step and AR costs from per-prompt records, predicted speedup."""

import pytest

from drelay.eval.live import predicted_speedup, summarize_live


def record(ar_tokens, ar_s, tokens, steps, draft_s, repair_s, verify_s):
    wall = draft_s + repair_s + verify_s
    return {"ar": {"tokens_per_s": ar_tokens / ar_s, "new_tokens": ar_tokens, "wall_s": ar_s},
            "m": {"tau": tokens / steps, "tokens_per_s": tokens / wall, "new_tokens": tokens, "wall_s": wall,
                  "steps": steps, "draft_s": draft_s, "repair_s": repair_s, "verify_s": verify_s}}


def test_step_and_ar_costs_and_the_predicted_speedup():
    # AR 100 ms a token; the method 50 steps of 100 ms for 100 tokens (τ 2): twice as fast
    one = record(100, 10.0, 100, 50, 1.0, 0.5, 3.5)
    # a second prompt where the method is slower: 40 steps of 150 ms for 60 tokens (τ 1.5)
    two = record(50, 5.0, 60, 40, 1.0, 1.0, 4.0)
    live = summarize_live([one, two])["m"]
    assert live["live_step_ms"] == pytest.approx(1000 * 11.0 / 90)
    assert live["ar_ms_per_token"] == pytest.approx(100.0)
    assert live["live_speedup_min"] == pytest.approx((60 / 6.0) / 10.0)
    assert live["live_speedup_max"] == pytest.approx(2.0)
    assert live["live_repair_share"] == pytest.approx(1.5 / 11.0)
    assert predicted_speedup(2.0, live) == pytest.approx(2.0 * 100.0 / (1000 * 11.0 / 90))
    # on the first prompt alone the model reproduces the measured speedup exactly
    alone = summarize_live([one])["m"]
    assert predicted_speedup(alone["live_tau"], alone) == pytest.approx(alone["live_speedup"]) == pytest.approx(2.0)


def test_no_steps_predicts_nothing():
    assert predicted_speedup(2.0, {"live_step_ms": 0.0, "ar_ms_per_token": 100.0}) == 0.0
