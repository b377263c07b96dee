"""What every launcher shares: argument checks that name the bad argument, and launch settings that
differ between the CPU interpreter (few, large programs: each interpreted op costs ~50 µs) and CUDA."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drelay.kernels.ops import interpreting

__all__ = ["check", "compute_dtype", "interpreting", "pow2"]


def check(name: str, tensor: torch.Tensor | None, shape: tuple, dtype: torch.dtype | None = None,
          device: torch.device | None = None) -> None:
    """Raise ValueError naming `name` unless tensor has `shape` (None: any size there), `dtype`, `device`."""
    if tensor is None:
        raise ValueError(f"{name} is required")
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} must be on {device}, got {tensor.device}")


def compute_dtype(dtype: torch.dtype):
    """Arithmetic inside a kernel: float64 for float64 inputs, float32 otherwise (bf16/fp16 upcast)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))
