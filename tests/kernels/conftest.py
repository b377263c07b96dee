"""Kernel tests run the Triton kernels in Triton's CPU interpreter, fp32 (and fp64), against the
pure-torch references of drelay/kernels/reference.py.

TRITON_INTERPRET=1 is set by tests/conftest.py, before anything imports triton: triton decorates its
own library functions (tl.zeros, tl.argmax, ...) at import, and a kernel interpreted against a triton
imported without it fails with "Cannot call @triton.jit'd outside of the scope of a kernel".
Export TRITON_INTERPRET=0 on a CUDA machine to run these tests compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

# fp32: the kernels sum in another order than torch (tiles, online softmax); fp64: the same, 1e-16 units
TOLERANCES = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CPU under the interpreter; CUDA when the tests are run compiled (TRITON_INTERPRET=0)."""
    if os.environ["TRITON_INTERPRET"] == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET=0 needs CUDA: the kernels cannot run compiled on CPU")
    return torch.device("cuda")


@pytest.fixture
def kernels(monkeypatch):
    """Set DRELAY_KERNELS for one test: kernels("triton") / kernels("reference")."""
    return lambda mode: monkeypatch.setenv("DRELAY_KERNELS", mode)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """assert_close with the tolerance of `dtype` (default: expected's dtype)."""
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype or expected.dtype])
