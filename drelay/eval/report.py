"""The evaluation's report: the paper-style markdown tables and the PNG plots.

    rows = benchmarks (+ mean), columns = methods, cells "τ / speedup"
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from drelay.decoding.replay import ReplayStats  # noqa: E402
from drelay.eval.run import AR, EvalResult  # noqa: E402

REPAIR_COLUMNS = (("pool_hit", "pool-hit"), ("replace_rate", "replace"), ("repair_precision", "precision"),
                  ("harm_rate", "harm"), ("oracle_gap_closed", "oracle gap closed vs dflash"))


def _methods(rows: dict) -> list[str]:
    return list(rows["mean"])


def _tau_speedup(cell: dict) -> str:
    tau = f"{cell['tau']:.2f}" if "tau" in cell else "—"
    speed = f"{cell['speedup']:.2f}x" if "speedup" in cell else "—"
    return f"{tau} / {speed}"


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def paired_table(result: EvalResult, tkey: str) -> list[str]:
    """The focus method against each other method at one temperature: mean τ difference per benchmark
    and for the mean, with its 95% bootstrap interval over samples; bold where the interval is above 0."""
    paired, focus = result.paired.get(tkey), result.focus
    if not paired:
        return []
    others = list(paired)
    benches = list(next(iter(paired.values())))
    lines = ["", f"{focus} against each method ({tkey}): paired difference of mean τ (replay), "
             f"{focus} minus the column, [95% bootstrap interval over samples]; **bold**: {focus} ahead "
             "(interval above 0).", "",
             "| benchmark | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
    for bench in benches:
        cells = []
        for other in others:
            p = paired[other].get(bench)
            text = "—" if p is None else f"{_signed(p.diff)} [{_signed(p.low)}, {_signed(p.high)}]"
            cells.append(f"**{text}**" if p is not None and p.ahead else text)
        lines.append(f"| {'**mean**' if bench == 'mean' else bench} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: EvalResult, info: dict) -> str:
    """The whole report: provenance, one τ / speedup table per temperature, repair statistics and
    the live checks. `info` gives samples/live_samples/max_new_tokens per benchmark, dtype, etc."""
    lines = ["# Evaluation", ""]
    lines += [f"Target `{info.get('target', '?')}` ({info.get('dtype', '?')}, {info.get('device', '?')}), "
              f"pool size k = {info.get('pool_size', '?')}, block size B = {info.get('block_size', '?')}"
              + (f" (the target checks the first {info['verify_size']} tokens of each block)"
                 if info.get("verify_size") else "") + ", "
              f"T > 0 verification rule `{info.get('sampling_rule', '?')}`.", ""]
    lines += ["Which numbers are which:",
              "- **τ**, pool-hit, replace rate, repair precision, harm rate: *replay* — the target writes one "
              "continuation per prompt (greedy at T=0, sampled at T>0) and every method's decode loop is "
              "simulated along it. Exact at T=0 (a lossless decoder commits exactly that continuation); at "
              "T>0 an unbiased estimate (a draft token is accepted with the probability that the target's "
              "sample equals it). The oracle picks the true token whenever it is in its pool "
              f"(`{info.get('oracle_drafter', 'dflash')}`'s drafter).",
              "- **speedup**, tokens/s, live τ, identical-to-AR rate: *live* decoding of the first few prompts "
              "of each benchmark, AR and every method back to back in one process. The oracle runs live at "
              "T=0 only (it reads AR's output); at T>0 its speedup is —.", ""]
    lines += ["| benchmark | replayed samples (sequences) | live prompts | max new tokens (replay / live) |",
              "|---|---|---|---|"]
    for bench, row in info.get("benchmarks", {}).items():
        lines.append(f"| {bench} | {row['samples']} ({row['sequences']}) | {row['live_samples']} "
                     f"| {row['max_new_tokens']} / {info.get('live_max_new_tokens', '?')} |")
    lines.append("")
    spent = {phase: s for phase, s in result.seconds.items() if s}
    if spent:  # this run's own work (cells reused from an earlier run cost nothing here)
        lines += ["Time spent by this run: " + ", ".join(f"{phase} {s:.0f} s" for phase, s in spent.items())
                  + f" ({result.computed} cells computed, {result.reused} reused).", ""]
    for tkey, rows in result.tables.items():
        methods = _methods(rows)
        lines += [f"## {tkey.replace('_', '.').replace('T', 'T = ', 1)}: τ (replay) / speedup over AR (live)", ""]
        lines += ["| benchmark | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for bench, cells in rows.items():
            name = f"**{bench}**" if bench == "mean" else bench
            lines.append(f"| {name} | " + " | ".join(_tau_speedup(cells[m]) for m in methods) + " |")
        ar = rows["mean"].get(AR, {})
        if "tokens_per_s" in ar:
            lines += ["", f"AR: {ar['tokens_per_s']:.1f} tokens/s (mean over benchmarks)."]
        repairers = [m for m in methods if m != AR]
        lines += ["", f"Repair statistics ({tkey}, mean over benchmarks, replay):", "",
                  "| method | " + " | ".join(label for _, label in REPAIR_COLUMNS) + " |",
                  "|---|" + "---|" * len(REPAIR_COLUMNS)]
        for m in repairers:
            cell = rows["mean"][m]
            lines.append(f"| {m} | " + " | ".join(f"{cell[k]:.3f}" if k in cell else "—" for k, _ in REPAIR_COLUMNS)
                         + " |")
        live = [m for m in repairers if "tau_live" in rows["mean"][m]]
        if live:
            ident = any("identical_rate" in rows["mean"][m] for m in live)
            lines += ["", f"Live checks ({tkey}, mean over benchmarks). Speedup predicted = τ replay x AR's ms "
                      "per token / the method's ms per step (draft + repair + verify, measured live): the cost "
                      "model; live = measured, [lowest, highest] over the live prompts.", "",
                      "| method | τ replay | τ live | tokens/s | ms per step | repair share of a step "
                      "| speedup predicted | speedup live [spread]"
                      + (" | identical to AR | near-tie divergences |" if ident else " |"),
                      "|---|---|---|---|---|---|---|---|" + ("---|---|" if ident else "")]
            for m in live:
                c = rows["mean"][m]
                near = sum(rows[b][m].get("near_tie_divergences", 0) for b in rows if b != "mean")
                tail = f" {c['identical_rate']:.3f} | {near:.0f} |" if "identical_rate" in c else ""
                low = min((rows[b][m].get("speedup_min", float("nan")) for b in rows if b != "mean"), default=float("nan"))
                high = max((rows[b][m].get("speedup_max", float("nan")) for b in rows if b != "mean"), default=float("nan"))
                predicted = f"{c['speedup_predicted']:.2f}x" if "speedup_predicted" in c else "—"
                step = f"{c['step_ms']:.0f}" if "step_ms" in c else "—"
                lines.append(f"| {m} | {c.get('tau', float('nan')):.3f} | {c['tau_live']:.3f} | "
                             f"{c['tokens_per_s']:.1f} | {step} | {c['repair_share']:.3f} | {predicted} | "
                             f"{c['speedup']:.2f}x [{low:.2f}, {high:.2f}] |{tail}")
            if ident:
                prompts = sum(rows[b][live[0]].get("live_prompts", 0) for b in rows if b != "mean")
                lines += ["", f"Every output that is not identical to AR's ({prompts} prompts per method) departed "
                          "from it at a near-tie of the target's top-2 logits (within the rounding of the run's "
                          f"dtype, {info.get('dtype', '?')}: a multi-token verification forward rounds differently "
                          "from a 1-token decode step); any other divergence fails the stage."]
                if result.oracle in live:
                    lines += ["The live oracle follows AR's output; after such a divergence that reference no "
                              "longer describes the decoded path, so its live τ is a lower bound (its replay τ is exact)."]
        lines += paired_table(result, tkey)
        lines.append("")
    if info.get("plots"):
        lines.append("Plots: " + ", ".join(f"`{p}`" for p in info["plots"]) + ".")
    return "\n".join(lines) + "\n"


def _save(fig: plt.Figure, path: str | Path) -> plt.Figure:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def plot_tau(result: EvalResult, path: str | Path) -> plt.Figure:
    """Grouped bars: τ per benchmark (and mean) per method, one panel per temperature."""
    temps = list(result.tables)
    fig, axes = plt.subplots(len(temps), 1, figsize=(13, 3.6 * len(temps)), squeeze=False)
    for ax, tkey in zip(axes[:, 0], temps):
        rows = result.tables[tkey]
        benches, methods = list(rows), [m for m in _methods(rows) if m != AR]
        width = 0.8 / max(len(methods), 1)
        for j, m in enumerate(methods):
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(benches))]
            ax.bar(xs, [rows[b][m].get("tau", 0.0) for b in benches], width, label=m,
                   hatch="//" if m == result.oracle else None, alpha=0.6 if m == result.oracle else 0.9)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(benches)), benches)
        ax.set(ylabel="τ (replay)", title=f"{tkey}: acceptance length per benchmark")
        ax.legend(fontsize=8, ncol=len(methods))
    return _save(fig, path)


def plot_acceptance(result: EvalResult, path: str | Path) -> plt.Figure:
    """Share of blocks whose draft at position i was accepted, all benchmarks pooled, per method."""
    temps = list(result.replay)
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 3.8), squeeze=False)
    for ax, tkey in zip(axes[0], temps):
        for m, stats in result.replay[tkey].items():
            blocks = float(stats.reached[0]) or 1.0
            values = (stats.accepted_at / blocks).tolist()
            ax.plot(range(1, len(values) + 1), values, "o--" if m == result.oracle else "o-", label=m)
        ax.set(xlabel="block position i", ylabel="P(draft i accepted)", ylim=(0, 1.02),
               title=f"{tkey}: acceptance by block position")
        ax.legend(fontsize=8)
    return _save(fig, path)


def repair_outcomes(stats: ReplayStats) -> dict[str, list[float]]:
    """Per position, over reached positions: replaced and right, replaced a right native (harm),
    replaced with both wrong, kept the native."""
    reached = stats.reached.clamp(min=1)
    right, harm = stats.replaced_right_at / reached, stats.harmed_at / reached
    neutral = (stats.replaced_at - stats.replaced_right_at - stats.harmed_at) / reached
    kept = 1 - stats.replaced_at / reached
    return {"replaced, right": right.tolist(), "replaced a right native (harm)": harm.tolist(),
            "replaced, both wrong": neutral.tolist(), "kept native": kept.tolist()}


def plot_repair(result: EvalResult, path: str | Path, method: str = "drelay") -> plt.Figure:
    """DRelay's repair outcomes by block position (stacked), and every head's outcomes side by side
    (a figure that says so when `method` was not evaluated)."""
    temps = [t for t in result.replay if method in result.replay[t]]
    if not temps:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, f"{method} was not evaluated (eval.methods)", ha="center", va="center")
        return _save(fig, path)
    fig, axes = plt.subplots(len(temps), 2, figsize=(13, 3.8 * len(temps)), squeeze=False)
    colors = ("tab:green", "tab:red", "tab:orange", "lightgray")
    for (ax, ax2), tkey in zip(axes, temps):
        outcomes = repair_outcomes(result.replay[tkey][method])
        bottom = [0.0] * len(next(iter(outcomes.values())))
        xs = range(1, len(bottom) + 1)
        for (label, values), color in zip(outcomes.items(), colors):
            if label == "kept native":
                continue
            ax.bar(xs, values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(xlabel="block position i", ylabel="share of reached positions",
               title=f"{tkey}: {method}'s replacements by position")
        ax.legend(fontsize=8)
        heads = [m for m in result.replay[tkey] if m not in (result.native, result.oracle)]
        bottom = [0.0] * len(heads)
        for label, color in zip(("replaced, right", "replaced a right native (harm)", "replaced, both wrong"), colors):
            values = []
            for m in heads:
                s = result.replay[tkey][m]
                total = {"replaced, right": s.replaced_right, "replaced a right native (harm)": s.harmed,
                         "replaced, both wrong": s.replaced - s.replaced_right - s.harmed}[label]
                values.append(total / max(s.positions, 1))
            ax2.bar(heads, values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax2.set(ylabel="share of reached positions", title=f"{tkey}: replacements, every head (all positions)")
        ax2.legend(fontsize=8)
    return _save(fig, path)
