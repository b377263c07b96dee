import pytest
import torch

from drelay.models.drafter import BlockDrafter, DraftContextCache, DrafterError
from tests.conftest import make_tiny_target


def _draft(drafter, target, prompt, anchor):
    out = target.forward(torch.tensor([prompt]))
    cache = DraftContextCache(len(drafter.layers))
    drafter.extend_context(cache, out.features, torch.arange(len(prompt))[None])
    return drafter.draft(cache, torch.tensor([anchor]), torch.tensor([len(prompt)]))


def test_draft_shapes_and_frozen_parts_are_shared_not_saved(tiny_target):
    drafter = BlockDrafter.for_target(tiny_target, num_layers=2, block_size=6, num_context_layers=3)
    hidden, logits = _draft(drafter, tiny_target, [1, 5, 7, 9], anchor=11)
    assert hidden.shape == (1, 5, tiny_target.hidden_size)
    assert logits.shape == (1, 5, tiny_target.vocab_size)
    assert drafter.fc.in_features == 3 * tiny_target.hidden_size
    state = drafter.state_dict()
    assert not any("embed_tokens" in k or "lm_head" in k for k in state)
    assert all(tiny_target.vocab_size not in v.shape for v in state.values())
    assert tiny_target.layer_ids == drafter.config.target_layer_ids  # the target captures our layers


def test_every_context_position_is_read(tiny_target):
    drafter = BlockDrafter.for_target(tiny_target, block_size=4)
    _, base = _draft(drafter, tiny_target, [1, 5, 7, 9, 3], anchor=11)
    _, changed = _draft(drafter, tiny_target, [1, 6, 7, 9, 3], anchor=11)  # earliest token changed
    assert not torch.allclose(base, changed)


def test_save_load_roundtrip(tiny_target, tmp_path):
    drafter = BlockDrafter.for_target(tiny_target, block_size=4)
    drafter.save(tmp_path / "d")
    loaded = BlockDrafter.load(tmp_path / "d", tiny_target)
    assert loaded.config == drafter.config
    torch.testing.assert_close(_draft(loaded, tiny_target, [1, 5, 7], 9)[1], _draft(drafter, tiny_target, [1, 5, 7], 9)[1])


def test_loading_against_another_target_is_a_clear_error(tiny_target, tmp_path):
    BlockDrafter.for_target(tiny_target).save(tmp_path / "d")
    other = make_tiny_target(seed=1)
    with pytest.raises(DrafterError, match="belongs to target .*fingerprint"):
        BlockDrafter.load(tmp_path / "d", other)


def test_missing_and_corrupt_drafter_folders(tiny_target, tmp_path):
    with pytest.raises(DrafterError, match="config.json is missing"):
        BlockDrafter.load(tmp_path / "none", tiny_target)
    path = BlockDrafter.for_target(tiny_target).save(tmp_path / "d")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as after a killed copy
    with pytest.raises(DrafterError, match="cannot read drafter weights"):
        BlockDrafter.load(path, tiny_target)
    (path / "config.json").write_text("{not json")
    with pytest.raises(DrafterError, match="corrupt drafter config"):
        BlockDrafter.load(path, tiny_target)
