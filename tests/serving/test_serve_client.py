"""The serve_bench client command and prompt files as SGLang 0.5.23's own benchmark client reads them
(.venv-sglang): its argument parser takes our command line, and its `custom` dataset loader turns our prompt
file into one request per prompt with the chat template applied and the fixed output length."""

from __future__ import annotations

import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from drelay.serving import bench

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def tokenizer(turns):
    words = sorted({w for t in [*turns, bench._PLACEHOLDER, TEMPLATE] for w in t.split()})
    vocab = {w: i for i, w in enumerate(["[UNK]", "<|im_start|>", "<|im_end|>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", chat_template=TEMPLATE)


@pytest.fixture
def turns():
    return ["What is 12 times 7 ?", "Write a short poem about the sea .", "Sort a list in Python please ."]


def test_sglang_client_parses_our_command_and_loads_our_prompts(sglang_runtime, tmp_path, tokenizer, turns,
                                                                monkeypatch):
    import sglang.benchmark.serving as serving
    from sglang.benchmark.datasets import get_dataset

    prompts = bench.write_prompt_file(tmp_path / "p.jsonl", turns)
    cmd = bench.client_command("python", 30123, prompts, len(turns), 2, 32, tmp_path / "out.jsonl", seed=1)
    parsed = []
    monkeypatch.setattr(serving, "run_benchmark", parsed.append)  # parse only: no server to talk to here
    monkeypatch.setattr(sys, "argv", ["sglang.benchmark.serving", *cmd[3:]])
    serving.cli_main()
    (args,) = parsed
    assert (args.backend, args.base_url, args.max_concurrency, args.temperature, args.disable_ignore_eos) == (
        "sglang", "http://127.0.0.1:30123", 2, 0.0, False)
    rows = get_dataset(args, tokenizer)
    assert len(rows) == len(turns) and all(r.output_len == 32 for r in rows)
    assert sorted(r.prompt for r in rows) == sorted(
        f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in turns)
