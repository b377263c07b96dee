"""Shared fixtures: tiny random HF targets (real transformers models, made on the fly)."""

from __future__ import annotations

import os

# Triton's CPU interpreter for tests/kernels. It must be on before triton is first imported (its own
# library functions are decorated then), and transformers imports triton, so it is set here, for the
# whole session. Harmless elsewhere: on CPU nothing but tests/kernels launches a Triton kernel (the
# kernels' dispatch defaults to the torch reference there). TRITON_INTERPRET=0 runs them compiled on CUDA.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from drelay.models.target import Target  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def make_tiny_target(vocab_size: int = 96, dtype: torch.dtype = torch.float64, seed: int = 0,
                     num_layers: int = 6, init: float = 0.3, max_positions: int = 512) -> Target:
    """A random 6-layer Llama. A large init std makes its greedy continuations varied, not one
    repeated token, so acceptance lengths and stop tokens land everywhere in a block."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, tie_word_embeddings=True,
                      initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Target(LlamaForCausalLM(cfg).to(dtype), name=f"tiny-llama-{vocab_size}-{seed}")


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core CPU they oversubscribe it
    (seen ~100x slower). Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_target() -> Target:
    return make_tiny_target()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; without it they are reported as skipped, never silently passed."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mirror():
    """The offline data copies (benchmarks/, train_prompts/): `shared/` beside the repo clone."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1].parent / "shared"  # <repo>/../shared
    if not (path / "benchmarks").is_dir():  # CI has it beside the clone: its absence is a failure
        pytest.fail(f"offline data mirror not found at {path} (shared/ must sit beside the repo)")
    return path
