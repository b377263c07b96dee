"""A stage for tests/training/test_distributed.py: the real `stage_main` (argument parsing, params, the
torchrun self-launch, the process group, rank 0's flow vs the other ranks' worker) around a plain
function instead of a Prefect flow. Each process records what it ran in OUT/rank<r>.json.

    python -m tests.training.ddp_stage_probe --params P [--set run.nproc_per_node=2] --out OUT
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from drelay.config import load_params
from drelay.training import distributed
from pipelines.common import stage_main


def _record(out: str, role: str, params) -> None:
    (total,) = distributed.sum_numbers(distributed.rank() + 1)  # a real collective: 1 + 2 over two ranks
    backend = __import__("torch.distributed").distributed.get_backend() if distributed.active() else None
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{distributed.rank()}.json").write_text(json.dumps({
        "role": role, "rank": distributed.rank(), "world": distributed.world_size(), "sum": total,
        "backend": backend, "nproc_per_node": params.run.nproc_per_node, "pid": os.getpid(),
        "torchrun": "TORCHELASTIC_RUN_ID" in os.environ}))


def probe_flow(params_path: str = "params.yaml", overrides: list[str] | None = None, out: str = "") -> None:
    """The stage's flow (rank 0)."""
    _record(out, "flow", load_params(params_path, overrides))


def probe_worker(params, out: str) -> None:
    _record(out, "worker", params)


if __name__ == "__main__":
    stage_main(probe_flow, options={"out": dict(required=True)}, worker=probe_worker,
               process_group=lambda params: distributed.process_group(params.target.device))
