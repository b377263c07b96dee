"""drelay.data.datacard: the card's counts and the response tokens per source and domain of a distillation."""

import json
from collections import Counter

import torch

from drelay.data.datacard import DROP_REASONS, DataCard, response_tokens_by_group
from drelay.data.records import MANIFEST, Sequence, save_shard


def test_metrics_count_every_source_domain_and_reason():
    card = DataCard(sources=["gsm8k", "written"], source_domains={"gsm8k": "math", "written": "mixed"},
                    mix={"math": 0.5, "code": 0.0, "chat": 0.5}, written_requested={"chat": 4}, written_seconds=2.0,
                    written_tokens=30)
    card.loaded.update({"gsm8k": 10, "written": 4})
    card.drop("bench_near", "gsm8k")
    card.drop("unfinished", "written")
    card.drop("repetitive", "written")
    card.pool.update({("gsm8k", "math"): 9, ("written", "chat"): 2})
    card.split = {"train": Counter({("gsm8k", "math"): 6, ("written", "chat"): 2}),
                  "val": Counter({("gsm8k", "math"): 1})}
    m = card.metrics()
    assert {f"dropped.{r}" for r in DROP_REASONS} <= set(m) and m["dropped.bench_near"] == 1
    assert m["dropped.degenerate"] == 2 and m["dropped.too_long"] == 0
    assert (m["pool.gsm8k"], m["train.gsm8k"], m["train.written"], m["val.total"]) == (9, 6, 2, 1)
    assert (m["train.domain.math"], m["train.domain.chat"], m["train.domain.code"], m["train.total"]) == (6, 2, 0, 8)
    assert m["written.tokens_per_s"] == 15.0
    text = card.markdown()
    assert "| chat | 0.50 | 2 | 2 | 0 | 0.250 |" in text  # domain, asked share, pool, train, val, train share
    assert "| repetitive | 0 | 1 | 1 |" in text


def test_response_tokens_are_summed_per_source_and_domain(tmp_path):
    def seq(prompt: list[int], response_len: int) -> Sequence:
        tokens = torch.tensor(prompt + [7] * response_len)
        return Sequence(tokens, len(prompt), torch.zeros(len(tokens), 2))

    save_shard([seq([1, 2], 5), seq([3], 4)], tmp_path / "a.safetensors", torch.float32)
    save_shard([seq([1, 2, 9], 2), seq([4, 4], 1)], tmp_path / "b.safetensors", torch.float32)
    (tmp_path / MANIFEST).write_text(json.dumps({"shards": ["a.safetensors", "b.safetensors"]}))
    groups = {(1, 2): ("gsm8k", "math"), (3,): ("written", "chat"), (1, 2, 9): ("mbpp", "code")}
    assert response_tokens_by_group(tmp_path, groups) == {
        "response_tokens.source.gsm8k": 5, "response_tokens.source.written": 4, "response_tokens.source.mbpp": 2,
        "response_tokens.source.unknown": 1, "response_tokens.domain.math": 5, "response_tokens.domain.chat": 4,
        "response_tokens.domain.code": 2, "response_tokens.domain.unknown": 1}
