"""Faster fp32 linear layers for the few-row products of decoding on CPU.

`F.linear(x, W)` computes x @ W^T. On the CPUs we run on (2 AVX2 cores, PyTorch's MKL build) that
call is slow when x has few rows, as in a decode step (1 row), a verification (8-16 rows) or the
drafter's LM head over one block (7 rows): the same product computed as (W @ x^T)^T is 1.2-4x faster
in float32 (the 49,152 x 576 LM head over 8 rows, timed side by side in one process on this 2-core machine
while it was busy: 128 ms -> 41-48 ms, 2.7-3.1x; `benchmarks/target_forward.py` measures whole target
forwards with and without the rule). Large row counts and other dtypes keep `F.linear`.

The two orders sum in a different order, so results agree to float rounding, not bit for bit;
every forward of a patched module uses the rule, so speculative and plain decoding see the same
arithmetic for the same row count, as before.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 256  # (W @ x^T)^T was as fast or faster up to 512 rows; above, F.linear


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as (W @ x^T)^T for few-row float32 inputs on CPU."""
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    if not (0 < rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_row_linear(x, self.weight, self.bias)


def use_few_row_linear(module: nn.Module) -> int:
    """Route every `nn.Linear` inside `module` through `few_row_linear`; returns how many."""
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and getattr(sub.forward, "__func__", None) is not _forward:
            sub.forward = types.MethodType(_forward, sub)
            count += 1
    return count
