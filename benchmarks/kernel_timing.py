"""Each Triton kernel against its pure-torch reference at paper shapes (B=16, k=8, H=4096, V=151,936).

    python benchmarks/kernel_timing.py            # CUDA: timing table; on CPU it says so and exits 0
    python benchmarks/kernel_timing.py --memory   # anywhere: memory saved by lm_head_topk / support_loss

Timing: median over `--repeats` runs with CUDA events, inputs rotated over `--rotate` copies (so the
logits of verify, ~10 MB a block, do not sit in the 50 MB L2 between runs), after warm-up (Triton
compiles on the first call). Throughput is counted from the bytes each op must read (GB/s) or the
FLOPs of its matmuls (TFLOP/s); the reference pays more (it materialises the logits).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from drelay.kernels import reference
from drelay.kernels.reference import SelectorWeights


@dataclass(frozen=True)
class Shapes:
    block_size: int = 16  # B: n = B-1 drafted positions
    pool_size: int = 8  # k
    hidden_size: int = 4096  # H
    vocab_size: int = 151_936  # V (Qwen3)
    reader_dim: int = 256  # d_r
    bilinear_rank: int = 64  # R
    batch: int = 1  # decoding batch (the engine runs batch 1)
    train_rows: int = 3840  # training rows N = blocks x (B-1), e.g. 16 sequences x 16 anchors x 15

    @property
    def n(self) -> int:
        return self.block_size - 1


# ----------------------------------------------------------------------------------- memory
def memory_rows(s: Shapes) -> list[tuple[str, float, float]]:
    """(what, reference bytes, fused bytes) of the vocabulary-sized buffers, from the shapes alone."""
    from drelay.kernels.lm_head_topk import launch_config
    from drelay.kernels.support_loss import CUDA_CHUNK

    rows = []
    N = s.batch * s.n
    splits = launch_config(N, s.hidden_size, s.vocab_size, interpreted=False)[3]
    # reference: bf16 logits, their fp32 copy and the fp32 log_softmax; fused: per-split top-k + (max, Σexp)
    ref = N * s.vocab_size * (2 + 4 + 4)
    fused = N * splits * (s.pool_size * (4 + 4) + 4 + 4)
    rows.append((f"lm_head_topk, decoding ({N} positions)", ref, fused))
    N = s.train_rows
    splits = launch_config(N, s.hidden_size, s.vocab_size, interpreted=False)[3]
    # reference: bf16 logits + fp32 log_softmax kept for backward, fp32 dL/dz in backward (the hinge's
    # and the pool's fp32 copies come and go on top of these); fused: the per-split top-(k+1) and
    # (max, Σexp) in forward, then one N x chunk fp32 block of logits / gradient at a time in backward
    ref = N * s.vocab_size * (2 + 4 + 4)
    fused = max(N * splits * ((s.pool_size + 1) * (4 + 4) + 4 + 4), N * min(CUDA_CHUNK, s.vocab_size) * 4)
    rows.append((f"support_loss, training ({N} rows)", ref, fused))
    return rows


def print_memory(s: Shapes) -> None:
    print(f"Memory of the vocabulary-sized buffers (V={s.vocab_size:,}, H={s.hidden_size}, k={s.pool_size}):")
    print(f"| {'op':40s} | {'reference':>12s} | {'fused':>10s} | {'saved':>12s} | {'ratio':>5s} |")
    print(f"| {'-' * 40} | {'-' * 12} | {'-' * 10} | {'-' * 12} | {'-' * 5} |")
    for what, ref, fused in memory_rows(s):
        print(f"| {what:40s} | {ref / 2**20:8.1f} MiB | {fused / 2**20:6.2f} MiB | "
              f"{(ref - fused) / 2**20:8.1f} MiB | {ref / fused:4.0f}x |")


# ----------------------------------------------------------------------------------- timing
def cuda_ms(fn: Callable[[int], object], repeats: int, rotate: int) -> float:
    """Median milliseconds of fn(i) (i picks the rotated input set), CUDA events around each call."""
    for i in range(3):
        fn(i % rotate)
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % rotate)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(s: Shapes, rotate: int, dev: str = "cuda"):
    """(name, triton fn(i), reference fn(i), bytes, flops) for each op at shapes s."""
    from drelay.kernels.lm_head_topk import lm_head_topk
    from drelay.kernels.relay_select import relay_select
    from drelay.kernels.support_loss import support_loss
    from drelay.kernels.verify import verify

    bf16 = torch.bfloat16
    b, n, k, H, V, d, R = s.batch, s.n, s.pool_size, s.hidden_size, s.vocab_size, s.reader_dim, s.bilinear_rank
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return torch.randn(*shape, device=dev, generator=gen, dtype=dtype) * scale

    weight = rnd(V, H, dtype=bf16, scale=0.02)  # the LM head: one copy, as in use (1.2 GB, never in L2)
    out = []

    # relay_select: fp32 selector, batch b
    w = SelectorWeights(rnd(3 * d, d, scale=0.05), rnd(3 * d), rnd(d), rnd(d), 1e-5, rnd(d, d, scale=0.05),
                        rnd(1, d), rnd(1), rnd(R, d, scale=0.05))
    sel = [(rnd(b, 3 * d), rnd(b, n, k, 3 * d), rnd(b, n, k, d), w, rnd(b, n, k, R), rnd(b, n, k))
           for _ in range(rotate)]
    sel_bytes = 4 * (n * (3 * d * d + d * d + R * d) + b * n * k * (3 * d + d + R + 1))
    out.append(("relay_select", lambda i: relay_select(*sel[i], repair_margin=0.1),
                lambda i: reference.relay_select_ref(*sel[i], repair_margin=0.1), sel_bytes, 0))

    # verify: bf16 target logits, drafts = the argmax (every row read: the worst case)
    logits = [rnd(b, n + 1, V, dtype=bf16) for _ in range(rotate)]
    drafts = [x.argmax(-1)[:, :-1].contiguous() for x in logits]
    out.append(("verify greedy", lambda i: verify(drafts[i], logits[i]),
                lambda i: reference.verify_ref(drafts[i], logits[i]), b * (n + 1) * V * 2, 0))
    noise = [(torch.rand(b, n, device=dev, dtype=torch.float64),
              torch.empty(b, V, device=dev, dtype=torch.float64).exponential_()) for _ in range(rotate)]
    out.append(("verify T=1 (residual)", lambda i: verify(drafts[i], logits[i], 1.0, *noise[i]),
                lambda i: reference.verify_ref(drafts[i], logits[i], 1.0, *noise[i]),
                b * (n + 1) * V * 2 * 2 + b * V * 8, 0))

    # lm_head_topk: the block's normed hidden states through the head
    hidden = [rnd(b * n, H, dtype=bf16) for _ in range(rotate)]
    out.append(("lm_head_topk", lambda i: lm_head_topk(hidden[i], weight, k),
                lambda i: reference.lm_head_topk_ref(hidden[i], weight, k), V * H * 2, 2 * b * n * H * V))

    # support_loss forward + backward (dx only: the head is frozen)
    rows = [rnd(s.train_rows // n, n, H, dtype=bf16).requires_grad_() for _ in range(2)]
    labels = torch.randint(0, V, (s.train_rows // n, n), device=dev, generator=gen)

    def step(fn, i):
        ce, hinge, _, _ = fn(rows[i % 2], weight, labels, k, 7.0, 1.0)
        (ce + hinge).backward()

    out.append(("support_loss fwd+bwd", lambda i: step(support_loss, i), lambda i: step(reference.support_loss_ref, i),
                3 * V * H * 2, 3 * 2 * s.train_rows * H * V))
    return out


def print_timing(s: Shapes, repeats: int, rotate: int) -> None:
    print(f"{torch.cuda.get_device_name()} | B={s.block_size} k={s.pool_size} H={s.hidden_size} V={s.vocab_size:,} "
          f"d_r={s.reader_dim} R={s.bilinear_rank} batch={s.batch} train rows={s.train_rows}")
    print(f"| {'op':22s} | {'triton ms':>9s} | {'torch ms':>9s} | {'speedup':>7s} | {'triton GB/s':>11s} | "
          f"{'triton TFLOP/s':>14s} |")
    print(f"| {'-' * 22} | {'-' * 9} | {'-' * 9} | {'-' * 7} | {'-' * 11} | {'-' * 14} |")
    for name, fused, ref, nbytes, flops in cases(s, rotate):
        t_fused, t_ref = cuda_ms(fused, repeats, rotate), cuda_ms(ref, repeats, rotate)
        gbps = f"{nbytes / t_fused / 1e6:11.1f}"
        tflops = f"{flops / t_fused / 1e9:14.1f}" if flops else f"{'-':>14s}"
        print(f"| {name:22s} | {t_fused:9.3f} | {t_ref:9.3f} | {t_ref / t_fused:6.1f}x | {gbps} | {tflops} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", action="store_true", help="print the memory table only (no CUDA needed)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rotate", type=int, default=8, help="input copies cycled through while timing")
    parser.add_argument("--batch", type=int, default=Shapes.batch)
    parser.add_argument("--train-rows", type=int, default=Shapes.train_rows)
    args = parser.parse_args()
    shapes = Shapes(batch=args.batch, train_rows=args.train_rows)
    print_memory(shapes)
    if args.memory:
        return 0
    if not torch.cuda.is_available():
        print("\nbenchmarks/kernel_timing.py times the Triton kernels and needs CUDA; none here (--memory works anywhere).")
        return 0
    print()
    print_timing(shapes, args.repeats, args.rotate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
