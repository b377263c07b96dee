"""The kernel choice: DRELAY_KERNELS picks the Triton launchers or the references once, for a device;
CPU defaults to the references, and the Triton path really runs interpreted kernels here."""

import pytest
import torch

from drelay.kernels import reference
from drelay.kernels.ops import OPS, REFERENCE, kernel_ops
from drelay.models.drafter import BlockDrafter
from drelay.models.relay import DRelay
from tests.conftest import make_tiny_target


def test_auto_on_cpu_is_the_reference(kernels):
    kernels("auto")
    ops = kernel_ops("cpu")
    assert ops is REFERENCE and not ops.fused
    for op in OPS:
        assert getattr(ops, op) is getattr(reference, f"{op}_ref")


def test_forced_triton_picks_the_launchers(kernels, device):
    kernels("triton")
    ops = kernel_ops(device)
    assert ops.fused
    for op in OPS:
        impl = getattr(ops, op)
        assert impl.__module__ == f"drelay.kernels.{op}" and impl.__name__ == op


def test_forced_reference(kernels, device):
    kernels("reference")
    assert kernel_ops(device) is REFERENCE


def test_models_keep_the_ops_they_were_bound_with(kernels):
    """Chosen once: a drafter and a relay keep the ops of their attach, whatever the setting says later."""
    target = make_tiny_target(vocab_size=24, dtype=torch.float32)
    kernels("triton")
    drafter = BlockDrafter.for_target(target, block_size=4)
    relay = DRelay.for_drafter(drafter, reader_dim=16, reader_heads=4, pool_size=4)
    kernels("reference")
    assert drafter.ops.fused and relay.ops.fused
    assert not drafter.attach(target).ops.fused and not relay.attach(target.embed_tokens).ops.fused


def test_kernels_are_interpreted_on_cpu(device):
    from triton.runtime.interpreter import InterpretedFunction

    from drelay.kernels import lm_head_topk, relay_select, support_loss, verify
    launched = [relay_select._relay_select_kernel, verify._verify_kernel, lm_head_topk._lm_head_topk_kernel,
                support_loss._support_grad_kernel]
    assert all(isinstance(k, InterpretedFunction) for k in launched) == (device.type == "cpu")


def test_bad_settings_are_errors(kernels, monkeypatch):
    kernels("fast")
    with pytest.raises(ValueError, match="DRELAY_KERNELS='fast'"):
        kernel_ops("cpu")
    kernels("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernel_ops("cpu")


def test_triton_itself_was_imported_under_the_interpreter(device):
    """The setting reached triton before its first import (see tests/conftest.py)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(standard.argmax, InterpretedFunction) == (device.type == "cpu")
