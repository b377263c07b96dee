"""drelay.serving.export without SGLang: names, config, side files and the refusals (any venv)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drelay.models.drafter import BlockDrafter
from drelay.models.relay import DRelay
from drelay.serving.export import (MASK_FILE, MASK_KEY, SERVING_FILE, ExportError, export_for_sglang, main,
                                   read_serving, sglang_name)
from tests.conftest import make_tiny_target

NUM_LAYERS = 2


@pytest.fixture
def saved(tmp_path):
    """A tiny float32 target's HF folder, a drafter and a relay for it."""
    torch.manual_seed(0)
    target = make_tiny_target(dtype=torch.float32)
    target.model.save_pretrained(tmp_path / "target")
    drafter = BlockDrafter.for_target(target, num_layers=NUM_LAYERS, num_context_layers=3, block_size=8,
                                      num_heads=4, num_kv_heads=2, intermediate_size=96)
    drafter.save(tmp_path / "drafter")
    relay = DRelay.for_drafter(drafter, reader_dim=32, reader_heads=2, pool_size=4, repair_margin=0.25)
    relay.save(tmp_path / "relay")
    return tmp_path, target, drafter


def test_every_parameter_gets_an_sglang_name(saved):
    tmp, target, drafter = saved
    out = export_for_sglang(tmp / "drafter", tmp / "out", tmp / "target")
    weights = load_file(out / "model.safetensors")
    expected = {sglang_name(n) for n in drafter.state_dict() if n != "mask_embedding"}
    assert set(weights) == expected
    assert len(weights) == 3 + 11 * NUM_LAYERS  # fc, hidden_norm, norm + 11 tensors per layer
    for name, tensor in drafter.state_dict().items():
        if name != "mask_embedding":
            torch.testing.assert_close(weights[sglang_name(name)], tensor, rtol=0, atol=0)
    torch.testing.assert_close(load_file(out / MASK_FILE)[MASK_KEY], drafter.mask_embedding.detach(), rtol=0, atol=0)


def test_config_carries_the_draft_settings(saved):
    tmp, target, drafter = saved
    out = export_for_sglang(tmp / "drafter", tmp / "out", tmp / "target", relay_dir=tmp / "relay", mask_token_id=5)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"block_size": 8, "target_layer_ids": drafter.config.target_layer_ids,
                                       "num_target_layers": 6, "mask_token": "<|drelay_mask|>", "mask_token_id": 5}
    assert config["num_hidden_layers"] == NUM_LAYERS and config["head_dim"] == 16
    serving = read_serving(out)
    assert serving["relay"] == "relay" and serving["repair_margin"] == 0.25 and serving["pool_size"] == 4
    assert DRelay.load(out / "relay").config == DRelay.load(tmp / "relay").config


def test_a_draft_vocabulary_stays_out_of_the_sglang_weights_and_is_recorded(saved):
    tmp, target, drafter = saved
    narrow = BlockDrafter.for_target(target, vocab_ids=torch.arange(0, 96, 2), num_layers=NUM_LAYERS,
                                     num_context_layers=3, block_size=8, num_heads=4, num_kv_heads=2,
                                     intermediate_size=96)
    narrow.save(tmp / "narrow")
    out = export_for_sglang(tmp / "narrow", tmp / "out", tmp / "target")
    weights = load_file(out / "model.safetensors")
    assert len(weights) == 3 + 11 * NUM_LAYERS and not any("vocab" in name for name in weights)
    assert load_file(out / MASK_FILE)["draft_vocab_ids"].tolist() == list(range(0, 96, 2))
    assert read_serving(out)["draft_vocab"] == 48
    assert read_serving(export_for_sglang(tmp / "drafter", tmp / "full", tmp / "target"))["draft_vocab"] == 0


def test_drafter_missing_a_tensor_is_refused(saved):
    tmp, *_ = saved
    weights = load_file(tmp / "drafter" / "model.safetensors")
    del weights["layers.1.attn.k_norm.weight"]
    save_file(weights, tmp / "drafter" / "model.safetensors")
    with pytest.raises(ExportError, match="layers.1.attn.k_norm.weight"):
        export_for_sglang(tmp / "drafter", tmp / "out", tmp / "target")
    assert not (tmp / "out").exists() and not (tmp / "out.partial").exists()


def test_unknown_part_and_uncapturable_layer_are_refused(saved, tmp_path):
    tmp, target, drafter = saved
    with pytest.raises(ExportError, match="no SGLang DFlash counterpart"):
        sglang_name("layers.0.attn.gate_proj.weight")
    config = json.loads((tmp / "drafter" / "config.json").read_text())
    config["target_layer_ids"] = [1, 3, 5]  # layer 5 is the last of 6: SGLang never captures its output
    (tmp / "drafter" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"\[5\] cannot be captured"):
        export_for_sglang(tmp / "drafter", tmp / "out", tmp / "target")


def test_relay_for_another_drafter_is_refused(saved):
    tmp, target, drafter = saved
    other = BlockDrafter.for_target(target, num_layers=1, num_context_layers=3, block_size=4, num_heads=4,
                                    num_kv_heads=2, intermediate_size=96)
    DRelay.for_drafter(other, reader_dim=32, reader_heads=2, pool_size=4).save(tmp / "relay4")
    with pytest.raises(ExportError, match="not made for this drafter"):
        export_for_sglang(tmp / "drafter", tmp / "out", tmp / "target", relay_dir=tmp / "relay4")


def test_cli(saved, capsys):
    tmp, *_ = saved
    assert main(["--drafter", str(tmp / "drafter"), "--target", str(tmp / "target"), "--out", str(tmp / "o")]) == 0
    assert (tmp / "o" / SERVING_FILE).is_file()
    assert main(["--drafter", str(tmp / "nothing"), "--target", str(tmp / "target"), "--out", str(tmp / "o2")]) == 2
    assert "no drafter at" in capsys.readouterr().err


def test_drelay_export_sglang_command(saved, capsys):
    """`drelay export-sglang` writes the same folder as the module's own command, relay included."""
    from drelay.cli import main as drelay_main

    tmp, *_ = saved
    args = ["--drafter", str(tmp / "drafter"), "--target", str(tmp / "target"), "--relay", str(tmp / "relay")]
    assert drelay_main(["export-sglang", *args, "--out", str(tmp / "cli")]) == 0
    assert main([*args, "--out", str(tmp / "module")]) == 0
    assert "wrote" in capsys.readouterr().out
    for name in ("config.json", SERVING_FILE):
        cli, module = (json.loads((tmp / d / name).read_text()) for d in ("cli", "module"))
        assert cli == module if name == "config.json" else cli["repair_margin"] == module["repair_margin"] == 0.25
    assert load_file(tmp / "cli" / "model.safetensors").keys() == load_file(tmp / "module" / "model.safetensors").keys()
    assert drelay_main(["export-sglang", "--drafter", str(tmp / "nothing"), "--out", str(tmp / "bad")]) == 2
    assert "no drafter at" in capsys.readouterr().err and not (tmp / "bad").exists()
