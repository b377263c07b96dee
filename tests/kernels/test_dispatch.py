"""The dispatch point: DRELAY_KERNELS picks the Triton launcher or the reference, CPU defaults to the
reference, and the Triton path really runs interpreted kernels here."""

import pytest
import torch

from drelay.kernels import reference
from drelay.kernels.reference import OPS, kernel, use_triton


def test_auto_on_cpu_is_the_reference(kernels):
    kernels("auto")
    x = torch.zeros(2)
    assert not use_triton(x)
    for op in OPS:
        assert kernel(op, x) is getattr(reference, f"{op}_ref")


def test_forced_triton_picks_the_launchers(kernels, device):
    kernels("triton")
    x = torch.zeros(2, device=device)
    assert use_triton(x)
    for op in OPS:
        impl = kernel(op, x)
        assert impl.__module__ == f"drelay.kernels.{op}" and impl.__name__ == op


def test_forced_reference(kernels):
    kernels("reference")
    assert kernel("verify", torch.zeros(2)) is reference.verify_ref


def test_kernels_are_interpreted_on_cpu(device):
    from triton.runtime.interpreter import InterpretedFunction

    from drelay.kernels import lm_head_topk, relay_select, support_loss, verify
    launched = [relay_select._relay_select_kernel, verify._verify_kernel, lm_head_topk._lm_head_topk_kernel,
                support_loss._support_grad_kernel]
    assert all(isinstance(k, InterpretedFunction) for k in launched) == (device.type == "cpu")


def test_bad_settings_are_errors(kernels, monkeypatch):
    kernels("fast")
    with pytest.raises(ValueError, match="DRELAY_KERNELS='fast'"):
        use_triton(torch.zeros(1))
    kernels("auto")
    with pytest.raises(ValueError, match="unknown kernel op 'softmax'"):
        kernel("softmax", torch.zeros(1))
    kernels("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        use_triton(torch.zeros(1))


def test_triton_itself_was_imported_under_the_interpreter(device):
    """The setting reached triton before its first import (see tests/conftest.py)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(standard.argmax, InterpretedFunction) == (device.type == "cpu")
