"""Drafter sizing on this CPU: the DFlash drafter trained as train_dflash does, once per variant (`--set` overrides
of the params, e.g. more layers, more context layers, block size 16, more steps), on a reproduced workspace's
distilled data, with the held-out replay τ curve against training minutes, so that a size is picked by τ per
minute of the budget.

Each variant trains into models/sizing/<name>/ (checkpoints beside it: a killed run resumes; a finished one is
read back, not trained again) and writes result.json there: its held-out evaluations (step, minutes since the
start, replay τ with whole blocks checked, oracle top-k τ, held-out loss). The table prints every finished
variant of the folder; `--plot` draws the curves. A probe, not a pipeline result: no MLflow run, no DVC outs.
Run variants one per core (OMP_NUM_THREADS=1) to compare their minutes:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/drafter_sizing.py L2 --set drafter.num_layers=2 &
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/drafter_sizing.py base &
    wait; .venv/bin/python benchmarks/drafter_sizing.py --table --plot reports/drafter_sizing.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from drelay.config import load_params  # noqa: E402
from drelay.training.trainer import train_dflash  # noqa: E402
from pipelines.train_dflash import load_inputs  # noqa: E402

ROOT = Path("models/sizing")


def train_variant(name: str, params_path: str, overrides: list[str]) -> dict:
    params = load_params(params_path, overrides)
    torch.manual_seed(params.run.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    root = ROOT / name
    cfg = dataclasses.replace(params.train, out_dir=str(root / "drafter"), checkpoint_dir=str(root / "checkpoints"))
    _, drafter, train, val = load_inputs(params)
    start, curve = time.perf_counter(), []  # minutes: wall, evaluations included (a resumed run: since resuming)

    def log(metrics: dict, step: int) -> None:
        if "replay_tau" in metrics:
            blocks_per_s = metrics.get("blocks_per_s") or 0.0  # training only: the evaluations excluded
            curve.append({"step": step, "minutes": (time.perf_counter() - start) / 60,
                          "train_minutes": step * cfg.blocks_per_step / blocks_per_s / 60 if blocks_per_s else 0.0,
                          **{k: metrics[k] for k in ("replay_tau", "oracle_tau", "val_loss", "val_top1_pos1", "val_top1_pos2")
                             if k in metrics}})
            print(name, curve[-1], flush=True)

    result = train_dflash(drafter, train, val, cfg, pool_size=params.decode.pool_size, seed=params.run.seed, log=log)
    record = {"name": name, "overrides": overrides, "steps": result.steps, "best_step": result.best_step,
              "stopped_early": bool(result.stopped_early), "resumed_from": result.resumed_from,
              "minutes": (time.perf_counter() - start) / 60, "threads": torch.get_num_threads(),
              "drafter_parameters": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
              "final": {k: result.best[k] for k in ("replay_tau", "oracle_tau", "val_top1_pos1", "val_top1_pos2")
                        if k in result.best}, "curve": curve}
    (root / "result.json").write_text(json.dumps(record, indent=2))
    return record


def table(records: list[dict]) -> str:
    lines = ["| variant | overrides | trainable params | steps | train minutes | held-out replay τ (kept) "
             "| oracle τ | τ - 1 per train minute | curve: step τ |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        tau, minutes = r["final"].get("replay_tau", float("nan")), r["curve"][-1]["train_minutes"] if r["curve"] else 0
        points = " ".join(f"{c['step']}:{c['replay_tau']:.3f}" for c in r["curve"])
        lines.append(f"| {r['name']} | {' '.join(r['overrides']) or '(the profile)'} | "
                     f"{r['drafter_parameters'] / 1e6:.1f}M | {r['steps']} | {minutes:.1f} | {tau:.3f} | "
                     f"{r['final'].get('oracle_tau', float('nan')):.3f} | {(tau - 1) / max(minutes, 1e-9):.4f} "
                     f"| {points} |")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for r in records:
        ax.plot([c["train_minutes"] for c in r["curve"]], [c["replay_tau"] for c in r["curve"]], "o-", label=r["name"])
    ax.set(xlabel=f"training minutes ({records[0]['threads']} thread(s) each)", ylabel="held-out replay τ",
           title="DFlash drafter sizing")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?", help="the variant (a folder under models/sizing/); none: only the table")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override (repeatable)")
    ap.add_argument("--table", action="store_true", help="print every finished variant's row")
    ap.add_argument("--plot", type=Path, help="draw the τ-against-minutes curves into this PNG")
    args = ap.parse_args()
    if args.name:
        done = ROOT / args.name / "result.json"
        record = json.loads(done.read_text()) if done.is_file() else train_variant(args.name, args.params, args.set)
        print(json.dumps({k: v for k, v in record.items() if k != "curve"}), flush=True)
    records = [json.loads(p.read_text()) for p in sorted(ROOT.glob("*/result.json"))]
    if (args.table or not args.name) and records:
        print(table(records))
    if args.plot and records:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
