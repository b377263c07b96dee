"""SGLang plugin: the DRELAY speculative algorithm = SGLang's DFLASH worker whose drafted ids come from
DRelay's repair of each block (DESIGN §1.2-§1.4) instead of the native top-1.

    pip install -e . (in .venv-sglang)  ->  entry point sglang.srt.plugins:drelay = drelay.serving.plugin:register
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm DRELAY \
        --speculative-draft-model-path EXPORT   (EXPORT from `python -m drelay.serving.export`)

One DFLASH step drafts a block [bonus, MASK, ...] and picks each position's token from the target's LM
head over the draft's (final-normed) hidden states. DRELAY replaces only that pick, in both places SGLang
makes it: the sampler object captured into the draft CUDA graph (`_maybe_build_draft_sampler`) and the
eager `_greedy_sample_from_vocab_parallel_head`. The pick is `relay_draft_tokens`: the top-k pool of
log_softmax(z_i) (drelay.kernels.reference.candidate_pool) handed to the relay's own `DRelay.select`, the
project's reference selection (reader + causal selector + repair margin δ). Verification is DFLASH's
(lossless), so a repair can change acceptance length, never the output.

The relay reads the drafter's hidden h_i before the final norm (what it was trained on); SGLang's draft
model returns them after it, so the worker wraps the draft's `norm` (`_PreNormTap`) to keep its input.
The MASK embedding is the drafter's learned vector in a private copy of the target's embedding table
(see drelay/serving/export.py for why it is not merged into the target's own table).
Without a relay in the export, DRELAY is DFLASH with that mask embedding (the baseline to compare with).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from drelay.kernels.reference import candidate_pool
from drelay.models.repair import DraftBlock

ALGORITHM = "DRELAY"
logger = logging.getLogger(__name__)

# SpeculativeAlgorithm methods DRELAY does not take from DFLASH: how a worker class is found (ours comes
# from the factory), and the enum's own constructors
_NOT_DELEGATED = frozenset({"create_worker", "get_platform_worker_cls", "from_string", "register"})


def relay_draft_tokens(relay, prenorm: torch.Tensor, normed: torch.Tensor, anchor_ids: torch.Tensor,
                       anchor_pos: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """DRelay's drafted ids of one block per row: prenorm, normed (b, n, H) = h_1..h_n before and after the
    draft's final norm, anchor_ids, anchor_pos (b,), the target head's weight (V, H) -> tokens (b, n)."""
    logits = F.linear(normed.to(head_weight.dtype), head_weight)  # (b, n, V): z_i = W_o RMSNorm(h_i)
    pool_ids, pool_logprobs = candidate_pool(logits, relay.config.pool_size)  # (b, n, k), column 0 = native
    block = DraftBlock(anchor_ids=anchor_ids, anchor_pos=anchor_pos, hidden=prenorm,
                       logits=logits if relay.needs_logits else None, pool_ids=pool_ids, pool_logprobs=pool_logprobs)
    return relay.select(block)


class _PreNormTap(nn.Module):
    """The draft model's final RMSNorm, keeping its input h = x (+ residual) as `last` (all block tokens,
    (bs*B, H)). A reference, not a copy: inside a captured CUDA graph the sampler reads the tensor of the
    same replay."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        self.last = x if residual is None else x + residual
        return self.norm(x) if residual is None else self.norm(x, residual)


class DRelaySampler:
    """The draft sampler SGLang captures into the draft CUDA graph: `__call__(hidden_states, input_ids)` over
    the whole block (bs*B tokens, position 0 = the bonus/anchor) writes the drafted ids to `.out`."""

    def __init__(self, relay, tap: _PreNormTap, head_weight: torch.Tensor, block_size: int, max_bs: int):
        self.relay, self.tap, self.head_weight, self.block_size = relay, tap, head_weight, int(block_size)
        self.out = torch.empty((int(max_bs) * (self.block_size - 1),), dtype=torch.int64, device=head_weight.device)

    def __call__(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor | None = None):
        bs, B = hidden_states.shape[0] // self.block_size, self.block_size
        normed = hidden_states.view(bs, B, -1)[:, 1:]
        prenorm = self.tap.last.view(bs, B, -1)[:, 1:]
        anchor_ids = input_ids.view(bs, B)[:, 0]
        anchor_pos = positions.view(bs, B)[:, 0] if positions is not None else torch.zeros_like(anchor_ids)
        tokens = relay_draft_tokens(self.relay, prenorm, normed, anchor_ids, anchor_pos, self.head_weight)
        self.out[: tokens.numel()].copy_(tokens.reshape(-1))


def _spec_class():
    """A CustomSpecAlgo answering every SpeculativeAlgorithm query as DFLASH does (the scheduler, model
    runner and CUDA-graph runners dispatch on them), while the worker comes from our factory."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    def delegate(name):
        def method(self, *args, **kwargs):
            return getattr(SpeculativeAlgorithm.DFLASH, name)(*args, **kwargs)
        method.__name__ = name
        method.__doc__ = f"SpeculativeAlgorithm.DFLASH.{name}"
        return method

    names = [name for name, value in vars(SpeculativeAlgorithm).items()
             if callable(value) and not name.startswith("_") and name not in _NOT_DELEGATED]
    return type("DRelaySpecAlgo", (CustomSpecAlgo,), {name: delegate(name) for name in names})


def worker_factory(server_args):
    """SpeculativeAlgorithm.register's factory: the worker class (imported here: it pulls in the GPU stack)."""
    from drelay.serving.worker import DRelayWorker

    return DRelayWorker


def register() -> None:
    """Entry point of group sglang.srt.plugins: registers DRELAY once per process (SGLang calls every
    plugin in each process it spawns; a second call is a no-op)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM) is not None:
        return
    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=_spec_class())(worker_factory)

