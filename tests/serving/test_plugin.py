"""The DRELAY plugin inside SGLang on CPU (.venv-sglang): registration and its SGLANG_PLUGINS filter, the
server-args path, the worker factory, and the relay's pick in both places the worker makes it."""

from __future__ import annotations

import types

import pytest
import torch

from drelay.models.drafter import BlockDrafter, DraftContextCache
from drelay.models.relay import DRelay
from drelay.models.repair import DraftBlock
from drelay.serving.export import export_for_sglang
from tests.conftest import make_tiny_target

BLOCK = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drelay-export")
    torch.manual_seed(0)
    target = make_tiny_target(dtype=torch.float32)
    target.model.save_pretrained(tmp / "target")
    drafter = BlockDrafter.for_target(target, num_layers=1, num_context_layers=3, block_size=BLOCK, num_heads=4,
                                      num_kv_heads=2, intermediate_size=96)
    drafter.save(tmp / "drafter")
    return tmp, export_for_sglang(tmp / "drafter", tmp / "out", tmp / "target")


def test_plugin_is_found_and_filtered_by_sglang_plugins(sglang_runtime, monkeypatch):
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else")
    assert "drelay" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else,drelay")
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    from drelay.serving.plugin import register
    assert found["drelay"][0] is register


def test_register_is_idempotent_and_answers_as_dflash(sglang_runtime):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from drelay.serving.plugin import register

    register()
    register()  # SGLang calls plugins once per process; a second call must not raise
    spec = SpeculativeAlgorithm.from_string("drelay")
    assert spec is get_spec("DRELAY") and spec.name == "DRELAY"
    dflash = SpeculativeAlgorithm.DFLASH
    queries = [n for n in vars(SpeculativeAlgorithm) if n.startswith(("is_", "supports_"))]
    queries += ["has_draft_kv", "carries_draft_hidden_states", "need_topk"]
    assert {q: getattr(spec, q)() for q in queries} == {q: getattr(dflash, q)() for q in queries}
    assert spec.get_num_tokens_per_req_for_target_verify(BLOCK, True) == BLOCK
    assert spec.create_future_map is not None and spec.supports_overlap


def _resolved(algorithm: str, exported, argv: list[str] | None = None) -> dict:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    tmp, out = exported
    argv = argv or ["--model-path", str(tmp / "target"), "--speculative-algorithm", algorithm,
                    "--speculative-draft-model-path", str(out), "--device", "cuda", "--attention-backend", "triton"]
    args = prepare_server_args(argv)
    args.resolve_once()
    cfg = resolving_view(args)
    keys = ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
            "speculative_draft_attention_backend", "speculative_draft_model_path", "max_running_requests",
            "disable_overlap_schedule", "speculative_algorithm")
    return {k: getattr(cfg, k) for k in keys}, args


def test_server_args_resolve_like_dflash(sglang_runtime, exported):
    from drelay.serving.plugin import register

    register()
    drelay, _ = _resolved("DRELAY", exported)
    dflash, _ = _resolved("DFLASH", exported)
    assert drelay.pop("speculative_algorithm") == "DRELAY" and dflash.pop("speculative_algorithm") == "DFLASH"
    assert drelay == dflash
    assert drelay["speculative_num_draft_tokens"] == BLOCK  # read from the export's draft config


def test_serve_bench_server_command_resolves_like_the_hand_written_one(sglang_runtime, exported):
    """What the serve_bench stage launches (`python -m sglang.launch_server` + these args) for DRELAY and DFLASH."""
    from drelay.serving.bench import server_command
    from drelay.serving.plugin import register

    register()
    tmp, out = exported
    for method, algorithm in (("drelay", "DRELAY"), ("dflash", "DFLASH")):
        cmd = server_command("python", tmp / "target", 30123, method, out, BLOCK,
                             extra=["--device", "cuda", "--attention-backend", "triton"])
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        staged, args = _resolved(algorithm, exported, argv=cmd[3:])
        assert staged == _resolved(algorithm, exported)[0] and (args.host, args.port) == ("127.0.0.1", 30123)


def test_factory_gives_the_drelay_worker(sglang_runtime, exported):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from drelay.serving.plugin import register
    from drelay.serving.worker import DRelayWorker

    register()
    _, args = _resolved("DRELAY", exported)
    worker_cls = SpeculativeAlgorithm.from_string("DRELAY").create_worker(args)
    assert worker_cls is DRelayWorker and issubclass(worker_cls, DFlashWorkerV2)


def test_worker_picks_are_the_relays_selection(sglang_runtime):
    """The sampler (CUDA-graph path) and the eager head both return DRelay.select on the drafter's pools."""
    from drelay.serving.plugin import DRelaySampler, _PreNormTap
    from drelay.serving.worker import DRelayWorker

    torch.manual_seed(1)
    target = make_tiny_target(dtype=torch.float32, seed=1)
    drafter = BlockDrafter.for_target(target, num_layers=1, num_context_layers=3, block_size=BLOCK, num_heads=4,
                                      num_kv_heads=2, intermediate_size=96)
    relay = DRelay.for_drafter(drafter, reader_dim=32, reader_heads=2, pool_size=4, repair_margin=-0.5,
                               token_rank=8, lattice_rank=8, lattice_messages=True, anchor_token=True, calibrate=True)
    for p in relay.parameters():  # an untrained relay keeps every native: give it opinions
        torch.nn.init.normal_(p, std=0.5)
    relay.eval()
    b, t = 3, 9
    prompt = torch.randint(3, 96, (b, t))
    cache = DraftContextCache(len(drafter.layers))
    drafter.extend_context(cache, target.forward(prompt).features, torch.arange(t).expand(b, t))
    anchor_ids, anchor_pos = torch.randint(3, 96, (b,)), torch.full((b,), t)
    with torch.no_grad():  # the whole block, positions 0..B-1, before the final norm (as SGLang's model runs it)
        positions = anchor_pos[:, None] + torch.arange(BLOCK)
        full = drafter.forward_block(drafter.block_embeddings(anchor_ids, BLOCK), positions,
                                     list(zip(cache.keys, cache.values)))  # (b, B, H)
        hidden = full[:, 1:]
        logits, pool_ids, pool_logprobs = drafter.pool(hidden, relay.config.pool_size)
        reference = relay.select(DraftBlock(anchor_ids, anchor_pos, hidden, logits, pool_ids, pool_logprobs))
    assert (reference != pool_ids[..., 0]).any(), "the test relay repairs nothing: the comparison would be vacuous"

    tap = _PreNormTap(drafter.norm)
    with torch.no_grad():
        normed = tap(full.reshape(b * BLOCK, -1))  # what SGLang's draft model returns
    block_ids = torch.full((b, BLOCK), 95)
    block_ids[:, 0] = anchor_ids
    sampler = DRelaySampler(relay, tap, target.lm_head.weight, BLOCK, max_bs=4)
    with torch.no_grad():
        sampler(normed, block_ids.reshape(-1))
    assert torch.equal(sampler.out[: b * (BLOCK - 1)].view(b, BLOCK - 1), reference)

    worker = object.__new__(DRelayWorker)  # only the state the eager pick reads
    worker._relay, worker._norm_tap, worker.block_size = relay, tap, BLOCK
    worker._draft_block_ids_buf, worker._draft_block_positions_buf = block_ids, positions
    worker._target_worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=96)))
    with torch.no_grad():
        eager = worker._greedy_sample_from_vocab_parallel_head(
            hidden_states=normed.view(b, BLOCK, -1)[:, 1:].reshape(-1, normed.shape[-1]), lm_head=target.lm_head)
    assert torch.equal(eager.view(b, BLOCK - 1), reference)
