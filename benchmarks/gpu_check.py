"""GPU check of the engine and training on CUDA with random Llama targets (nothing downloaded).

    python benchmarks/gpu_check.py        (on a CUDA machine; on CPU it says so and exits 0)

1. fp32 losslessness on CUDA: speculative output vs AR greedy, several prompts and block sizes.
2. bf16 costs on a ~1B random Llama: one target forward of t new tokens over a 512-token cache
   (CUDA events, median), AR tokens/s, and speculative tokens/s with perfect drafts (the
   engine's ceiling at τ = B) and with an untrained drafter (its floor, τ ≈ 1).
3. distillation (batched generation with feature capture) and drafter training steps on CUDA.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drelay.config import TrainConfig
from drelay.decoding.check import compare_to_ar
from drelay.decoding.generate import ar_generate, speculative_generate
from drelay.models.drafter import BlockDrafter
from drelay.models.target import Target
from drelay.training.distill import generate_batch
from drelay.data.records import split_sequences
from drelay.models.repair import RepairMethod
from drelay.training.trainer import train_dflash


def random_target(hidden, layers, vocab, dtype, init=0.02, seed=0) -> Target:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=init)
    return Target(LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype), name=f"random-{hidden}x{layers}")


class Perfect(RepairMethod):
    """Drafts the target's own continuation (known in advance), in the pool or not: every block accepted."""

    name = "perfect"

    def __init__(self, prompt_len, continuation):
        super().__init__()
        self.prompt_len, self.continuation = prompt_len, continuation

    def select(self, block):
        first = int(block.anchor_pos[0]) + 1 - self.prompt_len
        n = block.pool_ids.shape[1]
        toks = [self.continuation[j] if j < len(self.continuation) else 0 for j in range(first, first + n)]
        return torch.tensor([toks], device=block.pool_ids.device)


def perfect(prompt_len, continuation):
    return Perfect(prompt_len, continuation)


def cuda_ms(fn, repeats=20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check needs CUDA; nothing to do on this machine")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = 0

    fast = "--fast" in sys.argv  # sections 3-4 only (training, DRelay), for a short device slot
    gen = torch.Generator().manual_seed(0)

    # 1. fp32 losslessness
    t32 = random_target(512, 8, 32000, torch.float32, init=0.3)
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (5, 17, 40, 90)]
    rows = []
    for block in (4, 8, 16) if not fast else ():
        drafter = BlockDrafter.for_target(t32, block_size=block)
        same = 0
        for p in prompts:
            ref = ar_generate(t32, p, 64).tokens
            for repair in (None, perfect(len(p), ref)):
                out = speculative_generate(t32, drafter, p, 64, method=repair).tokens
                report = compare_to_ar(t32, p, ref, out)
                same += report.identical
                if not report.identical:
                    print(f"  B={block}: {report.describe()}")
                    failures += report.is_bug
        rows.append((block, same, 2 * len(prompts)))
    print("\n| fp32 on CUDA | identical to AR |\n|---|---|")
    for block, same, total in rows:
        print(f"| B={block} | {same}/{total} |")

    # 2. bf16 costs on a ~1B random target
    t16 = random_target(2048, 16, 32000, torch.bfloat16)
    cache = t16.new_cache()
    t16.forward(torch.randint(3, 32000, (1, 512), device="cuda"), cache, logits_to_keep=1)
    print("\n| bf16 ~1B | t=1 | t=4 | t=8 | t=16 | t=32 |\n|---|---|---|---|---|---|")
    costs = []
    for t in (1, 4, 8, 16, 32) if not fast else ():
        ids = torch.randint(3, 32000, (1, t), device="cuda")
        pos = 512 + torch.arange(t, device="cuda")[None]

        def run():
            t16.forward(ids, cache, position_ids=pos)
            t16.crop(cache, t)
        costs.append(cuda_ms(run))
    print("| forward ms | " + " | ".join(f"{c:.2f}" for c in costs) + " |")
    prompt = torch.randint(3, 32000, (200,), generator=gen).tolist()
    ar = ar_generate(t16, prompt, 256 if not fast else 8)
    print(f"\n| bf16 ~1B decoding | tokens/s | tau | speedup |\n|---|---|---|---|\n| AR | {ar.stats.tokens_per_s:.1f} | 1 | 1.00 |")
    for block in (8, 16) if not fast else ():
        drafter = BlockDrafter.for_target(t16, block_size=block)
        for name, repair in (("untrained", None), ("perfect", perfect(len(prompt), ar.tokens))):
            speculative_generate(t16, drafter, prompt, 16, method=repair)  # warm-up
            out = speculative_generate(t16, drafter, prompt, 256, method=repair)
            print(f"| B={block} {name} | {out.stats.tokens_per_s:.1f} | {out.stats.tau:.2f} | "
                  f"{out.stats.tokens_per_s / ar.stats.tokens_per_s:.2f} |")
            if name == "perfect" and out.tokens != ar.tokens:
                print("  bf16 perfect-draft output differs from AR:", compare_to_ar(t16, prompt, ar.tokens, out.tokens).describe())

    # 3. distillation + training on CUDA
    t16.set_layer_ids([1, 7, 13])
    batch_prompts = [torch.randint(3, 32000, (int(n),), generator=gen).tolist() for n in torch.randint(20, 120, (64,))]
    t0 = time.perf_counter()
    seqs = []
    for i in range(0, 64, 32):
        seqs += generate_batch(t16, batch_prompts[i:i + 32], 128, set())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_tok = sum(s.response_len for s in seqs)
    train, val = split_sequences(seqs, 0.1, 0)
    drafter = BlockDrafter.for_target(t16, block_size=16, num_layers=2).float()
    cfg = TrainConfig(max_steps=30, blocks_per_step=512, anchors_per_sequence=32, warmup_steps=5, eval_every=30,
                      checkpoint_every=30, patience=0, out_dir="/tmp/gpu_drafter", checkpoint_dir="/tmp/gpu_ckpt")
    result = train_dflash(drafter, train, val, cfg, pool_size=8, seed=0)
    print(f"\n| CUDA pipeline | value |\n|---|---|\n| distill tokens/s (batch 32) | {n_tok / dt:.0f} |"
          f"\n| train blocks/s (B=16, 2 layers) | {result.blocks_per_s:.0f} |"
          f"\n| held-out loss after 30 steps | {result.best_val_loss:.3f} |")

    # 4. DRelay joint training and repaired decoding on CUDA (bf16 autocast through reader + GRU)
    from drelay.config import DRelaySettings, JointCommon, JointConfig
    from drelay.models.relay import DRelay
    from drelay.training.trainer import train_method

    jcfg = JointConfig(common=JointCommon(extra_steps=20, eval_every=20, checkpoint_every=20, replay_sequences=8,
                                          out_dir="/tmp/gpu_joint", checkpoint_dir="/tmp/gpu_joint_ckpt"),
                       drelay=DRelaySettings(repair_margins=(0.0, 1.0)))
    start = BlockDrafter.load(cfg.out_dir, t16).float()
    joint = train_method("drelay", start, train, val, jcfg, cfg, pool_size=8, seed=0)
    relay = DRelay.load(f"{jcfg.common.out_dir}/drelay/relay", t16.embed_tokens)
    drafter = BlockDrafter.load(f"{jcfg.common.out_dir}/drelay/drafter", t16)
    out = speculative_generate(t16, drafter, prompt, 64, method=relay)
    ref = ar_generate(t16, prompt, 64)
    report = compare_to_ar(t16, prompt, ref.tokens, out.tokens)
    failures += report.is_bug
    print(f"\n| DRelay on CUDA | value |\n|---|---|\n| joint blocks/s | {joint.blocks_per_s:.0f} |"
          f"\n| chosen repair margin δ | {joint.final['repair_margin']} |\n| repaired decoding vs AR (bf16) | {report.describe()} |"
          f"\n| selector share of step time | {out.stats.repair_s / max(out.stats.wall_s, 1e-9):.2f} |")
    print(f"\nunexplained divergences: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
