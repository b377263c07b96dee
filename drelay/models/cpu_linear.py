"""The few-row fp32 products of decoding on CPU: x @ W^T computed as F.linear or as (W @ x^T)^T, whichever
this machine runs faster for that many rows, measured once per process on whole target forwards.

Which order is faster depends on the CPU, its BLAS path and the row count, and by a lot: on one 2-core AMD EPYC
machine (2026-12-03) a whole target forward over a 300-token context took 65 / 125 ms for 1 / 2 new tokens with
F.linear and 90 / 58 ms with (W @ x^T)^T (`benchmarks/target_forward.py`); on another of the same kind the same
day F.linear was as fast for 1 row and faster for 2-8. Timing single products in isolation misjudged it (it picked
the slower order for the 1-row LM head), so by default ("auto") the live decoders (`decoding_products`: AR and
speculative decoding of one sequence), before their first timed step, time whole forwards of the target for
each row count 1..AUTO_MAX_ROWS in both orders (`choose_by_forwards`, once per process, on constant inputs: no
RNG is drawn) and keep, per row count, (W @ x^T)^T where it was at least 5% faster, else F.linear. Every later
product of that many rows inside the live decoders (target, drafter and repair heads alike) uses the kept order,
so speculative and plain decoding see the same arithmetic for the same row count. Products of more rows, and all
products outside the live decoders (training, batched generation and distillation, replay), keep F.linear: what
the pipeline writes does not depend on this machine's timings. DRELAY_FEW_ROW_LINEAR_MAX_ROWS, read when this
module is first imported: "auto" (the default), 0 (off: F.linear everywhere; the test suite), or N > 0 (the rule
for every product of up to N rows, unmeasured). The two orders sum differently: results agree to float rounding.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

AUTO_MAX_ROWS = 8  # "auto" measures products of up to this many rows
AUTO_MARGIN = 0.95  # (W @ x^T)^T is kept for a row count when its forward takes < 95% of F.linear's
_SETTING = os.environ.get("DRELAY_FEW_ROW_LINEAR_MAX_ROWS", "auto").strip().lower() or "auto"
AUTO = _SETTING == "auto"
# Products of up to this many rows may take the rule (auto: where measured faster); 0: none, F.linear everywhere.
try:
    MAX_ROWS = AUTO_MAX_ROWS if AUTO else int(_SETTING)
except ValueError:
    raise ValueError(f"DRELAY_FEW_ROW_LINEAR_MAX_ROWS must be 'auto', 0 or a row count, got {_SETTING!r}") from None
# What a live timing depends on besides the models and settings (evaluate stamps its live cells with it).
MODE = "auto: per row count, by whole forwards" if AUTO else f"max_rows={MAX_ROWS}"
# auto mode: row count -> (W @ x^T)^T was measured faster (`choose_by_forwards`); unmeasured counts take F.linear
ROW_CHOICE: dict[int, bool] = {}
ROW_TIMES: dict[int, dict[str, float]] = {}  # row count -> median ms of a whole forward per order, as measured
_SCOPE = {"decoding": False, "force": None}  # inside `decoding_products`; an order forced while measuring


@contextlib.contextmanager
def decoding_products():
    """The live decoders run inside this (also as a decorator): there auto mode uses the measured order."""
    before = _SCOPE["decoding"]
    _SCOPE["decoding"] = True
    try:
        yield
    finally:
        _SCOPE["decoding"] = before


def needs_measuring() -> bool:
    """Whether auto mode has yet to choose the orders in this process (`choose_by_forwards`)."""
    return AUTO and not ROW_CHOICE


def choose_by_forwards(forward: Callable[[int], None], repeats: int = 3) -> dict[int, bool]:
    """Times `forward(rows)` (one whole model forward of that many new tokens, as the decoders run it) for every
    row count 1..AUTO_MAX_ROWS with each order forced, alternating the orders `repeats` times after a warm-up,
    and keeps the faster order per row count in ROW_CHOICE (the median ms in ROW_TIMES). Returns ROW_CHOICE."""
    choice, times = {}, {}
    try:
        with decoding_products():
            for rows in range(1, AUTO_MAX_ROWS + 1):
                runs: dict[str, list[float]] = {"linear": [], "transposed": []}
                for rep in range(repeats + 1):
                    for order in runs:
                        _SCOPE["force"] = order == "transposed"
                        t0 = time.perf_counter()
                        forward(rows)
                        if rep:  # the first round warms up
                            runs[order].append(1000 * (time.perf_counter() - t0))
                times[rows] = {order: statistics.median(ms) for order, ms in runs.items()}
                choice[rows] = times[rows]["transposed"] < AUTO_MARGIN * times[rows]["linear"]
    finally:
        _SCOPE["force"] = None
    ROW_TIMES.clear()
    ROW_TIMES.update(times)
    ROW_CHOICE.clear()
    ROW_CHOICE.update(choice)
    return dict(ROW_CHOICE)


def measured_orders() -> dict[int, dict]:
    """{rows: {"linear": ms, "transposed": ms, "kept": order}} as this process measured them ({} if not)."""
    return {rows: {**t, "kept": "transposed" if ROW_CHOICE.get(rows) else "linear"} for rows, t in ROW_TIMES.items()}


def _transposed(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x2.T).T.contiguous()
    return out if bias is None else out + bias


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   max_rows: int | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as (W @ x^T)^T for float32 inputs on CPU of at most `max_rows`
    rows (default MAX_ROWS) where the rule applies (in auto mode: inside the live decoders, for the row counts
    where it was measured faster)."""
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    limit = MAX_ROWS if max_rows is None else max_rows
    if not (0 < rows <= limit and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32):
        return F.linear(x, weight, bias)
    if AUTO and max_rows is None:
        chosen = _SCOPE["force"] if _SCOPE["force"] is not None else ROW_CHOICE.get(rows, False)
        if not (_SCOPE["decoding"] and chosen):
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
