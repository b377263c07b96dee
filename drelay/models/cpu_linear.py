"""An opt-in rule for the few-row fp32 products of decoding on CPU: x @ W^T computed as (W @ x^T)^T.

On the CPU it was first measured on (2 AVX2 cores, PyTorch's MKL build, while the machine was busy) this
order made the 49,152 x 576 LM head over 8 rows 2.7-3.1x faster, and the target, the drafter and the repair
methods used it for every product of up to 256 rows. Measured again on the same kind of machine (2026-12-03,
fp32, 2 threads; `benchmarks/target_forward.py`), plain F.linear is as fast for 1 row and faster for the 2-8 rows
of a verification: see the README's "Few-row products" for the numbers. So the rule is off unless
DRELAY_FEW_ROW_LINEAR_MAX_ROWS=N (N > 0) is set when this module is first imported, for a CPU where it pays
(`benchmarks/target_forward.py --dtypes "float32,float32 few-row"` compares both). It is chosen once per process:
every forward of a patched module uses it, so speculative and plain decoding see the same arithmetic for the
same row count. The two orders sum differently: results agree to float rounding.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F
from torch import nn

# Products of up to this many rows take the rule; 0 (the default): none, F.linear everywhere.
MAX_ROWS = int(os.environ.get("DRELAY_FEW_ROW_LINEAR_MAX_ROWS", "0") or 0)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   max_rows: int | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as (W @ x^T)^T for float32 inputs on CPU of at most `max_rows`
    rows (default MAX_ROWS)."""
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    limit = MAX_ROWS if max_rows is None else max_rows
    if not (0 < rows <= limit and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_row_linear(x, self.weight, self.bias)


def use_few_row_linear(module: nn.Module) -> int:
    """Route every `nn.Linear` inside `module` through `few_row_linear` when the rule is on (MAX_ROWS > 0);
    returns how many were routed (0 when it is off)."""
    if MAX_ROWS <= 0:
        return 0
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and getattr(sub.forward, "__func__", None) is not _forward:
            sub.forward = types.MethodType(_forward, sub)
            count += 1
    return count
