"""An exported drafter inside SGLang's own DFlashDraftModel (CPU, .venv-sglang): every tensor lands,
and the context SGLang writes into the draft KV cache equals ours (fc + norm, then each layer's k/v)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drelay.models.drafter import BlockDrafter
from drelay.models.target import Target
from drelay.serving.export import export_for_sglang
from tests.conftest import make_tiny_target

REPO = Path(__file__).resolve().parents[2]
# A trained SmolLM2 drafter: the default profile's (`make repro`), else the cpu-small profile's.
_WORKSPACE = next((w for w in (REPO, REPO / "runs/cpu-small") if (w / "models/drafter/model.safetensors").is_file()),
                  REPO)
SMOLLM2_DRAFTER = _WORKSPACE / "models/drafter"
SMOLLM2_TARGET = _WORKSPACE / "models/target"


def sglang_draft_model(out: Path):
    """SGLang's DFlashDraftModel built from the exported config.json, every parameter NaN before loading."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(out))
    model = DFlashDraftModel(config).float().eval()
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.load_weights(list(load_file(out / "model.safetensors").items()))
    return model, parse_dflash_draft_config(draft_hf_config=config)


def check_against_ours(model, drafter: BlockDrafter, features: torch.Tensor, atol: float) -> None:
    """features (t, m*H) of t positions 0..t-1 -> projected context and every layer's context k/v agree."""
    from sglang.srt.layers.radix_attention import AttentionType

    unloaded = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    assert not unloaded, f"not loaded from the export: {unloaded}"
    t = features.shape[0]
    positions = torch.arange(t)
    with torch.no_grad():
        theirs = model.project_target_hidden(features)  # (t, H)
        ours = drafter.fuse_context(features[None])[0]
        torch.testing.assert_close(theirs, ours, rtol=0, atol=atol)
        cos, sin = drafter._cos_sin(positions[None])
        for sgl_layer, layer in zip(model.layers, drafter.layers, strict=True):
            attn = sgl_layer.self_attn
            assert attn.attn.attn_type == AttentionType.ENCODER_ONLY  # bidirectional inside the block, as ours
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(sgl_layer, theirs))
            k = attn.apply_k_rope(positions, attn.apply_k_norm(k))
            our_k, our_v = layer.attn.project_kv(ours[None], cos, sin)  # (1, kvh, t, hd)
            torch.testing.assert_close(k, our_k[0].transpose(0, 1).reshape(t, -1), rtol=0, atol=atol)
            torch.testing.assert_close(v, our_v[0].transpose(0, 1).reshape(t, -1), rtol=0, atol=atol)


def test_tiny_drafter_in_sglang(sglang_runtime, tmp_path):
    torch.manual_seed(0)
    target = make_tiny_target(dtype=torch.float32)
    target.model.save_pretrained(tmp_path / "target")
    drafter = BlockDrafter.for_target(target, num_layers=2, num_context_layers=3, block_size=8, num_heads=4,
                                      num_kv_heads=2, intermediate_size=96)
    torch.nn.init.normal_(drafter.context_norm.weight, 1.0, 0.2)  # not all-ones, so a swapped norm shows
    for layer in drafter.layers:
        torch.nn.init.normal_(layer.attn.k_norm.weight, 1.0, 0.2)
    drafter.save(tmp_path / "drafter")
    out = export_for_sglang(tmp_path / "drafter", tmp_path / "out", tmp_path / "target")
    model, draft_cfg = sglang_draft_model(out)
    assert (draft_cfg.block_size, draft_cfg.target_layer_ids, draft_cfg.num_target_layers) == (
        8, drafter.config.target_layer_ids, 6)
    features = target.forward(torch.randint(3, 96, (1, 11))).features[0]  # real captured features (11, 3H)
    check_against_ours(model, drafter, features.float(), atol=1e-5)


# SmolLM2-135M-Instruct's architecture (models/target/config.json after prepare_target), for a fresh clone
# without the converted target: the export and SGLang's loading depend on the shapes, not on trained weights.
SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(target dir, drafter dir, trained?): the default profile's trained drafter on the converted SmolLM2 when
    `make repro` made them (else the cpu-small profile's); otherwise an untrained drafter of the default
    profile's shape (1 layer, 3 context layers, block 8) on a randomly initialised SmolLM2-135M."""
    if (SMOLLM2_DRAFTER / "model.safetensors").is_file() and (SMOLLM2_TARGET / "config.json").is_file():
        return SMOLLM2_TARGET, SMOLLM2_DRAFTER, True
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("smollm2")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).to(torch.bfloat16).save_pretrained(root / "target")
    target = Target.load(root / "target", dtype="float32")
    drafter = BlockDrafter.for_target(target, num_layers=1, num_context_layers=3, block_size=8)
    torch.nn.init.normal_(drafter.context_norm.weight, 1.0, 0.2)  # not all-ones, so a swapped norm shows
    drafter.save(root / "drafter")
    return root / "target", root / "drafter", False


def test_smollm2_drafter_in_sglang(sglang_runtime, smollm2, tmp_path):
    target_dir, drafter_dir, trained = smollm2
    target = Target.load(target_dir, dtype="float32")  # read-only
    drafter = BlockDrafter.load(drafter_dir, target)
    out = export_for_sglang(drafter_dir, tmp_path / "out", target_dir)
    model, draft_cfg = sglang_draft_model(out)
    assert draft_cfg.num_target_layers == 30 and draft_cfg.target_layer_ids == drafter.config.target_layer_ids
    ids = torch.tensor([target.encode_chat("Name three rivers in Europe.")]) if trained else \
        torch.randint(3, 49152, (1, 24), generator=torch.Generator().manual_seed(1))
    features = target.forward(ids).features[0].float()
    check_against_ours(model, drafter, features, atol=2e-4)
