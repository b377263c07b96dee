"""Every trained method side by side on the held-out distilled split (where δ and every setting are
chosen; never the evaluation prompts), paired over sequences.

Loads the target, each method's train@ output under joint.common.out_dir and the held-out split of the
distilled data (train.val_fraction, run.seed: the split the train@ stages evaluated on), replays every
method along the same sequences (T = 0, exact) at train.precision, and prints per method: τ, the
difference to `--focus` with its 95% bootstrap interval over sequences, the native τ of its own
backbone, the oracle τ, the oracle gap closed (vs the dflash continuation), replace rate, repair
precision, harm, and τ per block position. `--margins`: also every relay (drelay, drelay-lite) at each δ of its
grid (`repair_margins`), with whole blocks and with the evaluation's decode.verify_size (the train@ stage picks δ
on whole blocks). Writes the numbers as JSON with `--out`.

    .venv/bin/python benchmarks/heldout_compare.py [--params P] [--focus drelay] [--margins] [--joint-dir D]
        [--out FILE]
    (run it where the pipeline ran: the repo root, or runs/<profile>/)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drelay.eval.paired import paired_bootstrap  # noqa: E402
from drelay.eval.replay_eval import replay_methods  # noqa: E402
from drelay.models.methods import Speculator, load_speculator  # noqa: E402
from drelay.models.repair import Native, Oracle  # noqa: E402
from workspace import load_workspace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--focus", default="drelay", help="the method every other is compared with")
    ap.add_argument("--methods", nargs="*", help="default: joint.methods")
    ap.add_argument("--sequences", type=int, default=0, help="held-out sequences to replay (0: all)")
    ap.add_argument("--margins", action="store_true", help="also each relay at every δ of its grid, whole blocks "
                    "and decode.verify_size")
    ap.add_argument("--joint-dir", type=Path, help="the methods' folders (default: joint.common.out_dir; "
                    "models/variants/<name> for benchmarks/train_variant.py's)")
    ap.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = ap.parse_args()
    params, target, val = load_workspace(args.params)
    val = val[: args.sequences or None]
    joint_dir, pool = args.joint_dir or Path(params.joint.common.out_dir), params.decode.pool_size
    names = args.methods or list(params.joint.methods)
    autocast = params.train.precision == "bfloat16"
    rows, taus, margins = {}, {}, {}
    for name in names:
        t0 = time.perf_counter()
        spec = load_speculator(target, joint_dir, name)
        specs = {name: spec, f"{name}:native": Speculator(spec.drafter, Native()),
                 f"{name}:oracle": Speculator(spec.drafter, Oracle())}
        stats = replay_methods(specs, val, pool, autocast=autocast)
        s = stats[name].summary()
        rows[name] = {"tau": s["tau"], "native_tau": stats[f"{name}:native"].tau, "oracle_tau": stats[f"{name}:oracle"].tau,
                      **{k: s[k] for k in ("replace_rate", "repair_precision", "harm_rate") if k in s},
                      "accept_pos": [round(s[f"accept_pos{i}"], 3) for i in range(1, 64) if f"accept_pos{i}" in s],
                      "seconds": time.perf_counter() - t0}
        taus[name] = {"val": stats[name].taus}
        print(f"{name}: τ {s['tau']:.3f} ({rows[name]['seconds']:.0f} s)", file=sys.stderr, flush=True)
        if args.margins and hasattr(getattr(spec.method, "config", None), "repair_margin"):
            margins[name] = margin_taus(spec, params, val, pool, autocast)
    base = rows.get("dflash")
    for name, row in rows.items():
        if base is not None:
            gap = base["oracle_tau"] - base["tau"]
            row["oracle_gap_closed"] = (row["tau"] - base["tau"]) / gap if gap > 1e-9 else 0.0
        if args.focus in taus and name != args.focus:
            p = paired_bootstrap(taus[args.focus], taus[name], seed=params.run.seed)["val"]
            row["focus_minus"] = p.as_dict()
    print(f"\nheld-out replay, T = 0, {len(val)} sequences, pool k = {pool}, {params.train.precision}"
          f" ({args.params}); Δ = {args.focus} minus the row, [95% bootstrap interval]\n")
    print(f"| method | τ | Δ {args.focus} - row | own native τ | oracle τ | gap closed | replace | precision "
          "| harm | accept by position |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        d = r.get("focus_minus")
        delta = f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d else "—"
        print(f"| {name} | {r['tau']:.3f} | {delta} | {r['native_tau']:.3f} | {r['oracle_tau']:.3f} | "
              f"{r.get('oracle_gap_closed', float('nan')):+.3f} | {r.get('replace_rate', 0):.3f} | "
              f"{r.get('repair_precision', 0):.3f} | {r.get('harm_rate', 0):.3f} | "
              f"{' '.join(f'{a:.2f}' for a in r['accept_pos'])} |")
    sizes = [f"V={v or 'all'}" for v in verify_sizes(params)]
    for name, by_margin in margins.items():
        trained = rows[name]["tuned_margin"] = next(m for m, r in by_margin.items() if r["tuned"])
        print(f"\n{name} at each δ (tuned on whole blocks: {trained:g}); V: drafts checked + 1\n")
        print("| δ | " + " | ".join(sizes) + " |\n|---|" + "---|" * len(sizes))
        for m, r in by_margin.items():
            print(f"| {m:g} | " + " | ".join(f"{r[c]:.4f}" for c in sizes) + " |")
    if args.out:
        args.out.write_text(json.dumps({"sequences": len(val), "rows": rows, "margins": margins}, indent=1))


def verify_sizes(params) -> list[int]:
    """Whole blocks (0), then the evaluation's decode.verify_size where it checks fewer."""
    return [0, params.decode.verify_size] if params.decode.verify_size else [0]


def margin_taus(spec: Speculator, params, val: list, pool: int, autocast: bool) -> dict[float, dict]:
    """{δ: {"V=all": τ, "V=<verify_size>": τ, "tuned": bool}} for a relay at every δ of its grid; the relay
    is left at its tuned δ."""
    tuned = spec.method.config.repair_margin
    grid = spec.method.settings.repair_margins if spec.method.settings else params.joint.drelay.repair_margins
    out = {}
    for m in sorted(set(grid) | {tuned}):
        spec.method.config = dataclasses.replace(spec.method.config, repair_margin=float(m))
        out[float(m)] = {f"V={v or 'all'}": replay_methods({"m": spec}, val, pool, autocast=autocast,
                                                           verify_size=v)["m"].tau for v in verify_sizes(params)}
        out[float(m)]["tuned"] = m == tuned
    spec.method.config = dataclasses.replace(spec.method.config, repair_margin=tuned)
    return out


if __name__ == "__main__":
    main()
