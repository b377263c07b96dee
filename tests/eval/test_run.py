"""The evaluation grid on a tiny random target with the real benchmark mirror: every benchmark x
method x temperature present and finite, replay τ equal to live τ at T=0, the oracle as an upper
bound and live at T=0, cells reused on a second run and after an interruption, a changed model
recomputing only its own cells, and the report + plots."""

import json
import math
import shutil
from functools import partial

import pytest
import torch

from drelay.config import EvalConfig
from drelay.eval.report import markdown, plot_acceptance, plot_repair, plot_tau, repair_outcomes
from drelay.eval.run import AR, CellStore, run_grid, temperature_key
from drelay.io import folder_fingerprint
from drelay.models.methods import Speculator
from drelay.models.repair import Native, Oracle
from tests.methods import Hook

pytestmark = pytest.mark.usefixtures("one_thread")
BENCHES = ("gsm8k", "mt_bench")
ORACLE = "oracle"


def second_at_one(block):  # a repair hook that changes something: position 1 takes its 2nd candidate
    draft = block.pool_ids[..., 0].clone()
    draft[:, 0] = block.pool_ids[:, 0, 1]
    return draft


@pytest.fixture(scope="module")
def models(chat_target_and_drafter):
    target, drafter = chat_target_and_drafter
    methods = {"dflash": Speculator(drafter, Native(), "d1"), "dflash2": Speculator(drafter, Hook(second_at_one), "s1"),
               ORACLE: Speculator(drafter, Oracle(), "d1")}
    return target, methods


def config(out_dir, **kw) -> EvalConfig:
    settings = dict(benchmarks=BENCHES, methods=(AR, "dflash", "dflash2", ORACLE), temperatures=(0.0, 1.0),
                    samples={"default": 2}, max_new_tokens={"default": 10, "mt_bench": 8},
                    live_samples={"default": 1}, live_max_new_tokens=10, batch_size=2, out_dir=str(out_dir))
    return EvalConfig(**{**settings, **kw})


def grid(models, cfg, mirror, **kw):
    target, methods = models
    return run_grid(target, methods, cfg, benchmarks_dir=mirror, pool_size=4, max_prompt_tokens=512, log=lambda s: None, **kw)


@pytest.fixture(scope="module")
def first(models, prepared_benchmarks, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    return out, grid(models, config(out), prepared_benchmarks)


def test_every_cell_is_present_and_finite(first):
    _, result = first
    assert list(result.tables) == ["T0", "T1"]
    for tkey, rows in result.tables.items():
        assert list(rows) == [*BENCHES, "mean"]
        for bench, cells in rows.items():
            assert list(cells) == [AR, "dflash", "dflash2", ORACLE]
            for method, metrics in cells.items():
                assert all(math.isfinite(v) for v in metrics.values()), (tkey, bench, method)
                assert {"tau", "speedup"} <= set(metrics) or (method == ORACLE and tkey == "T1")
                if method != AR:
                    assert {"tau", "pool_hit", "replace_rate", "repair_precision", "harm_rate"} <= set(metrics)
            assert cells[AR]["tau"] == 1.0 and cells[AR]["speedup"] == 1.0 and cells[AR]["tokens_per_s"] > 0
    t0 = result.tables["T0"]
    for bench in BENCHES:
        assert t0[bench]["dflash"]["identical_rate"] == 1.0  # float32 target: lossless, token for token
        assert t0[bench]["dflash2"]["identical_rate"] == 1.0 and t0[bench][ORACLE]["identical_rate"] == 1.0
        assert t0[bench][ORACLE]["tau"] >= max(t0[bench]["dflash"]["tau"], t0[bench]["dflash2"]["tau"])
        assert t0[bench]["dflash"]["replace_rate"] == 0.0 and t0[bench]["dflash2"]["replace_rate"] > 0
    assert "speedup" not in result.tables["T1"]["gsm8k"][ORACLE]  # the live oracle needs T=0
    assert "identical_rate" not in result.tables["T1"]["gsm8k"]["dflash"]
    assert result.sequences["T0"] == {"gsm8k": 2, "mt_bench": 4}  # MT-Bench: both turns of each sample
    assert all(result.seconds[phase] > 0 for phase in ("continuations", "replay", "live"))
    mean = result.tables["T0"]["mean"]["dflash2"]
    assert mean["tau"] == pytest.approx(sum(t0[b]["dflash2"]["tau"] for b in BENCHES) / 2)


def test_the_live_oracle_with_a_full_pool_accepts_every_block_like_the_replayed_one(models, prepared_benchmarks,
                                                                                        tmp_path):
    target, methods = models  # pool = the whole vocabulary: the oracle always holds the true token
    cfg = config(tmp_path, benchmarks=("gsm8k",), methods=(AR, ORACLE), samples={"default": 1}, temperatures=(0.0,),
                 max_new_tokens={"default": 14}, live_max_new_tokens=14)
    result = run_grid(target, {ORACLE: methods[ORACLE]}, cfg, benchmarks_dir=prepared_benchmarks,
                      pool_size=target.vocab_size,
                      max_prompt_tokens=512, log=lambda s: None)
    oracle = result.tables["T0"]["gsm8k"][ORACLE]
    assert oracle["tau"] == oracle["tau_live"] > 3.0 and oracle["identical_rate"] == 1.0
    assert oracle["pool_hit"] == 1.0 and oracle["repair_precision"] == 1.0


def test_the_live_oracle_reads_the_reference_token_at_each_draft_position(models):
    """The engine hands the oracle AR's output at the block's positions: in the pool it is taken, out of
    the pool (or past the reference's end, -1) the native stays."""
    from drelay.decoding.generate import DecodeState, SpeculativeDecoder
    from drelay.models.repair import DraftBlock

    target, methods = models
    decoder = SpeculativeDecoder(target, methods[ORACLE].drafter, Oracle(), block_size=4, pool_size=2,
                                 reference=[0, 0, 0, 6, 1, 10])
    # prompt of 10 tokens: the anchor (position 12) is new token 2; drafts are new tokens 3, 4, 5
    truth = decoder._truth(DecodeState(None, None, torch.tensor([4]), 12, [], prompt_len=10), 3)
    assert truth.tolist() == [[6, 1, 10]]
    assert decoder._truth(DecodeState(None, None, torch.tensor([4]), 13, [], prompt_len=10), 3).tolist() == [[1, 10, -1]]
    pool = torch.tensor([[[5, 6], [7, 8], [9, 10]]])  # (1, 3 positions, k=2)
    block = DraftBlock(torch.tensor([4]), torch.tensor([12]), None, None, pool, torch.zeros(1, 3, 2), truth)
    assert Oracle().select(block).tolist() == [[6, 7, 10]]  # in pool / not in pool (native) / in pool
    with pytest.raises(ValueError, match="reads the target's greedy output"):
        SpeculativeDecoder(target, methods[ORACLE].drafter, Oracle())  # no reference: an error, not a guess


def test_second_run_reuses_every_cell_and_gives_the_same_tables(first, models, prepared_benchmarks):
    out, result = first
    again = grid(models, config(out), prepared_benchmarks)
    assert again.computed == 0 and again.reused == result.computed + result.reused
    assert again.seconds["replay"] == again.seconds["live"] == 0.0  # nothing recomputed
    for tkey in result.tables:
        for bench in BENCHES:
            assert again.tables[tkey][bench] == result.tables[tkey][bench]


def test_checking_fewer_drafts_is_its_own_evaluation(first, models, prepared_benchmarks, tmp_path):
    """decode.verify_size: stamped into every cell (the whole-block cells are not reused for it), τ at most
    verify_size, and a size above a drafter's block is an error naming the setting."""
    out = tmp_path / "eval"
    shutil.copytree(first[0], out)  # a copy: the module's cells stay as the other tests expect them
    fewer = grid(models, config(out, temperatures=(0.0,)), prepared_benchmarks, verify_size=2)
    assert fewer.reused == 0 and fewer.computed > 0
    for bench in BENCHES:
        assert fewer.tables["T0"][bench]["dflash"]["tau"] <= 2.0
        assert fewer.tables["T0"][bench]["dflash"]["identical_rate"] == 1.0
    with pytest.raises(ValueError, match="decode.verify_size 9 is more than the block of dflash"):
        grid(models, config(out), prepared_benchmarks, verify_size=9)


def test_an_interrupted_run_resumes_from_its_finished_cells(models, prepared_benchmarks, tmp_path):
    mirror = prepared_benchmarks
    cfg = config(tmp_path, benchmarks=("gsm8k",))

    def stop_after(n):
        def on_cell(done, total, what):
            if done == n:
                raise KeyboardInterrupt(f"killed after {what}")
        return on_cell

    with pytest.raises(KeyboardInterrupt):
        grid(models, cfg, mirror, on_cell=stop_after(5))
    saved = sorted(p.relative_to(tmp_path) for p in (tmp_path / "cells").rglob("*.json"))
    assert len(saved) == 5
    resumed = grid(models, cfg, mirror)
    assert resumed.reused == 5 and resumed.computed == 8 - 5  # (3 methods + 1 live) x 2 temperatures


def test_a_changed_model_recomputes_only_its_cells_and_the_live_ones(first, models, prepared_benchmarks):
    out, result = first
    target, methods = models
    changed = {**methods, "dflash2": Speculator(methods["dflash2"].drafter, Hook(second_at_one), "s2")}
    again = run_grid(target, changed, config(out), benchmarks_dir=prepared_benchmarks, pool_size=4,
                     max_prompt_tokens=512,
                     log=lambda s: None)
    per_temp_bench = 1 + 1  # dflash2's replay cell + the live cell (it holds every method)
    assert again.computed == per_temp_bench * len(BENCHES) * 2


def test_cell_store_ignores_other_stamps_and_torn_files(tmp_path):
    store = CellStore(tmp_path)
    store.put("T0/x/replay_a", {"model": "1"}, {"tau": 2.0})
    assert store.get("T0/x/replay_a", {"model": "1"}) == {"tau": 2.0}
    assert store.get("T0/x/replay_a", {"model": "2"}) is None
    (tmp_path / "T0/x/replay_b.json").write_text('{"stamp": {"model": "1"}, "val')
    assert store.get("T0/x/replay_b", {"model": "1"}) is None
    assert temperature_key(0.0) == "T0" and temperature_key(0.7) == "T0_7"


def test_folder_fingerprint_follows_contents(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"123")
    before = folder_fingerprint(tmp_path)
    (tmp_path / "a" / "w.bin").write_bytes(b"124")
    assert folder_fingerprint(tmp_path) != before


def test_report_tables_and_plots(first, tmp_path):
    _, result = first
    info = {"benchmarks": {b: {"samples": 2, "sequences": 2, "live_samples": 1, "max_new_tokens": 10} for b in BENCHES},
            "plots": ["reports/eval_tau.png"]}
    text = markdown(result, info)
    for tkey in ("T = 0", "T = 1"):
        assert f"## {tkey}: τ (replay) / speedup over AR (live)" in text
    header = "| benchmark | ar | dflash | dflash2 | oracle |"
    assert text.count(header) == 2
    mean = result.tables["T0"]["mean"]
    assert f"| **mean** | 1.00 / 1.00x | {mean['dflash']['tau']:.2f} / {mean['dflash']['speedup']:.2f}x |" in text
    assert "replay" in text and "live" in text  # which numbers are which
    # the cost model: a predicted speedup beside the live one, with the live prompts' spread
    cell = result.tables["T0"]["gsm8k"]["dflash"]
    assert cell["speedup_predicted"] == pytest.approx(cell["tau"] * 1000 / cell["step_ms"]
                                                      / result.tables["T0"]["gsm8k"]["ar"]["tokens_per_s"], rel=1e-6)
    assert cell["speedup_min"] <= cell["speedup"] <= cell["speedup_max"]
    row = next(line for line in text.splitlines() if line.startswith("| dflash | ") and "x [" in line)
    assert f"{mean['dflash']['speedup_predicted']:.2f}x" in row
    for plot in (plot_tau, plot_acceptance, partial(plot_repair, method="dflash2")):
        path = tmp_path / "plot.png"
        fig = plot(result, path)
        assert path.stat().st_size > 10000 and len(fig.axes) >= 2
    fig = plot_repair(result, tmp_path / "none.png")  # drelay was not evaluated here: the figure says so
    assert "drelay was not evaluated" in fig.axes[0].texts[0].get_text()
    outcomes = repair_outcomes(result.replay["T0"]["dflash2"])
    for i in range(3):  # right + harm + both wrong + kept = every reached position
        assert sum(v[i] for v in outcomes.values()) == pytest.approx(1.0)
    json.dumps(result.tables)  # plain numbers all the way down


def test_the_focus_method_is_compared_with_every_other_paired_over_samples(first, models, prepared_benchmarks):
    out, result = first
    assert result.paired == {} and result.focus is None  # the default focus, drelay, was not evaluated
    again = grid(models, config(out), prepared_benchmarks, focus="dflash2")
    assert again.focus == "dflash2"
    t0 = again.tables["T0"]
    for tkey in ("T0", "T1"):
        assert set(again.paired[tkey]) == {"dflash", ORACLE}
    for bench in BENCHES:
        p = again.paired["T0"]["dflash"][bench]
        assert p.diff == pytest.approx(t0[bench]["dflash2"]["tau"] - t0[bench]["dflash"]["tau"])
        assert p.low <= p.diff <= p.high and p.n == again.sequences["T0"][bench]
    mean = again.paired["T0"][ORACLE]["mean"]
    assert mean.diff == pytest.approx(t0["mean"]["dflash2"]["tau"] - t0["mean"][ORACLE]["tau"]) and mean.diff <= 0
    info = {"benchmarks": {b: {"samples": 2, "sequences": 2, "live_samples": 1, "max_new_tokens": 10} for b in BENCHES}}
    text = markdown(again, info)
    assert "dflash2 against each method (T0)" in text and "| benchmark | dflash | oracle |" in text
