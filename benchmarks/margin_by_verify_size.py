"""DRelay's repair margin δ against the number of drafts the target checks, on the held-out distilled split.

The train@drelay stage picks δ by held-out replay τ with whole blocks checked; the evaluation and the live
engine check only the first `decode.verify_size` tokens (3 on the default profile), where only the first
drafts' replacements count. This replays the trained drelay (and, for reference, the other methods named)
along the held-out sequences (T = 0, exact) for each δ of its grid (`repair_margins`), with whole blocks and with
decode.verify_size, and prints τ per δ and verify size.

    .venv/bin/python benchmarks/margin_by_verify_size.py [--params P] [--methods drelay dspark] [--out FILE]
    (run it where the pipeline ran: the repo root, or runs/<profile>/)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drelay.eval.replay_eval import replay_methods  # noqa: E402
from drelay.models.methods import load_speculator  # noqa: E402
from workspace import load_workspace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--methods", nargs="*", default=["drelay", "dspark", "dflash2", "dflash"])
    ap.add_argument("--joint-dir", type=Path, help="where the methods' folders are (default: joint.common.out_dir; "
                    "models/variants for benchmarks/train_variant.py's)")
    ap.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = ap.parse_args()
    params, target, val = load_workspace(args.params)
    joint_dir, pool = args.joint_dir or Path(params.joint.common.out_dir), params.decode.pool_size
    autocast = params.train.precision == "bfloat16"
    sizes = [0, params.decode.verify_size] if params.decode.verify_size else [0]
    rows: dict[str, dict[str, float]] = {}
    for name in args.methods:
        spec = load_speculator(target, joint_dir, name)
        margins = [None]
        if hasattr(getattr(spec.method, "config", None), "repair_margin"):  # a relay: every δ of its grid
            trained = spec.method.config.repair_margin
            grid = spec.method.settings.repair_margins if spec.method.settings else params.joint.drelay.repair_margins
            margins = sorted(set(grid) | {trained})
        for margin in margins:
            if margin is not None:
                spec.method.config = dataclasses.replace(spec.method.config, repair_margin=float(margin))
            label = name if margin is None else f"{name} δ={margin:g}" + (" (tuned)" if margin == trained else "")
            rows[label] = {f"V={v or 'all'}": replay_methods({name: spec}, val, pool, autocast=autocast,
                                                             verify_size=v)[name].tau for v in sizes}
            print(label, rows[label], file=sys.stderr, flush=True)
    cols = [f"V={v or 'all'}" for v in sizes]
    print(f"\nheld-out replay τ, T = 0, {len(val)} sequences, pool k = {pool} ({args.params}); V: drafts checked + 1\n")
    print("| method | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for label, row in rows.items():
        print(f"| {label} | " + " | ".join(f"{row[c]:.4f}" for c in cols) + " |")
    if args.out:
        args.out.write_text(json.dumps({"sequences": len(val), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
