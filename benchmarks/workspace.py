"""What the benchmarks that run in a reproduced workspace (the repo root, or runs/<profile>/) share: its params,
its target and the held-out split of its distilled data (where settings are chosen, never the evaluation)."""

from __future__ import annotations

import torch

from drelay.config import load_params
from drelay.data.records import load_distilled, split_sequences
from drelay.models.target import Target


def load_workspace(params_path: str = "params.yaml"):
    """(params, target, held-out sequences) as the train@ stages see them (seed, threads, split)."""
    params = load_params(params_path)
    torch.manual_seed(params.run.seed)
    if params.run.threads:
        torch.set_num_threads(params.run.threads)
    target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
    _, val = split_sequences(load_distilled(params.distill.out_dir), params.train.val_fraction, params.run.seed)
    return params, target, val
