"""One joint method trained with changed settings, beside the pipeline's own run, for a quick comparison.

Continues the train_dflash drafter of a reproduced workspace for joint.common.extra_steps on the same batches
as the train@ stage (same seed, same data split) with `--set` overrides, into
models/variants/<name>/ (checkpoints beside it: a killed run resumes), and prints the held-out metrics the
stage logs (replay τ at the tuned δ, native and oracle τ, replace rate, precision, harm) as one JSON line.
No MLflow run and no DVC outs: a probe, not a result of the pipeline. The DRelay v2 table in the README
(cpu-small) was measured with it, two variants at a time:

    cd runs/cpu-small && OMP_NUM_THREADS=1 ../../.venv/bin/python ../../benchmarks/train_variant.py \\
        rank256 --method drelay --set joint.drelay.lattice_rank=256 --set joint.drelay.lattice_ce=1.0
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
from drelay.data.records import load_distilled, split_sequences  # noqa: E402
from drelay.models.drafter import BlockDrafter  # noqa: E402
from drelay.models.target import Target  # noqa: E402
from drelay.training.trainer import train_method  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="the variant's folder name under models/variants/")
    ap.add_argument("--method", default="drelay")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override (repeatable)")
    args = ap.parse_args()
    params = load_params(args.params, args.set)
    torch.manual_seed(params.run.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    root = Path("models/variants") / args.name
    joint = dataclasses.replace(params.joint, common=dataclasses.replace(
        params.joint.common, out_dir=str(root), checkpoint_dir=str(root / "checkpoints")))
    target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
    train, val = split_sequences(load_distilled(params.distill.out_dir), params.train.val_fraction, params.run.seed)
    drafter = BlockDrafter.load(params.train.out_dir, target).float()
    start = time.time()

    def log(metrics: dict, step: int) -> None:
        print(step, {k: round(v, 4) for k, v in metrics.items() if "_pos" not in k}, flush=True)

    result = train_method(args.method, drafter, train, val, joint, params.train, pool_size=params.decode.pool_size,
                          seed=params.run.seed, log=log)
    final = {k: v for k, v in result.final.items() if "_pos" not in k}
    final.update(result.method_metrics, wall_s=time.time() - start, overrides=args.set)
    (root / "result.json").write_text(json.dumps(final, indent=2))
    print(json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
