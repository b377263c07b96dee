import pytest
import torch

from drelay.decoding.generate import ar_generate
from drelay.data.records import MANIFEST, load_distilled, load_shard, save_shard
from drelay.training.distill import distill, generate_batch
from tests.conftest import make_tiny_target

PROMPTS = [[1, 5, 7, 9, 3], [1, 40, 41], [1, 17, 18, 19, 20, 21, 22], [1, 88], [1, 3, 3, 60, 22]]


def test_batched_generation_equals_ar_and_captures_the_same_features():
    target = make_tiny_target()
    target.set_layer_ids([1, 3, 5])
    stop = {2}
    seqs = generate_batch(target, PROMPTS, 20, stop)
    for prompt, seq in zip(PROMPTS, seqs):
        ar = ar_generate(target, prompt, 20, stop_token_ids=stop).tokens
        assert seq.tokens.tolist() == prompt + ar  # left padding and dropped rows change nothing
        assert seq.prompt_len == len(prompt)
        full = target.forward(seq.tokens[None]).features[0]  # one unpadded pass over the sequence
        assert seq.features.shape == full.shape
        torch.testing.assert_close(seq.features[:-1], full[:-1])
        assert not seq.features[-1].any()  # the last token is never fed


def test_rows_leave_the_batch_at_their_stop_token():
    target = make_tiny_target()
    target.set_layer_ids([2])
    free = generate_batch(target, PROMPTS, 30, set())
    stop_token = free[0].tokens[len(PROMPTS[0]) + 4].item()  # row 0's fifth new token
    seqs = generate_batch(target, PROMPTS, 30, {stop_token})
    assert seqs[0].tokens[-1].item() == stop_token and seqs[0].response_len <= 5
    for seq in seqs:
        assert seq.features.shape[0] == seq.tokens.shape[0]


def test_shard_roundtrip_and_corrupt_shard(tmp_path):
    target = make_tiny_target()
    target.set_layer_ids([1, 2])
    seqs = generate_batch(target, PROMPTS[:3], 6, set())
    save_shard(seqs, tmp_path / "s.safetensors", torch.float32)
    back = load_shard(tmp_path / "s.safetensors")
    for a, b in zip(seqs, back):
        assert a.tokens.tolist() == b.tokens.tolist() and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.features.float(), b.features)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt distilled shard .*bad.safetensors"):
        load_shard(tmp_path / "bad.safetensors")


class Interrupt(Exception):
    pass


def _run(target, out, **kw):
    return distill(target, PROMPTS * 2, out, max_new_tokens=8, batch_size=3, shard_size=4,
                   feature_dtype="float32", **kw)


def test_interrupted_distillation_resumes_from_the_last_complete_shard(tmp_path):
    target = make_tiny_target()
    target.set_layer_ids([1, 2])
    seen = {"prompts": 0}

    def die_in_second_shard(n_prompts, n_tokens):
        seen["prompts"] += n_prompts
        if seen["prompts"] > 4:
            raise Interrupt  # as if killed while the second shard was generating

    with pytest.raises(Interrupt):
        _run(target, tmp_path, progress=die_in_second_shard)
    assert (tmp_path / "shard_00000.safetensors").is_file()
    assert not (tmp_path / "shard_00001.safetensors").exists() and not (tmp_path / MANIFEST).exists()
    with pytest.raises(FileNotFoundError, match="no finished distillation"):
        load_distilled(tmp_path)
    first = (tmp_path / "shard_00000.safetensors").stat().st_mtime_ns

    summary = _run(target, tmp_path)
    assert summary["shards_reused"] == 1 and summary["sequences"] == 10
    assert (tmp_path / "shard_00000.safetensors").stat().st_mtime_ns == first  # not redone
    fresh = _run(target, tmp_path / "fresh")
    assert [s.tokens.tolist() for s in load_distilled(tmp_path)] == [s.tokens.tolist() for s in load_distilled(tmp_path / "fresh")]
    assert fresh["shards_reused"] == 0


def test_other_settings_start_over(tmp_path):
    target = make_tiny_target()
    target.set_layer_ids([1, 2])
    _run(target, tmp_path)
    again = distill(target, PROMPTS * 2, tmp_path, max_new_tokens=5, batch_size=3, shard_size=4, feature_dtype="float32")
    assert again["shards_reused"] == 0
    assert all(s.response_len <= 5 for s in load_distilled(tmp_path))
