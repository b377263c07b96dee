"""Which implementation of the fused ops a model or engine runs, chosen once when it is bound to a device.

    DRELAY_KERNELS=auto       (default) the Triton launchers for CUDA devices, the torch references elsewhere
    DRELAY_KERNELS=triton     always Triton (on CPU only under TRITON_INTERPRET=1: the tests)
    DRELAY_KERNELS=reference  always the references (benchmarks, bisecting a kernel bug)

`kernel_ops(device)` returns a frozen `Ops`: the drafter, the relay and the engine keep the one they
were bound with, so the hot paths call `self.ops.<op>(...)` and never re-decide. On CPU `auto` is the
reference set, so CPU numbers are exactly what the plain torch code computes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from drelay.kernels import reference

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "DRELAY_KERNELS"
OPS = ("relay_select", "verify", "lm_head_topk", "support_loss")


@dataclass(frozen=True)
class Ops:
    """One implementation of every fused op; `fused` says whether they are the Triton launchers (which
    never materialise the [positions x V] logits where the op allows)."""

    relay_select: Callable
    verify: Callable
    lm_head_topk: Callable
    support_loss: Callable
    fused: bool


REFERENCE = Ops(*(getattr(reference, f"{op}_ref") for op in OPS), fused=False)


def backend() -> str:
    """The DRELAY_KERNELS setting, checked."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {BACKENDS}")
    return mode


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1, read when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_ops() -> Ops:
    return Ops(*(getattr(importlib.import_module(f"drelay.kernels.{op}"), op) for op in OPS), fused=True)


def kernel_ops(device: torch.device | str) -> Ops:
    """The ops for tensors on `device` under the DRELAY_KERNELS setting (see the module docstring)."""
    mode, on_cuda = backend(), torch.device(device).type == "cuda"
    if mode == "reference":
        return REFERENCE
    if mode == "triton":
        if not (on_cuda or interpreting()):
            raise RuntimeError(f"{ENV_VAR}=triton needs a CUDA device, or TRITON_INTERPRET=1 set before "
                               f"triton is imported (CPU interpreter)")
        return _triton_ops()
    return _triton_ops() if on_cuda and triton_installed() else REFERENCE
