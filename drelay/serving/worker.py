"""The DRELAY worker: SGLang's DFlashWorkerV2 with the drafted ids picked by the relay (see plugin.py).

Imports SGLang's worker module, so only the plugin's factory imports this file.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from drelay.serving.export import MASK_KEY, read_serving
from drelay.serving.plugin import DRelaySampler, _PreNormTap, relay_draft_tokens

logger = logging.getLogger(__name__)


class DRelayWorker(DFlashWorkerV2):
    """DFLASH's worker; `_relay` None (an export without a relay) leaves every pick to DFLASH."""

    _relay = None
    _norm_tap: _PreNormTap | None = None

    # DFlashWorkerV2.__init__ calls this once the draft model and the mask token id are known
    def _maybe_merge_trained_mask_embedding(self) -> None:
        """Read the export's side files (never merge anything into the target's table: see export.py)."""
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.runtime_context import get_parallel

        if get_parallel().tp_size != 1:  # the private table and the relay's embedding assume one shard
            raise ValueError("DRELAY supports tensor parallel size 1 only")
        draft_dir = Path(resolving_view(self.server_args).speculative_draft_model_path)
        serving = read_serving(draft_dir)
        if int(serving["mask_token_id"]) != int(self._mask_token_id):
            raise ValueError(f"DRELAY export's mask_token_id {serving['mask_token_id']} != resolved {self._mask_token_id}")
        self._drelay_mask = load_file(str(draft_dir / serving["mask_file"]))[MASK_KEY]
        if serving["relay"] is not None:
            self._relay = self._load_relay(draft_dir / serving["relay"], float(serving["repair_margin"]))
            self._norm_tap = _PreNormTap(self.draft_model.norm)
            self.draft_model.norm = self._norm_tap

    def _target_embedding_weight(self) -> torch.Tensor:
        """The target's input embedding rows of its real vocabulary (V, H)."""
        embed = self._target_worker.model_runner.model.get_input_embeddings()
        return embed.weight[: int(self._target_worker.model_runner.model_config.vocab_size)]

    def _load_relay(self, relay_dir: Path, repair_margin: float):
        from drelay.models.relay import DRelay

        weight = self._target_embedding_weight()
        relay = DRelay.load(relay_dir)
        relay.config = dataclasses.replace(relay.config, repair_margin=repair_margin)
        embed = torch.nn.Embedding.from_pretrained(weight, freeze=True)  # shares the target's storage
        relay = relay.to(device=weight.device, dtype=weight.dtype).attach(embed)
        logger.info("DRELAY relay loaded from %s (pool %d, repair margin %g)", relay_dir, relay.config.pool_size,
                    repair_margin)
        return relay

    def _cache_full_embed_weight(self) -> None:
        """The draft's own embedding table: the target's, with the mask token's row our learned MASK vector
        (DFlashWorkerV2 embeds the draft block from `_full_embed_gpu` when it is set)."""
        weight = self._target_embedding_weight()
        table = weight.detach().clone()  # one V x H copy, so the target's own table stays untouched
        table[int(self._mask_token_id)] = self._drelay_mask.to(device=table.device, dtype=table.dtype)
        self._full_embed_gpu = table

    def _head_weight(self, lm_head) -> torch.Tensor:
        return lm_head.weight[: int(self._target_worker.model_runner.model_config.vocab_size)]

    def _maybe_build_draft_sampler(self):
        """The sampler captured into the draft CUDA graph: the relay's pick, or DFLASH's without a relay."""
        if self._relay is None:
            return super()._maybe_build_draft_sampler()
        from sglang.srt.runtime_context import get_exec

        lm_head = self._target_worker.model_runner.model.lm_head
        return DRelaySampler(self._relay, self._norm_tap, self._head_weight(lm_head), self.block_size,
                             max(get_exec().graph.cuda_graph_config.decode.bs))

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        """The eager pick: hidden_states (bs*(B-1), H) are positions 1..B-1 of each block after the final
        norm; the anchors and their positions are this step's block buffers (DFlashWorkerV2 fills them)."""
        if self._relay is None:
            return super()._greedy_sample_from_vocab_parallel_head(hidden_states=hidden_states, lm_head=lm_head,
                                                                    chunk_size=chunk_size)
        B = int(self.block_size)
        bs = hidden_states.shape[0] // (B - 1)
        normed = hidden_states.view(bs, B - 1, -1)
        prenorm = self._norm_tap.last.view(bs, B, -1)[:, 1:]
        anchor_ids = self._draft_block_ids_buf[:bs, 0]
        anchor_pos = self._draft_block_positions_buf[:bs, 0]
        tokens = relay_draft_tokens(self._relay, prenorm, normed, anchor_ids, anchor_pos, self._head_weight(lm_head))
        return tokens.reshape(-1)
