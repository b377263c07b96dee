"""The DFlash-style block drafter (DESIGN §1.1).

Context: the raw outputs of m target layers at every committed position, concatenated and fused
by `fc` + RMSNorm into one H-wide vector per position. Every drafter layer projects those vectors
with its own k/v projections ("KV injection") and appends the block's own keys and values, so
queries come from the block only while attention sees the whole context plus the whole block
(bidirectional inside the block).

Block input: [anchor, MASK, ..., MASK] embedded with the target's frozen embedding (MASK is a
learned vector owned by the drafter), at positions anchor_pos .. anchor_pos+B-1. Output:
hidden h_1..h_{B-1} and logits z_i = W_o(RMSNorm(h_i)) with the target's frozen LM head.

Draft vocabulary (optional, `draft_vocab_size` > 0; EAGLE-3's reduced draft vocabulary): the drafter
scores only N chosen token ids (`vocab_ids`, the rows of the frozen head it keeps; `draft_vocabulary`
picks them from the training data). Logits stay target-vocabulary wide, so every pool, table and repair
method works on target ids unchanged: ids outside the draft vocabulary get `OUT_OF_VOCAB`, a finite
value far below any real logit (finite, so 0 * logit stays 0), and are never drafted. The LM head is
most of the drafter's cost on CPU (~70% of a training step with SmolLM2's 49,152 tokens), so N = 8192
makes that part 6x cheaper. Verification is untouched: outputs stay the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from drelay.kernels.ops import Ops, REFERENCE, kernel_ops
from drelay.kernels.reference import candidate_pool
from drelay.models.cpu_linear import few_row_linear, use_few_row_linear
from drelay.models.folder import load_folder, save_folder
from drelay.models.target import Target, context_layer_ids


class DrafterError(RuntimeError):
    """A drafter folder that is missing, corrupt or belongs to another target."""


@dataclass
class DraftModelConfig:
    hidden_size: int  # H, the target's width (the frozen embedding and head are shared)
    vocab_size: int  # V, the target's vocabulary
    num_layers: int = 1  # drafter decoder layers L_d
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 8  # B: anchor + B-1 drafted positions
    target_layer_ids: list[int] = field(default_factory=list)  # context layers of the target (0-based)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_name: str = ""  # informational: where the target came from
    target_fingerprint: str = ""  # Target.fingerprint() of the target this drafter belongs to
    draft_vocab_size: int = 0  # N > 0: the drafter scores only N token ids (buffer vocab_ids); 0: all V

    @classmethod
    def for_target(cls, target: Target, num_layers: int = 1, num_context_layers: int = 3,
                   block_size: int = 8, num_heads: int | None = None, num_kv_heads: int | None = None,
                   intermediate_size: int | None = None, draft_vocab_size: int = 0) -> "DraftModelConfig":
        c = target.config
        heads = num_heads or c.num_attention_heads
        return cls(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=num_layers,
            num_heads=heads, num_kv_heads=num_kv_heads or getattr(c, "num_key_value_heads", heads),
            head_dim=getattr(c, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=intermediate_size or c.intermediate_size, block_size=block_size,
            target_layer_ids=context_layer_ids(target.num_layers, num_context_layers),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            target_name=target.name, target_fingerprint=target.fingerprint(), draft_vocab_size=draft_vocab_size,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables (b, 1, t, head_dim) for integer positions (b, t)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).double() / head_dim)
    angles = positions.double()[..., None] * inv_freq  # (b, t, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (b, 1, t, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block] (KV injection)."""

    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # Qwen3-style per-head norms
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(b, t, H) -> keys, values (b, kvh, t, hd), keys rotated to their positions."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, attn_mask=None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # (b, nh, t, hd)
        k, v = self.project_kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # (b, kvh, n+t, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DraftAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attn_mask=None) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, ctx_k, ctx_v, attn_mask)
        h = self.post_attn_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DraftContextCache:
    """Per-layer keys/values of the fused context features of every committed position."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)


OUT_OF_VOCAB = -1e9  # the logit of a token outside the draft vocabulary: never in a top-k, exp() = 0


def draft_vocabulary(token_counts: torch.Tensor, size: int, always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` token ids a drafter with a draft vocabulary scores, sorted: `always` first (e.g. the
    stop tokens), then by `token_counts` (V,) (how often each id occurs in the training responses),
    ties and unseen ids by id (byte-level BPE ids roughly follow merge order, i.e. corpus frequency)."""
    vocab = token_counts.shape[0]
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab} (the target's vocabulary)")
    key = token_counts.double() * vocab - torch.arange(vocab, dtype=torch.float64)  # count desc, then id asc
    key[torch.tensor(list(always), dtype=torch.long)] = float("inf")
    return key.topk(size).indices.sort().values


@dataclass
class _SharedParts:
    """The target's frozen embedding and LM head, held by reference (never saved with the drafter)."""

    embed_tokens: nn.Module
    lm_head: nn.Module


class BlockDrafter(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.config = cfg
        m = len(cfg.target_layer_ids)
        self.fc = nn.Linear(m * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        # the draft vocabulary's target ids (saved with the weights); None: the whole vocabulary
        self.register_buffer("vocab_ids", torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
                             if cfg.draft_vocab_size else None)
        self.shared: _SharedParts | None = None
        self.ops: Ops = REFERENCE  # the fused ops of the device it is attached on (attach chooses them)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        nn.init.normal_(self.mask_embedding, std=std)

    # ------------------------------------------------------------------ target binding, save, load
    @classmethod
    def for_target(cls, target: Target, vocab_ids: torch.Tensor | None = None, **kwargs) -> "BlockDrafter":
        """A fresh (untrained) drafter bound to `target`; kwargs go to DraftModelConfig.for_target.
        vocab_ids: a draft vocabulary (`draft_vocabulary`); None: the whole vocabulary."""
        size = 0 if vocab_ids is None else int(vocab_ids.numel())
        drafter = cls(DraftModelConfig.for_target(target, draft_vocab_size=size, **kwargs))
        if vocab_ids is not None:
            ids_ok = vocab_ids.unique().numel() == size and 0 <= int(vocab_ids.min()) <= int(vocab_ids.max())
            if not ids_ok or int(vocab_ids.max()) >= target.vocab_size:
                raise DrafterError(f"a draft vocabulary must hold distinct ids in 0..{target.vocab_size - 1}")
            drafter.vocab_ids.copy_(vocab_ids.sort().values)
        return drafter.to(device=target.device, dtype=target.dtype).attach(target)

    def attach(self, target: Target) -> "BlockDrafter":
        """Share the target's frozen embedding/head and make the target capture our context layers."""
        fp = target.fingerprint()
        if self.config.target_fingerprint and fp != self.config.target_fingerprint:
            raise DrafterError(
                f"this drafter belongs to target {self.config.target_name!r} (fingerprint "
                f"{self.config.target_fingerprint}), not to {target.name!r} (fingerprint {fp}): its "
                f"vocabulary, width or shared embedding/LM-head weights differ")
        self.shared = _SharedParts(target.embed_tokens, target.lm_head)
        if self.vocab_ids is not None:  # the kept head rows, and each target id's row in them (-1: none)
            ids = self.vocab_ids.to(target.lm_head.weight.device)
            self.register_buffer("draft_head", target.lm_head.weight.detach()[ids].clone(), persistent=False)
            index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
            self.register_buffer("draft_index", index.index_copy(0, ids, torch.arange(ids.numel(), device=ids.device)),
                                 persistent=False)
        target.set_layer_ids(self.config.target_layer_ids)
        # the fused LM-head top-k needs a bias-free head; chosen once here, never per call
        self.ops = kernel_ops(target.device) if getattr(target.lm_head, "bias", None) is None else REFERENCE
        use_few_row_linear(self)  # the opt-in few-row rule for its own products (cpu_linear.py)
        return self

    def save(self, path: str | Path) -> Path:
        return save_folder(self, self.config, path)

    @classmethod
    def load(cls, path: str | Path, target: Target) -> "BlockDrafter":
        drafter = load_folder(path, cls, DraftModelConfig, DrafterError, "drafter")
        return drafter.to(device=target.device, dtype=target.dtype).attach(target)

    # ------------------------------------------------------------------------------ computation
    def _cos_sin(self, positions: torch.Tensor):
        dtype = self.fc.weight.dtype
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """(b, t, m*H) raw target features -> (b, t, H) fused context vectors."""
        return self.context_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """Per-layer context keys/values [(b, kvh, t, hd)] for features at integer positions (b, t)."""
        ctx = self.fuse_context(features)
        cos, sin = self._cos_sin(positions)
        return [layer.attn.project_kv(ctx, cos, sin) for layer in self.layers]

    @torch.inference_mode()
    def extend_context(self, cache: DraftContextCache, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append newly committed positions' target features to the drafter's context cache."""
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            cache.append(i, k, v)

    def block_embeddings(self, anchor_ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """[anchor, MASK * (B-1)] -> (b, B, H)."""
        anchor = self.shared.embed_tokens(anchor_ids)[:, None]  # (b, 1, H)
        masks = self.mask_embedding.to(anchor.dtype).expand(anchor.shape[0], block_size - 1, -1)
        return torch.cat([anchor, masks], dim=1)

    def forward_block(self, block_embeds, positions, ctx_kv, attn_mask=None) -> torch.Tensor:
        """Run the layers over block embeddings (b, t, H) at positions (b, t); returns hidden (b, t, H)."""
        cos, sin = self._cos_sin(positions)
        x = block_embeds
        for layer, (ctx_k, ctx_v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ctx_k, ctx_v, attn_mask)
        return x

    def head_weight(self) -> torch.Tensor:
        """The LM-head rows the drafter scores: the target's whole head, or the draft vocabulary's rows."""
        return self.shared.lm_head.weight if self.vocab_ids is None else self.draft_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """z = W_o(RMSNorm(h)) with the target's frozen head, (..., V); with a draft vocabulary only its
        rows are computed and every other id gets OUT_OF_VOCAB."""
        normed = self.norm(hidden)
        if self.vocab_ids is None:
            return self.shared.lm_head(normed)
        return self.widen(self._draft_logits(normed))

    def _draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's logits (..., N) of normed hidden states."""
        return few_row_linear(normed, self.draft_head.to(normed.dtype))

    def scored_logits(self, hidden: torch.Tensor, labels: torch.Tensor,
                      ignore: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits over the rows the drafter scores (..., N or V) and the labels as indices into them: a
        cross-entropy on these equals one on `logits` (an OUT_OF_VOCAB column adds exp(-1e9) = 0 to the
        normaliser) without computing or normalising over the ids it never drafts."""
        if self.vocab_ids is None:
            return self.logits(hidden), labels
        return F.linear(self.norm(hidden), self.draft_head), self.draft_positions(labels, ignore)

    def widen(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (..., N) -> over the target's (..., V), OUT_OF_VOCAB elsewhere."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), OUT_OF_VOCAB)
        return full.index_copy(-1, self.vocab_ids, draft_logits)

    def draft_positions(self, labels: torch.Tensor, ignore: int) -> torch.Tensor:
        """Target ids -> their rows in `head_weight()` (unchanged without a draft vocabulary); `ignore`
        and ids outside the draft vocabulary -> `ignore`."""
        if self.vocab_ids is None:
            return labels
        rows = self.draft_index[labels.clamp(min=0)]
        return torch.where((labels == ignore) | (rows < 0), torch.full_like(labels, ignore), rows)

    def drafts_only_vocab(self, labels: torch.Tensor, ignore: int) -> torch.Tensor:
        """Labels with every id the drafter cannot score set to `ignore` (a training loss cannot lower the
        cross-entropy of a token whose logit is fixed); unchanged without a draft vocabulary."""
        if self.vocab_ids is None:
            return labels
        outside = (labels != ignore) & (self.draft_index[labels.clamp(min=0)] < 0)
        return labels.masked_fill(outside, ignore)

    @torch.inference_mode()
    def draft(self, cache: DraftContextCache, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
              block_size: int | None = None):
        """Draft one block. anchor_ids, anchor_pos: (b,). Returns hidden, logits for positions 1..B-1."""
        hidden = self.draft_hidden(cache, anchor_ids, anchor_pos, block_size)
        return hidden, self.logits(hidden)

    @torch.inference_mode()
    def draft_hidden(self, cache: DraftContextCache, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                     block_size: int | None = None) -> torch.Tensor:
        """Hidden states (b, B-1, H) of one drafted block (positions 1..B-1)."""
        block_size = block_size or self.config.block_size
        embeds = self.block_embeddings(anchor_ids, block_size)
        positions = anchor_pos[:, None] + torch.arange(block_size, device=anchor_pos.device)
        ctx_kv = list(zip(cache.keys, cache.values))
        return self.forward_block(embeds, positions, ctx_kv)[:, 1:]

    @torch.no_grad()  # not inference_mode: precompute_blocks keeps the pools for later replays outside it
    def pool(self, hidden: torch.Tensor, k: int, with_logits: bool = True, widen: bool = True):
        """logits (..., V) or None, pool_ids, pool_logprobs (..., k) of hidden (..., H) (DESIGN §1.2).
        widen=False: with a draft vocabulary the logits cover only its N ids, in `vocab_ids` order
        (`logit_ids`), for a method that reads them so (narrow_logits).

        The reference ops compute the logits and take their top-k (`candidate_pool`). The fused
        `lm_head_topk` kernel never materialises them: then logits are computed only when
        `with_logits` asks for them (a repair method that reads the whole distribution). With a draft vocabulary
        the reference ops take the log-softmax and the top-k over its N ids (every other id's logit is
        OUT_OF_VOCAB: exp() = 0 in the normaliser, never in a top-k), the same pool as over all V up to the
        normaliser's float rounding, and widen the logits to V only when asked: in replay and the live
        engine that V-wide fill, copy, log-softmax and top-k were most of a drafter pass's time."""
        if not self.ops.fused:
            if self.vocab_ids is None:
                logits = self.logits(hidden)
                return (logits, *candidate_pool(logits, k))
            draft_logits = self._draft_logits(self.norm(hidden))
            pool_ids, pool_logprobs = candidate_pool(draft_logits, k)
            logits = (self.widen(draft_logits) if widen else draft_logits) if with_logits else None
            return logits, self.vocab_ids[pool_ids], pool_logprobs
        normed = self.norm(hidden)
        weight = self.head_weight()
        pool_ids, pool_logprobs, _ = self.ops.lm_head_topk(normed.to(weight.dtype), weight, k)
        if self.vocab_ids is not None:
            pool_ids = self.vocab_ids[pool_ids]
        if not with_logits:
            return None, pool_ids, pool_logprobs
        narrow = not widen and self.vocab_ids is not None
        return (self._draft_logits(normed) if narrow else self.logits(hidden)), pool_ids, pool_logprobs

    def logit_ids(self, widen: bool) -> torch.Tensor | None:
        """The token id of each column of `pool`'s logits (None: column j is token j)."""
        return None if widen else self.vocab_ids

    def forward_anchored(self, ctx_kv, anchors: torch.Tensor, anchor_ids: torch.Tensor,
                         block_size: int | None = None) -> torch.Tensor:
        """Many blocks per sequence in one pass (training and replay).

        ctx_kv: per-layer keys/values of a whole sequence's context, [(b, kvh, T, hd)] from
        `context_kv` at positions 0..T-1. anchors, anchor_ids: (b, nA) anchor positions and tokens.
        Block j sees context positions < anchors[:, j] and, bidirectionally, only its own block —
        exactly what `draft` sees at inference. Returns hidden (b, nA, B-1, H).
        """
        B = block_size or self.config.block_size
        b, n_anchor = anchors.shape
        T = ctx_kv[0][0].shape[2]
        embeds = self.block_embeddings(anchor_ids.reshape(-1), B).view(b, n_anchor * B, -1)
        offsets = torch.arange(B, device=anchors.device)
        positions = (anchors[..., None] + offsets).view(b, n_anchor * B)
        ctx_pos = torch.arange(T, device=anchors.device)
        sees_ctx = (ctx_pos < anchors[..., None])[:, :, None, :].expand(b, n_anchor, B, T)
        block_id = torch.arange(n_anchor, device=anchors.device).repeat_interleave(B)
        sees_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
        attn_mask = torch.cat([sees_ctx.reshape(b, n_anchor * B, T), sees_block], dim=-1)[:, None]
        hidden = self.forward_block(embeds, positions, ctx_kv, attn_mask)
        return hidden.view(b, n_anchor, B, -1)[:, :, 1:]
