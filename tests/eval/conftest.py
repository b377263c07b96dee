"""A tiny random target with SmolLM2's tokenizer (chat template, stop tokens) and an untrained B=4
drafter, shared by the evaluation tests of a session."""

import pytest
import torch

from drelay.models.drafter import BlockDrafter
from drelay.models.target import Target, make_tiny_random_target


@pytest.fixture(scope="session")
def chat_target_and_drafter(tmp_path_factory):
    path = make_tiny_random_target(tmp_path_factory.mktemp("target") / "tiny", seed=3)
    target = Target.load(path, dtype="float32")
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=4).float()
    return target, drafter


@pytest.fixture(scope="session")
def prepared_benchmarks(mirror, tmp_path_factory):
    """<data.out_dir>/benchmarks as prepare_data writes it (the evaluation reads these, not the mirror)."""
    from drelay.data.benchmarks import BENCHMARK_NAMES, load_benchmark
    from drelay.io import write_jsonl

    out = tmp_path_factory.mktemp("prepared") / "benchmarks"
    for name in BENCHMARK_NAMES:
        write_jsonl(load_benchmark(name, mirror), out / f"{name}.jsonl")
    return out
