"""Replay evaluation on benchmark-style prompts: the target's continuations (both MT-Bench turns, the
second after the target's own first answer), reused on a second call, and replayed τ equal to live
decoding's on the same prompts; live comparison metrics."""

import pytest

from drelay.data.benchmarks import BenchmarkSample, conversation
from drelay.decoding.generate import speculative_generate
from drelay.eval.live import live_compare
from drelay.eval.replay_eval import continuations, grouped_continuations, replay_methods
from drelay.models.methods import Speculator
from drelay.models.repair import Native, Oracle
from tests.methods import Hook

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLES = [BenchmarkSample("mt/1", "mt_bench", ("Name a color.", "Now another one."), None),
           BenchmarkSample("gsm/1", "gsm8k", ("What is 2 + 3?",), None),
           BenchmarkSample("mt/2", "mt_bench", ("Say hi.", "Say bye."), None)]


@pytest.fixture
def setup(chat_target_and_drafter):
    return chat_target_and_drafter


def test_continuations_follow_each_turn_and_are_reused(setup, tmp_path):
    target, _ = setup
    seqs = continuations(target, SAMPLES, tmp_path, max_new_tokens=10, max_prompt_tokens=512, batch_size=2)
    assert len(seqs) == 5  # three first turns, then the two second turns
    turn1 = {s.id: seq for s, seq in zip(SAMPLES, seqs[:3])}
    stop = set(target.stop_token_ids())
    for sample, seq in zip([SAMPLES[0], SAMPLES[2]], seqs[3:]):
        first = turn1[sample.id]
        answer = target.tokenizer.decode([t for t in first.tokens[first.prompt_len:].tolist() if t not in stop],
                                         skip_special_tokens=True)
        assert seq.tokens[: seq.prompt_len].tolist() == target.encode_chat(conversation(sample, [answer]))
    for seq in seqs:
        assert 1 <= seq.response_len <= 10 and seq.features.shape[0] == seq.tokens.shape[0]
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("shard_*.safetensors")}
    again = continuations(target, SAMPLES, tmp_path, max_new_tokens=10, max_prompt_tokens=512, batch_size=2)
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in seqs]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("shard_*.safetensors")} == stamps  # not regenerated
    short = continuations(target, SAMPLES, tmp_path / "short", max_new_tokens=10, max_prompt_tokens=15)
    assert all(s.prompt_len <= 15 for s in short) and len(short) < len(seqs)  # over-long prompts are skipped


def test_groups_generated_together_equal_each_group_alone(setup, tmp_path):
    target, _ = setup
    groups = {"mt_bench": [SAMPLES[0], SAMPLES[2]], "gsm8k": [SAMPLES[1]]}
    together = grouped_continuations(target, groups, tmp_path / "all", max_new_tokens=10, max_prompt_tokens=512,
                                     batch_size=4)
    assert list(together) == ["mt_bench", "gsm8k"]
    for name, samples in groups.items():
        alone = continuations(target, samples, tmp_path / name, max_new_tokens=10, max_prompt_tokens=512, batch_size=4)
        assert [s.tokens.tolist() for s in together[name]] == [s.tokens.tolist() for s in alone]  # T=0, float32
        assert [s.prompt_len for s in together[name]] == [s.prompt_len for s in alone]
    assert len(list((tmp_path / "all").rglob("shard_*.safetensors"))) == 2  # turn 1: 3 prompts, turn 2: 2


def test_replayed_tau_equals_live_tau_on_the_same_prompts(setup, tmp_path):
    target, drafter = setup
    seqs = continuations(target, SAMPLES[:2], tmp_path, max_new_tokens=24, max_prompt_tokens=512, turns=1)

    def second_at_two(block):  # any repair hook: position 2 takes its second candidate
        draft = block.pool_ids[..., 0].clone()
        draft[:, 1] = block.pool_ids[:, 1, 1]
        return draft

    methods = {"native": Speculator(drafter, Native()), "swap": Speculator(drafter, Hook(second_at_two)),
               "oracle": Speculator(drafter, Oracle())}
    stats = replay_methods(methods, seqs, pool_size=4, autocast=False)
    assert stats["oracle"].tau >= stats["native"].tau
    for name in ("native", "swap"):
        for seq, lengths in zip(seqs, stats[name].accept_lengths):
            live = speculative_generate(target, drafter, seq.tokens[: seq.prompt_len].tolist(), seq.response_len,
                                        method=methods[name].method, pool_size=4).stats.accept_lengths
            assert lengths[:-1] == live[: len(lengths) - 1]  # step by step; live may draft past the end


def test_live_compare_reports_tau_speedup_and_where_a_step_goes(setup):
    target, drafter = setup
    ids = [target.encode_chat(conversation(s, [])) for s in SAMPLES[:2]]
    out = live_compare(target, {"dflash": Speculator(drafter, Native()),
                                "swap": Speculator(drafter, Hook(lambda b: b.pool_ids[..., 1]))},
                       ids, max_new_tokens=12, pool_size=4)
    assert set(out) == {"dflash", "swap"}
    for metrics in out.values():
        assert metrics["live_identical_rate"] == 1.0  # float32: lossless whatever the repair proposes
        assert metrics["live_prompts"] == 2 and metrics["live_tau"] >= 1.0 and metrics["ar_tokens_per_s"] > 0
        shares = metrics["live_draft_share"] + metrics["live_repair_share"] + metrics["live_verify_share"]
        assert shares == pytest.approx(1.0) and metrics["live_repair_share"] >= 0.0
    assert live_compare(target, {"dflash": Speculator(drafter, Native())}, [], 12) == {}
