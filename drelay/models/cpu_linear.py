"""The few-row fp32 products of decoding on CPU: x @ W^T computed as F.linear or as (W @ x^T)^T, whichever
this machine does faster, measured once per process for each weight shape and row count.

Which order is faster depends on the CPU and its BLAS path, and by a lot: on one 2-core AMD EPYC machine
(2026-12-03) F.linear was as fast for 1 row and faster for the 2-8 rows of a verification; on another of the same
kind the same day the 49,152 x 576 LM head over 2-3 rows took 26-36 ms with F.linear and 6-7 ms as (W @ x^T)^T,
and a whole 2-token target forward 119 ms against 44 ms (`benchmarks/target_forward.py`, README "Few-row
products"). So by default ("auto"), inside the live decoders (`decoding_products`: AR and speculative decoding
of one sequence), each patched linear, the first time it sees a float32 CPU input of r <= 8 rows (decode steps,
verifications, a block's drafts), times both orders on that weight shape and r rows (a few repeats, on constant
inputs, not touching the global RNG) and keeps the faster one (by a 10% margin, else F.linear) for the rest of the
process: every later forward of that shape and row count uses the same order, so speculative and plain decoding
see the same arithmetic for the same row count. Products of more rows, and all products outside the live
decoders (training, batched generation and distillation, replay), keep F.linear: what the pipeline writes does
not depend on this machine's timings. DRELAY_FEW_ROW_LINEAR_MAX_ROWS, read when this module is first imported:
"auto" (the default), 0 (off: F.linear everywhere; the test suite), or N > 0 (the rule for every product of up
to N rows, unmeasured). The two orders sum differently: results agree to float rounding.
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

AUTO_MAX_ROWS = 8  # "auto" measures products of up to this many rows
_SETTING = os.environ.get("DRELAY_FEW_ROW_LINEAR_MAX_ROWS", "auto").strip().lower() or "auto"
AUTO = _SETTING == "auto"
# Products of up to this many rows may take the rule (auto: where measured faster); 0: none, F.linear everywhere.
try:
    MAX_ROWS = AUTO_MAX_ROWS if AUTO else int(_SETTING)
except ValueError:
    raise ValueError(f"DRELAY_FEW_ROW_LINEAR_MAX_ROWS must be 'auto', 0 or a row count, got {_SETTING!r}") from None
_CHOICE: dict[tuple, bool] = {}  # (rows, out, in, bias, autocast) -> (W @ x^T)^T is faster (auto mode)
_SCOPE = {"decoding": False}  # inside `decoding_products` (auto mode applies only there)


@contextlib.contextmanager
def decoding_products():
    """The live decoders run inside this (also as a decorator): there auto mode measures and uses the faster order."""
    before = _SCOPE["decoding"]
    _SCOPE["decoding"] = True
    try:
        yield
    finally:
        _SCOPE["decoding"] = before


def _transposed(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x2.T).T.contiguous()
    return out if bias is None else out + bias


def _measured_faster(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether (W @ x^T)^T beats F.linear by 10% on this weight's shape for `rows` rows (measured once)."""
    key = (rows, *weight.shape, bias is not None, torch.is_autocast_enabled("cpu"))
    if key not in _CHOICE:
        x2 = torch.full((rows, weight.shape[1]), 0.5)  # constant: no RNG drawn, no denormals
        best = {}
        with torch.no_grad():
            for name, fn in (("linear", lambda: F.linear(x2, weight, bias)),
                             ("transposed", lambda: _transposed(x2, weight, bias))):
                fn()  # warm-up
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                best[name] = min(times)
        _CHOICE[key] = best["transposed"] < 0.9 * best["linear"]
    return _CHOICE[key]


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   max_rows: int | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as (W @ x^T)^T for float32 inputs on CPU of at most `max_rows`
    rows (default MAX_ROWS) where the rule applies (in auto mode: where it was measured faster)."""
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    limit = MAX_ROWS if max_rows is None else max_rows
    if not (0 < rows <= limit and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32):
        return F.linear(x, weight, bias)
    if AUTO and max_rows is None and not (_SCOPE["decoding"] and _measured_faster(rows, weight, bias)):
        return F.linear(x, weight, bias)
    out = _transposed(x.reshape(rows, x.shape[-1]), weight, bias)
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
