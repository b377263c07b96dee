"""Write a trained drafter (and optionally its relay) as an SGLang 0.5.23 DFlash draft folder.

    python -m drelay.serving.export --drafter DIR [--target DIR] [--relay DIR] --out DIR

The folder SGLang loads (`--speculative-draft-model-path`):
    config.json                 a Qwen3-style config, architectures ["DFlashDraftModel"], with the draft
                                settings in `dflash_config` (block size, target layer ids, number of target
                                layers, mask token and its id)
    model.safetensors           our weights under SGLang's names (`sglang_name`): fc, hidden_norm, layers.*,
                                norm; no embedding and no LM head (both are the target's)
and DRelay's side files, which only the DRELAY worker (drelay/serving/plugin.py) reads:
    drelay_mask_embedding.safetensors   our learned MASK vector (see below)
    drelay_serving.json                 what the worker needs besides: the relay folder, its repair margin δ
                                        and pool size k, the mask token id
    relay/                              the relay folder as saved (config.json + model.safetensors)

Why the mask vector is a side file: SGLang embeds the block's MASK positions with the *target's*
embedding row of `mask_token_id` (a trained `mask_embedding.pt` is merged into the target's table). Our
targets tie embedding and LM head (SmolLM2), so such a merge would rewrite a row of the target's LM head
and could change its output. The DRELAY worker instead gives the draft a private copy of the table with
that row replaced. Plain DFLASH on this folder embeds MASK with the target's own row of mask_token_id:
lossless, but its drafts are not the ones we trained.

Our drafter is the DFlash layout (DESIGN §1.1): context features = fc([f_l1; ...; f_lm]) -> RMSNorm, which
is SGLang's `project_target_hidden` (fc + hidden_norm); every layer's k/v projections read those vectors
with no input norm (`prepare_context_hidden_for_kv` is the identity); Qwen3 q/k norms; bidirectional
attention inside the block (SGLang's ENCODER_ONLY, its default without `layer_types`); the final `norm`
before the target's head.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from drelay.models.drafter import BlockDrafter, DraftModelConfig, DrafterError
from drelay.models.folder import CONFIG_NAME, WEIGHTS_NAME, load_folder

SGLANG_ARCHITECTURE = "DFlashDraftModel"
MASK_TOKEN = "<|drelay_mask|>"  # a name no tokenizer has, so SGLang's mask-token/vocab cross-check never fires
MASK_FILE = "drelay_mask_embedding.safetensors"
MASK_KEY = "mask_embedding"
SERVING_FILE = "drelay_serving.json"
RELAY_DIR = "relay"
FORMAT_VERSION = 1

# our parameter name (inside layers.{i}.) -> SGLang's; DFlashDraftModel.load_weights stacks q/k/v and gate/up
_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"fc.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
# exported, but not into model.safetensors: the MASK vector, and a draft vocabulary's ids (SGLang's DFlash
# scores the whole vocabulary; the ids are kept for the record, see drelay_serving.json's draft_vocab)
_SIDE_NAMES = {"mask_embedding": MASK_KEY, "vocab_ids": "draft_vocab_ids"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class ExportError(RuntimeError):
    """A drafter, target or relay that cannot be served as an SGLang DFlash draft."""


def sglang_name(name: str) -> str:
    """Our BlockDrafter state-dict name -> SGLang's DFlashDraftModel checkpoint name. A name not listed
    is an error, so a new drafter part can never be dropped from the export silently."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ExportError(f"drafter parameter {name!r} has no SGLang DFlash counterpart: this drafter has a part "
                      f"the DFlash draft format cannot carry")


def read_target_config(target_dir: Path) -> dict:
    """The target's HF config.json (its text part for multimodal configs); only the config is read."""
    path = Path(target_dir) / CONFIG_NAME
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ExportError(f"no target config at {path}: pass the target's HF folder with --target") from err
    return config.get("text_config", config)


def draft_config(cfg: DraftModelConfig, target: dict, mask_token_id: int, dtype: str) -> dict:
    """SGLang's DFlash draft config.json for a drafter config `cfg` and the target's HF config."""
    num_target_layers = int(target["num_hidden_layers"])
    dflash = {"block_size": cfg.block_size, "target_layer_ids": list(cfg.target_layer_ids),
              "num_target_layers": num_target_layers, "mask_token": MASK_TOKEN, "mask_token_id": mask_token_id}
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "qwen3",  # Qwen3 layers: per-head q/k RMSNorm, no attention bias
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": int(target.get("max_position_embeddings", 32768)),
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": dflash,
        "drelay": {"format": FORMAT_VERSION, "target_name": cfg.target_name,
                   "target_fingerprint": cfg.target_fingerprint},
    }


def check_against_target(cfg: DraftModelConfig, target: dict) -> None:
    """The drafter must fit the target SGLang will serve it with."""
    layers = int(target["num_hidden_layers"])
    if int(target["hidden_size"]) != cfg.hidden_size or int(target["vocab_size"]) != cfg.vocab_size:
        raise ExportError(f"drafter (width {cfg.hidden_size}, vocabulary {cfg.vocab_size}) does not fit the target "
                          f"(width {target['hidden_size']}, vocabulary {target['vocab_size']})")
    if not cfg.target_layer_ids:
        raise ExportError("drafter has no target_layer_ids: it reads no context features, which DFlash requires")
    # SGLang captures layer i's output as the input of layer i + 1, so the last layer's output never is
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < layers - 1]
    if bad:
        raise ExportError(f"target layer ids {bad} cannot be captured by SGLang for a {layers}-layer target "
                          f"(valid: 0..{layers - 2})")


def _read_weights(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def export_relay(relay_dir: Path, cfg: DraftModelConfig, out: Path) -> dict:
    """Validate and copy the relay folder to out/relay; its serving settings for drelay_serving.json."""
    from drelay.models.relay import DRelay, RelayError

    try:
        relay = DRelay.load(relay_dir)
    except RelayError as err:
        raise ExportError(str(err)) from err
    rc = relay.config
    if rc.hidden_size != cfg.hidden_size or rc.block_size != cfg.block_size:
        raise ExportError(f"relay (hidden {rc.hidden_size}, block {rc.block_size}) was not made for this drafter "
                          f"(hidden {cfg.hidden_size}, block {cfg.block_size})")
    if rc.vocab_size and rc.vocab_size != cfg.vocab_size:
        raise ExportError(f"relay vocabulary {rc.vocab_size} != drafter vocabulary {cfg.vocab_size}")
    (out / RELAY_DIR).mkdir()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        shutil.copyfile(relay_dir / name, out / RELAY_DIR / name)
    return {"relay": RELAY_DIR, "repair_margin": rc.repair_margin, "pool_size": rc.pool_size}


def export_for_sglang(drafter_dir: str | Path, out_dir: str | Path, target_dir: str | Path | None = None,
                      relay_dir: str | Path | None = None, mask_token_id: int | None = None) -> Path:
    """Write `out_dir` (see the module docstring). target_dir defaults to the drafter's recorded target
    (its config's target_name) when that folder exists. An existing out_dir is replaced as a whole; the
    folder is written beside it first, so a failed export leaves nothing half-written."""
    drafter_dir, out = Path(drafter_dir), Path(out_dir)
    try:  # strict: a missing or extra tensor, or a corrupt config, is a DrafterError naming the file
        drafter = load_folder(drafter_dir, BlockDrafter, DraftModelConfig, DrafterError, "drafter")
    except DrafterError as err:
        raise ExportError(str(err)) from err
    cfg = drafter.config
    if target_dir is None:
        if not cfg.target_name or not (Path(cfg.target_name) / CONFIG_NAME).is_file():
            raise ExportError(f"the drafter's recorded target {cfg.target_name!r} is not a folder here: pass --target")
        target_dir = cfg.target_name
    target = read_target_config(Path(target_dir))
    check_against_target(cfg, target)
    mask_token_id = int(target["vocab_size"]) - 1 if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask_token_id < int(target["vocab_size"]):
        raise ExportError(f"mask_token_id {mask_token_id} is outside the target vocabulary of {target['vocab_size']}")

    raw = _read_weights(drafter_dir / WEIGHTS_NAME)  # the saved tensors in their saved dtype
    weights, side = {}, {}
    for name, tensor in raw.items():
        if name in _SIDE_NAMES:
            side[_SIDE_NAMES[name]] = tensor.contiguous()
        else:
            weights[sglang_name(name)] = tensor.contiguous()
    if MASK_KEY not in side:
        raise ExportError(f"drafter weights {drafter_dir / WEIGHTS_NAME} have no mask_embedding")
    dtype = str(weights["fc.weight"].dtype).removeprefix("torch.")

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(draft_config(cfg, target, mask_token_id, dtype), indent=2))
        save_file(weights, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        save_file(side, tmp / MASK_FILE, metadata={"format": "pt"})
        serving = {"format": FORMAT_VERSION, "mask_file": MASK_FILE, "mask_token_id": mask_token_id,
                   "relay": None, "repair_margin": None, "pool_size": None,
                   "drafter": str(drafter_dir), "target_fingerprint": cfg.target_fingerprint,
                   "draft_vocab": cfg.draft_vocab_size}  # > 0: trained on a draft vocabulary; served over all ids
        if relay_dir is not None:
            serving.update(export_relay(Path(relay_dir), cfg, tmp))
        (tmp / SERVING_FILE).write_text(json.dumps(serving, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_serving(draft_dir: str | Path) -> dict:
    """drelay_serving.json of an exported folder (what the DRELAY worker reads)."""
    path = Path(draft_dir) / SERVING_FILE
    try:
        serving = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ExportError(f"{path} is missing: {draft_dir} was not written by drelay.serving.export") from err
    if serving.get("format") != FORMAT_VERSION:
        raise ExportError(f"{path}: format {serving.get('format')!r}, this drelay reads {FORMAT_VERSION}")
    return serving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drelay.serving.export", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_export(args.drafter, args.out, args.target, args.relay, args.mask_token_id)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The export's options (this module's command and `drelay export-sglang`)."""
    parser.add_argument("--drafter", required=True, type=Path, help="a saved BlockDrafter folder")
    parser.add_argument("--target", type=Path, help="the target's HF folder (its config.json is read; default: the "
                                                    "drafter's recorded target_name)")
    parser.add_argument("--relay", type=Path, help="a saved DRelay folder (served by --speculative-algorithm DRELAY)")
    parser.add_argument("--mask-token-id", type=int, help="id SGLang puts at MASK positions (default: the last id)")
    parser.add_argument("--out", required=True, type=Path, help="the SGLang draft folder to write")


def run_export(drafter_dir, out_dir, target_dir=None, relay_dir=None, mask_token_id=None) -> int:
    """`export_for_sglang` as a command (this module's and `drelay export-sglang`): exit 0, or 2 with one
    `error:` line."""
    try:
        out = export_for_sglang(drafter_dir, out_dir, target_dir, relay_dir, mask_token_id)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} (serve it with --speculative-draft-model-path; DRELAY reads its relay/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
