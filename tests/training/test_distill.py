import pytest
import torch

from drelay.decoding.generate import ar_generate
from drelay.data.records import MANIFEST, load_distilled, load_shard, save_shard
from drelay.training import distill as distill_module
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


def sequential_greedy(target, prompt, max_new_tokens, stop):
    """The reference, as plain as it gets: one row, no cache, the whole sequence re-run each step."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(target.forward(torch.tensor([tokens])).logits[0, -1].argmax()))
        if tokens[-1] in stop:
            break
    features = target.forward(torch.tensor([tokens])).features[0]
    return tokens, features[:-1]  # the last token is never fed


# prompts of lengths 1..9 (left padding up to 8 columns); the stop tokens end rows at different steps
MIXED = [[1, 5, 7, 9, 3, 11, 12, 13, 14], [40], [1, 17, 18, 19, 20, 21, 22], [1, 88], [1, 3, 3, 60, 22],
         [1, 50, 51, 52], [7, 7, 7, 7, 7, 7, 7, 7]]


def stop_tokens_for(target, prompts, steps):
    """Stop tokens that end the rows' free greedy runs at several different steps."""
    first, third = (sequential_greedy(target, prompts[i], steps, set())[0] for i in (0, 2))
    return {first[len(prompts[0]) + 2], third[len(prompts[2]) + 9]}


# a common prefix computed once (as the chat template's system turn): 3 tokens, one prompt is only
# the prefix and one more token, another is a prefix of a third
SHARED = [[1, 5, 7, 9, 3, 11, 12], [1, 5, 7, 60], [1, 5, 7, 9], [1, 5, 7, 9, 3], [1, 5, 7, 22, 23, 24, 25, 26, 27]]


@pytest.mark.parametrize("prompts", [MIXED, SHARED], ids=["no-common-prefix", "common-prefix"])
@pytest.mark.parametrize("prefill_tokens", [1, 16, 10_000])  # one row per prefill group .. one group
@pytest.mark.parametrize("compact_cost", [0.0, 2.0, float("inf")])  # drop finished rows at once .. never
def test_generate_batch_equals_sequential_greedy(monkeypatch, prompts, prefill_tokens, compact_cost):
    target = make_tiny_target()
    target.set_layer_ids([0, 3, 5])
    stop = stop_tokens_for(target, prompts, 24)
    monkeypatch.setattr(distill_module, "PREFILL_TOKENS", prefill_tokens)
    monkeypatch.setattr(distill_module, "COMPACT_COST_STEPS", compact_cost)
    seqs = generate_batch(target, prompts, 24, stop)
    lengths = {seq.response_len for seq in seqs}
    assert len(lengths) >= 3 and min(lengths) < 24 and max(lengths) == 24  # rows stop at different steps
    for prompt, seq in zip(prompts, seqs):
        tokens, features = sequential_greedy(target, prompt, 24, stop)
        assert seq.tokens.tolist() == tokens and seq.prompt_len == len(prompt)
        assert seq.features.shape == (len(tokens), features.shape[-1])
        torch.testing.assert_close(seq.features[:-1], features)
        assert not seq.features[-1].any()


def test_finished_rows_are_dropped_when_it_pays(monkeypatch):
    target = make_tiny_target()
    target.set_layer_ids([2])
    stop = stop_tokens_for(target, MIXED, 24)
    selects = []
    cache_type = type(target.new_cache().layers[0])
    original = cache_type.batch_select_indices
    monkeypatch.setattr(cache_type, "batch_select_indices",
                        lambda layer, idx: selects.append(len(idx)) or original(layer, idx))
    for cost, expect_drops in [(0.0, True), (float("inf"), False)]:
        selects.clear()
        monkeypatch.setattr(distill_module, "COMPACT_COST_STEPS", cost)
        generate_batch(target, MIXED, 24, stop)
        assert bool(selects) == expect_drops
    assert all(n < len(MIXED) for n in selects)  # each drop leaves fewer rows


def test_generate_batch_edge_cases():
    target = make_tiny_target()
    assert generate_batch(target, [], 5, {2}) == []
    seqs = generate_batch(target, PROMPTS[:2], 4, set())  # no context layers: empty features
    assert [s.features.shape for s in seqs] == [(len(PROMPTS[0]) + 4, 0), (len(PROMPTS[1]) + 4, 0)]
    target.set_layer_ids([1])
    one = generate_batch(target, PROMPTS[:2], 1, set())  # one new token: nothing fed after the prompt
    assert [s.response_len for s in one] == [1, 1] and not one[0].features[-1].any()
    shared = generate_batch(target, SHARED, 6, set())  # with a common prefix
    assert [s.features.shape[0] for s in shared] == [len(p) + 6 for p in SHARED]
    assert generate_batch(target, [SHARED[0]], 6, set())[0].tokens.tolist() == shared[0].tokens.tolist()
    sampled = [generate_batch(target, PROMPTS, 10, {2}, temperature=1.0,
                              generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert [s.tokens.tolist() for s in sampled[0]] == [s.tokens.tolist() for s in sampled[1]]


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
    # the manifest depends on the sequences only (not on reuse or speed): same data, same DVC hash downstream
    assert (tmp_path / MANIFEST).read_bytes() == (tmp_path / "fresh" / MANIFEST).read_bytes()


def test_other_settings_start_over(tmp_path):
    target = make_tiny_target()
    target.set_layer_ids([1, 2])
    _run(target, tmp_path)
    again = distill(target, PROMPTS * 2, tmp_path, max_new_tokens=5, batch_size=3, shard_size=4, feature_dtype="float32")
    assert again["shards_reused"] == 0
    assert all(s.response_len <= 5 for s in load_distilled(tmp_path))
