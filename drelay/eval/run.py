"""The evaluation grid: benchmarks x methods x temperatures, run in cells that are saved as they finish.

Two kinds of measurement (DESIGN §1.8, §3):

- replay (many samples): the target writes ONE continuation per prompt (greedy at T=0, sampled at
  T>0), and every method's decode loop is simulated along it (drelay.decoding.replay). At T=0 a
  lossless decoder commits exactly that continuation, so τ and the repair statistics are the live
  ones. At T>0 a point-mass draft d_i is accepted with probability p(d_i) under both rules of
  drelay.decoding.verify, which is the probability that a target sample at that position equals
  d_i; so replay along a sampled continuation draws τ from the same distribution as live decoding
  (an unbiased estimate; its "true token" is the target's sample).
- live (a few samples): AR and every method decode the same prompt in the same process, for
  tokens/s, speedup over AR and, at T=0, the identical-output check (drelay.eval.live).

Cells: replay (T, benchmark, method) and live (T, benchmark, prompt), each a JSON file under
`<out_dir>/cells/` stamped with the settings and model fingerprints that made it; a resumed run
reuses every cell whose stamp still matches, and the continuations are resumable shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from drelay.config import EvalConfig, temperature_key
from drelay.data.benchmarks import load_prepared_benchmark
from drelay.data.records import Sequence
from drelay.decoding.replay import ReplayStats
from drelay.eval.live import live_prompt, predicted_speedup, summarize_live
from drelay.eval.paired import Paired, paired_bootstrap
from drelay.eval.replay_eval import grouped_continuations, replay_methods
from drelay.io import json_digest
from drelay.models import cpu_linear
from drelay.models.methods import Speculator, load_speculator
from drelay.models.target import Target

AR = "ar"
# Part of every cell's stamp: bump it when a change to the code alters what a cell measures, so that
# resumed runs recompute instead of reusing (settings, models and continuations are stamped already).
CELL_VERSION = 1
REPLAY_METRICS = ("tau", "pool_hit", "replace_rate", "repair_precision", "harm_rate")
# Where an evaluation's time goes: the target's continuations, the replays, live decoding (reused cells cost ~0).
PHASES = ("continuations", "replay", "live")
_COUNTERS = ("accepted_at", "reached", "pool_hit", "replaced_at", "replaced_right_at", "harmed_at")


def load_methods(target: Target, joint_dir: str | Path, names: list[str] | tuple[str, ...],
                 oracle_drafter: str = "dflash") -> dict[str, Speculator]:
    """Every method among `names` (`ar` needs no model) from `<joint_dir>/<method>/`; a method that is not
    trained (the oracle) on the drafter of `oracle_drafter`."""
    return {name: load_speculator(target, joint_dir, name, oracle_drafter) for name in names if name != AR}


def reference_methods(methods: dict[str, Speculator]) -> tuple[str | None, str | None]:
    """The names of the native baseline (a method that never repairs) and of the oracle (a method that reads
    the truth) among `methods`: the two ends of "share of the oracle gap closed"."""
    native = next((n for n, sp in methods.items() if not sp.method.repairs), None)
    oracle = next((n for n, sp in methods.items() if sp.method.needs_truth), None)
    return native, oracle


# ---- cells ------------------------------------------------------------------------------------


class CellStore:
    """Finished cells as JSON files `<root>/<key>.json`, each with the stamp that made it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def get(self, key: str, stamp: dict) -> dict | None:
        path = self.root / f"{key}.json"
        if not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None  # a torn file (cannot happen with put(); a hand-edited one): recompute
        return saved["value"] if saved.get("stamp") == stamp else None

    def put(self, key: str, stamp: dict, value: dict) -> None:
        path = self.root / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cell.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"stamp": stamp, "value": value}, f)
        os.replace(tmp, path)


def stats_to_dict(stats: ReplayStats) -> dict:
    return {"taus": stats.taus, "steps": stats.steps, **{k: getattr(stats, k).tolist() for k in _COUNTERS}}


def stats_from_dict(d: dict) -> ReplayStats:
    return ReplayStats(taus=list(d["taus"]), steps=int(d["steps"]),
                       **{k: torch.tensor(d[k], dtype=torch.float32) for k in _COUNTERS})


# ---- the grid ---------------------------------------------------------------------------------


@dataclass
class EvalResult:
    """Everything the report needs. `tables[T][benchmark][method]` = {metric: value} (with a `mean`
    benchmark); `replay[T][method]` = the replay statistics pooled over benchmarks (per position);
    `live_records[T][benchmark]` = per-prompt live records; `reused`/`computed`: cell counts;
    `paired[T][other]` = the focus method (drelay) minus `other`, paired over samples (drelay.eval.paired)."""

    tables: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)
    replay: dict[str, dict[str, ReplayStats]] = field(default_factory=dict)
    live_records: dict[str, dict[str, list[dict]]] = field(default_factory=dict)
    sequences: dict[str, dict[str, int]] = field(default_factory=dict)
    native: str | None = None  # the method that never repairs (dflash)
    oracle: str | None = None  # the method that reads the truth (analysis only)
    sample_taus: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)  # [T][method][bench]
    focus: str | None = None  # the method `paired` compares with the others
    paired: dict[str, dict[str, dict[str, Paired]]] = field(default_factory=dict)  # [T][other][bench]: focus - other
    stamps: dict[str, dict[str, str]] = field(default_factory=dict)  # [T][bench]: what makes per-sample τ comparable
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # wall time per phase
    reused: int = 0
    computed: int = 0


def cell_metrics(method: str, stats: ReplayStats | None, live: dict | None, oracle: ReplayStats | None,
                 dflash: ReplayStats | None, ar_tokens_per_s: float | None, gap: bool = True) -> dict[str, float]:
    """One table cell: replay τ + repair statistics, live τ / tokens/s / speedup (/ identical rate).
    gap: report the share of the oracle gap closed (dflash: the native baseline; oracle: the oracle)."""
    if method == AR:
        out = {"tau": 1.0, "speedup": 1.0}
        if ar_tokens_per_s is not None:
            out["tokens_per_s"] = ar_tokens_per_s
        return out
    out: dict[str, float] = {}
    if stats is not None:
        summary = stats.summary()
        out |= {k: summary[k] for k in REPLAY_METRICS}
        out["replay_sequences"] = len(stats.taus)
        if dflash is not None and oracle is not None and gap:
            gap = oracle.tau - dflash.tau
            out["oracle_gap_closed"] = (stats.tau - dflash.tau) / gap if gap > 1e-9 else 0.0
    if live:
        out |= {"speedup": live["live_speedup"], "tokens_per_s": live["live_tokens_per_s"],
                "tau_live": live["live_tau"], "repair_share": live["live_repair_share"],
                "live_prompts": live["live_prompts"]}
        if "live_step_ms" in live:  # cells saved before the cost model have no step times
            out |= {"speedup_min": live["live_speedup_min"], "speedup_max": live["live_speedup_max"],
                    "step_ms": live["live_step_ms"]}
            if stats is not None:
                out["speedup_predicted"] = predicted_speedup(stats.tau, live)
        if "live_identical_rate" in live:
            out |= {"identical_rate": live["live_identical_rate"],
                    "near_tie_divergences": live["live_near_tie_divergences"]}
    return out


def mean_row(rows: dict[str, dict[str, dict[str, float]]], methods: list[str], native: str | None,
             oracle: str | None) -> dict[str, dict[str, float]]:
    """The unweighted mean over benchmarks of every metric a method has on all of them; the share of
    the oracle gap closed from the mean τs (a mean of per-benchmark ratios would weigh benchmarks
    with a tiny gap like the others)."""
    out = {}
    for method in methods:
        cells = [rows[b][method] for b in rows]
        keys = set.intersection(*(set(c) for c in cells)) if cells else set()
        out[method] = {k: statistics.mean(c[k] for c in cells) for k in sorted(keys)}
    base, top = out.get(native, {}).get("tau"), out.get(oracle, {}).get("tau")
    for method, cell in out.items():
        if "oracle_gap_closed" in cell and base is not None and top is not None:
            gap = top - base
            cell["oracle_gap_closed"] = (cell["tau"] - base) / gap if gap > 1e-9 else 0.0
    return out


def run_grid(target: Target, methods: dict[str, Speculator], cfg: EvalConfig, *, benchmarks_dir: str | Path,
             pool_size: int, sampling_rule: str = "residual", max_prompt_tokens: int = 384, seed: int = 0,
             precision: str = "bfloat16", focus: str = "drelay", log: Callable[[str], None] = print,
             on_cell: Callable[[int, int, str], None] | None = None, verify_size: int = 0) -> EvalResult:
    """Every benchmark x method x temperature of `cfg` (methods: `ar` plus the keys of `methods`,
    which include `oracle` if wanted). Resumes from the cells under `cfg.out_dir`.

    precision: the replay's matmuls, as in training (train.precision: bfloat16 autocast or float32).
    focus: the method compared with every other one, paired over samples, with bootstrap intervals.
    verify_size: tokens the target checks per step, in replay and live (0: each drafter's whole block).
    `on_cell(done, total, what)` reports progress after each cell. Raises LosslessnessError (after
    saving every finished cell) if a T=0 output departs from AR where rounding cannot explain it."""
    out_dir = Path(cfg.out_dir)
    store = CellStore(out_dir / "cells")
    names = [m for m in cfg.methods if m == AR or m in methods]
    trained = [m for m in names if m != AR]
    native, oracle = reference_methods({m: methods[m] for m in trained})
    too_small = [m for m in trained if verify_size > methods[m].drafter.config.block_size]
    if too_small:
        raise ValueError(f"decode.verify_size {verify_size} is more than the block of {', '.join(too_small)} "
                         f"({methods[too_small[0]].drafter.config.block_size} tokens)")
    result = EvalResult(native=native, oracle=oracle)
    total = sum(len(trained) + cfg.per_benchmark("live_samples", b) for b in cfg.benchmarks) * len(cfg.temperatures)
    done = 0
    target_fp = target.fingerprint()

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if on_cell is not None:
            on_cell(done, total, what)

    for temperature in cfg.temperatures:
        tkey = temperature_key(temperature)
        tables: dict[str, dict[str, dict[str, float]]] = {}
        pooled: dict[str, ReplayStats] = {}
        result.live_records[tkey], result.sequences[tkey] = {}, {}
        t0 = time.perf_counter()
        per_bench = temperature_sequences(target, cfg, temperature, benchmarks_dir=benchmarks_dir, pool_size=pool_size,
                                          max_prompt_tokens=max_prompt_tokens, seed=seed, precision=precision,
                                          target_fp=target_fp, verify_size=verify_size)
        result.seconds["continuations"] += time.perf_counter() - t0
        log(f"{tkey}: {sum(len(seqs) for seqs, _ in per_bench.values())} target continuations "
            f"({time.perf_counter() - t0:.0f} s)")
        for bench in cfg.benchmarks:
            seqs, base = per_bench[bench]
            result.sequences[tkey][bench] = len(seqs)
            result.stamps.setdefault(tkey, {})[bench] = json_digest(base)
            stats: dict[str, ReplayStats] = {}
            for name in trained:
                stamp = {**base, "method": name, "model": methods[name].fingerprint}
                key = f"{tkey}/{bench}/replay_{name}"
                saved = store.get(key, stamp)
                if saved is None:
                    t0 = time.perf_counter()
                    s = replay_methods({name: methods[name]}, seqs, pool_size,  # as in training
                                       autocast=precision == "bfloat16", verify_size=verify_size)[name]
                    store.put(key, stamp, stats_to_dict(s))
                    result.seconds["replay"] += time.perf_counter() - t0
                    result.computed += 1
                else:
                    s = stats_from_dict(saved)
                    result.reused += 1
                stats[name] = s
                pooled[name] = s if name not in pooled else pooled[name].merge(s)
                result.sample_taus.setdefault(tkey, {}).setdefault(name, {})[bench] = list(s.taus)
                tick(f"{tkey} {bench} replay {name}")
            records = _live_cells(target, methods, trained, seqs, cfg, bench, temperature, base, store, result,
                                  pool_size, sampling_rule, seed, tick, verify_size)
            result.live_records[tkey][bench] = records
            live = summarize_live(records)
            ar_tps = statistics.mean(r["ar"]["tokens_per_s"] for r in records) if records else None
            tables[bench] = {name: cell_metrics(name, stats.get(name), live.get(name), stats.get(oracle),
                                                stats.get(native), ar_tps, gap=name not in (native, oracle))
                             for name in names}
            log(f"{tkey} {bench}: {len(seqs)} sequences; τ " + ", ".join(
                f"{name} {stats[name].tau:.3f}" for name in trained))
        tables["mean"] = mean_row(tables, names, native, oracle)
        result.tables[tkey] = tables
        result.replay[tkey] = pooled
        taus = result.sample_taus.get(tkey, {})
        if focus in taus:
            result.focus = focus
            result.paired[tkey] = {other: paired_bootstrap(taus[focus], taus[other], seed=seed)
                                   for other in trained if other != focus}
    return result


def temperature_sequences(target: Target, cfg: EvalConfig, temperature: float, *, benchmarks_dir: str | Path,
                          pool_size: int, max_prompt_tokens: int, seed: int, precision: str,
                          target_fp: str | None = None, verify_size: int = 0) -> dict[str, tuple[list[Sequence], dict]]:
    """Every benchmark's target continuations at `temperature` and the stamp of everything a replayed τ on them
    depends on besides the method's model: {benchmark: (sequences, stamp)}. The benchmarks that share a token
    budget are generated together, `cfg.batch_size` rows at a time (`grouped_continuations`), written once under
    `<cfg.out_dir>/continuations/<T>/new<budget>/` and reused by later runs."""
    target_fp = target_fp or target.fingerprint()
    budgets: dict[int, dict[str, list]] = {}
    for bench in cfg.benchmarks:
        budgets.setdefault(cfg.per_benchmark("max_new_tokens", bench), {})[bench] = load_prepared_benchmark(
            benchmarks_dir, bench, cfg.per_benchmark("samples", bench))
    seqs: dict[str, list[Sequence]] = {}
    for max_new, groups in budgets.items():
        seqs |= grouped_continuations(
            target, groups, Path(cfg.out_dir) / "continuations" / temperature_key(temperature) / f"new{max_new}",
            max_new_tokens=max_new, max_prompt_tokens=max_prompt_tokens, batch_size=cfg.batch_size,
            temperature=temperature, seed=seed)
    out = {}
    for bench in cfg.benchmarks:
        base = {"version": CELL_VERSION, "target": target_fp, "benchmark": bench, "temperature": temperature,
                "samples": cfg.per_benchmark("samples", bench),
                "max_new_tokens": cfg.per_benchmark("max_new_tokens", bench), "max_prompt_tokens": max_prompt_tokens,
                "pool_size": pool_size, "seed": seed, "continuations": _sequences_digest(seqs[bench]),
                **({} if precision == "bfloat16" else {"precision": precision}),
                **({"verify_size": verify_size} if verify_size else {})}
        out[bench] = (seqs[bench], base)
    return out


def replay_sample_taus(target: Target, speculator: Speculator, cfg: EvalConfig, temperature: float, *,
                       benchmarks_dir: str | Path, pool_size: int, max_prompt_tokens: int, seed: int,
                       precision: str, verify_size: int = 0) -> tuple[dict[str, list[float]], dict[str, str]]:
    """One method's per-sample replay τ on the evaluation's continuations at `temperature`, per benchmark, and
    the stamps (`EvalResult.stamps`) of that evaluation: what the promotion gate compares a registered model on."""
    taus, stamps = {}, {}
    per_bench = temperature_sequences(target, cfg, temperature, benchmarks_dir=benchmarks_dir, pool_size=pool_size,
                                      max_prompt_tokens=max_prompt_tokens, seed=seed, precision=precision,
                                      verify_size=verify_size)
    for bench, (seqs, base) in per_bench.items():
        stats = replay_methods({"m": speculator}, seqs, pool_size, autocast=precision == "bfloat16",
                               verify_size=verify_size)["m"]
        taus[bench], stamps[bench] = list(stats.taus), json_digest(base)
    return taus, stamps


def _sequences_digest(seqs: list[Sequence]) -> str:
    digest = hashlib.sha256()
    for s in seqs:
        digest.update(s.tokens.numpy().tobytes())
        digest.update(str(s.prompt_len).encode())
    return digest.hexdigest()[:16]


def _live_cells(target: Target, methods: dict[str, Speculator], trained: list[str], seqs: list[Sequence],
                cfg: EvalConfig, bench: str, temperature: float, base: dict, store: CellStore, result: EvalResult,
                pool_size: int, sampling_rule: str, seed: int, tick: Callable[[str], None],
                verify_size: int = 0) -> list[dict]:
    """The live records of the first `live_samples` prompts of a benchmark (each one cell: AR and
    every method on that prompt, in this process, back to back). A method that reads the truth (the oracle)
    runs live at T=0 only."""
    live_names = [m for m in trained if not (methods[m].method.needs_truth and temperature > 0)]
    tkey = temperature_key(temperature)
    records = []
    n_live = cfg.per_benchmark("live_samples", bench)
    for i, seq in enumerate(seqs[:n_live]):
        ids = seq.tokens[: seq.prompt_len].tolist()
        stamp = {**base, "prompt": json_digest(ids),
                 "live_max_new_tokens": cfg.live_max_new_tokens, "sampling_rule": sampling_rule,
                 "methods": {m: methods[m].fingerprint for m in live_names}, "few_row": cpu_linear.MODE}
        key = f"{tkey}/{bench}/live_{i:03d}"
        record = store.get(key, stamp)
        if record is None:
            t0 = time.perf_counter()
            record = live_prompt(target, {m: methods[m] for m in live_names}, ids, cfg.live_max_new_tokens, pool_size, temperature,
                                 seed=seed + i, sampling_rule=sampling_rule, verify_size=verify_size)
            store.put(key, stamp, record)
            result.seconds["live"] += time.perf_counter() - t0
            result.computed += 1
        else:
            result.reused += 1
        records.append(record)
        tick(f"{tkey} {bench} live {i + 1}")
    for _ in range(len(seqs[:n_live]), n_live):  # fewer prompts than asked (over-long ones skipped)
        tick(f"{tkey} {bench} live (none)")
    return records


def nonfinite(tables: dict) -> list[str]:
    """Dotted paths of every number in `tables` that is NaN or infinite (should be none)."""
    bad = []
    for tkey, rows in tables.items():
        for bench, cells in rows.items():
            for method, metrics in cells.items():
                bad += [f"{tkey}.{bench}.{method}.{k}" for k, v in metrics.items()
                        if isinstance(v, float) and not math.isfinite(v)]
    return bad
