"""DRelay: a global reader over the whole block's candidate pools and a causal selector that
repairs the drafter's native choices left to right (DESIGN §1.2-§1.4).

    pool     : c_{i,1..k}, s_{i,1..k} = top-k of log_softmax(z_i)            (c_{i,1} = native)
    reader   : u_{i,j} = A·E(c_{i,j}) + Bh·h_i + f(s_{i,j}) + pos_i + rank_j
               -> R pre-norm encoder layers, FULL attention over the (B-1)*k candidates -> g_{i,j}
    selector : r_i = GRU(proj(E(ŷ_m)) + g_{m,chosen} for m < i), ŷ_0 = anchor
               σ_{i,j} = s_{i,j} + MLP([g_{i,j}; r_i]) + <P g_{i,j}, Q r_i>;
               replace the native only if max_{j>1} σ_{i,j} - σ_{i,1} > δ (the repair margin)

The score is a residual on the drafter's own log-prob (its last layer starts at zero), so an untrained
selector ranks exactly like the drafter and keeps every native choice; training learns the corrections.
The low-rank bilinear term lets a candidate and the chosen prefix interact directly (rank `bilinear_rank`,
0: off), which is easier to learn than through the MLP alone.
`residual: false` gives the plain σ = MLP([g; r]) (an ablation).

`score` runs the selector teacher-forced on the true tokens (training, all positions at once);
`select` runs it sequentially on its own choices (inference, the engine's repair hook); `joint_loss`
is the method's whole joint objective (drelay/models/repair.py has the interface).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from drelay.kernels.ops import Ops, REFERENCE, kernel_ops
from drelay.kernels.reference import SelectorWeights, candidate_pool, keep_or_replace
from drelay.models.folder import EmbeddingBoundFolder, SharedEmbedding
from drelay.models.relay_loss import drelay_loss, drelay_loss_from_terms
from drelay.models.repair import DraftBlock, RepairMethod, Score, bf16_autocast

if TYPE_CHECKING:
    from drelay.config import DRelaySettings
    from drelay.models.drafter import BlockDrafter

MIN_LOGPROB = -30.0  # pool log-probs are clamped here before f(s): lower all means "never"


class RelayError(RuntimeError):
    """A relay folder that is missing or corrupt, or a block the relay cannot read."""


@dataclass
class RelayConfig:
    hidden_size: int  # H, the drafter's (= target's) width: h_i and E(c) live there
    block_size: int = 8  # B: anchor + B-1 drafted positions (learned pos embeddings for B-1)
    reader_dim: int = 256  # d_r, width of the reader and the selector
    reader_layers: int = 2  # R, encoder layers of the global reader
    reader_heads: int = 4
    pool_size: int = 8  # k candidates per position (rank embeddings for k)
    prefix_model: str = "gru"  # r_i: "gru", or "attn" (1-layer causal attention)
    repair_margin: float = 0.0  # δ >= 0: a replacement must beat the native's score by more than this
    residual: bool = True  # σ = s (the drafter's log-prob) + MLP: starts as the native ranking
    bilinear_rank: int = 64  # rank of the candidate x prefix-state bilinear score term (0: none)
    dropout: float = 0.0

    renamed_keys = {"margin": "repair_margin"}  # config.json keys of relays saved before a rename

    def __post_init__(self):
        if self.prefix_model not in ("gru", "attn"):
            raise ValueError(f"prefix_model must be 'gru' or 'attn', got {self.prefix_model!r}")
        if self.repair_margin < 0:
            raise ValueError(f"repair_margin (δ) must be >= 0, got {self.repair_margin}")
        if self.block_size < 2 or self.pool_size < 1 or self.reader_dim % self.reader_heads:
            raise ValueError(f"need block_size >= 2, pool_size >= 1 and reader_dim divisible by "
                             f"reader_heads, got {self.block_size}, {self.pool_size}, "
                             f"{self.reader_dim}/{self.reader_heads}")


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer: full attention (reader) or causal attention (attn prefix model)."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (b, nh, t, hs) each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=self.dropout if self.training else 0.0)
        x = x + F.dropout(self.out(y.transpose(1, 2).reshape(b, t, d)), self.dropout, self.training)  # (b, t, d)
        return x + self.mlp(self.norm2(x))


class GlobalReader(nn.Module):
    """One token per candidate, full attention over the block: "York" at 3 can vouch for "New" at 2."""

    def __init__(self, cfg: RelayConfig):
        super().__init__()
        d = cfg.reader_dim
        self.A = nn.Linear(cfg.hidden_size, d, bias=False)  # candidate embedding E(c) -> d_r
        self.Bh = nn.Linear(cfg.hidden_size, d)  # drafter hidden h_i -> d_r
        self.f = nn.Sequential(nn.Linear(1, d), nn.GELU(), nn.Linear(d, d))  # log-prob s -> d_r
        self.pos = nn.Parameter(torch.randn(cfg.block_size - 1, d) * 0.02)
        self.rank = nn.Parameter(torch.randn(cfg.pool_size, d) * 0.02)
        self.layers = nn.ModuleList(EncoderLayer(d, cfg.reader_heads, cfg.dropout) for _ in range(cfg.reader_layers))
        self.norm = nn.LayerNorm(d)
        self.support_head = nn.Linear(d, 1)  # "c_{i,j} is the correct token at i"

    def forward(self, cand_embeds: torch.Tensor, hidden: torch.Tensor, pool_logprobs: torch.Tensor):
        """cand_embeds (N, n, k, H), hidden (N, n, H), pool_logprobs (N, n, k) -> g (N, n, k, d), support (N, n, k)."""
        N, n, k, _ = cand_embeds.shape
        s = pool_logprobs.clamp(min=MIN_LOGPROB)[..., None]  # (N, n, k, 1)
        u = self.A(cand_embeds) + self.Bh(hidden)[:, :, None] + self.f(s) + self.pos[:n, None] + self.rank[:k]
        x = u.view(N, n * k, -1)  # (N, n*k, d): every candidate of the block is one token
        for layer in self.layers:
            x = layer(x)
        g = self.norm(x).view(N, n, k, -1)  # (N, n, k, d)
        return g, self.support_head(g).squeeze(-1)


class CausalSelector(nn.Module):
    """Prefix state r_i over the selected tokens ŷ_0..ŷ_{i-1}, and scores σ_{i,j} = MLP([g_{i,j}; r_i])."""

    def __init__(self, cfg: RelayConfig):
        super().__init__()
        d = cfg.reader_dim
        self.embed_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.no_feature = nn.Parameter(torch.randn(d) * 0.02)  # the anchor, or a true token outside the pool
        self.kind = cfg.prefix_model
        self.prefix = (nn.GRU(d, d, batch_first=True) if self.kind == "gru"
                       else EncoderLayer(d, cfg.reader_heads, cfg.dropout))
        self.prefix_norm = nn.LayerNorm(d)
        self.score_mlp = nn.Sequential(nn.Linear(2 * d, d), nn.GELU(), nn.Linear(d, 1))
        self.residual = cfg.residual
        self.bilinear_rank = cfg.bilinear_rank
        if self.bilinear_rank:
            self.cand_proj = nn.Linear(d, cfg.bilinear_rank, bias=False)
            self.prefix_proj = nn.Linear(d, cfg.bilinear_rank, bias=False)
        if self.residual:  # an untrained selector scores exactly the drafter's log-probs
            nn.init.zeros_(self.score_mlp[-1].weight)
            nn.init.zeros_(self.score_mlp[-1].bias)
            if self.bilinear_rank:
                nn.init.zeros_(self.prefix_proj.weight)

    def prefix_inputs(self, token_embeds, feature=None, has_feature=None) -> torch.Tensor:
        """token_embeds (N, t, H), the chosen candidates' g (N, t, d) where has_feature (N, t) -> (N, t, d)."""
        feat = self.no_feature if feature is None else torch.where(has_feature[..., None], feature, self.no_feature)
        return self.embed_proj(token_embeds) + feat

    def prefix_states(self, inputs: torch.Tensor, state=None):
        """Inputs of ŷ_m..ŷ_{m+t-1} (N, t, d) -> r_{m+1}..r_{m+t} (N, t, d) and the state to continue from."""
        if self.kind == "gru":
            out, state = self.prefix(inputs, state)  # state: (1, N, d)
        else:  # causal attention recomputed over the whole prefix so far (t <= B-1, cheap)
            state = inputs if state is None else torch.cat([state, inputs], dim=1)  # (N, m+t, d)
            out = self.prefix(state, causal=True)[:, -inputs.shape[1]:]
        return self.prefix_norm(out), state

    def gru_input_gates(self, inputs: torch.Tensor) -> torch.Tensor:
        """The input side W_i x + b_i (..., 3d) of the GRU's gates for prefix inputs x (..., d): computed
        for every candidate at once, so the sequential loop only multiplies the state."""
        return F.linear(inputs, self.prefix.weight_ih_l0, self.prefix.bias_ih_l0)

    def gru_weights(self) -> SelectorWeights:
        """The GRU prefix model and the r-dependent parts of σ as plain tensors (the relay_select op)."""
        gru, first, last, d = self.prefix, self.score_mlp[0], self.score_mlp[2], self.prefix_norm.weight.shape[0]
        return SelectorWeights(gru.weight_hh_l0, gru.bias_hh_l0, self.prefix_norm.weight, self.prefix_norm.bias,
                               self.prefix_norm.eps, first.weight[:, d:], last.weight, last.bias,
                               self.prefix_proj.weight if self.bilinear_rank else None)

    def candidate_terms(self, g: torch.Tensor, logprobs: torch.Tensor) -> tuple:
        """The parts of σ that depend on the candidates alone, computed once per block: the MLP's first
        layer on g (N, t, k, d), the bilinear candidate factor (N, t, k, R) and the clamped log-probs."""
        d = g.shape[-1]
        first = self.score_mlp[0]
        a = F.linear(g, first.weight[:, :d], first.bias)
        c = self.cand_proj(g) if self.bilinear_rank else None
        return a, c, logprobs.clamp(min=MIN_LOGPROB).to(a.dtype)

    def score_terms(self, terms: tuple, r: torch.Tensor) -> torch.Tensor:
        """σ (N, t, k) from `candidate_terms` and the prefix states r (N, t, d): the MLP on [g; r] is its
        first layer split into a g part (precomputed) and an r part, so the sequential loop only pays for r."""
        a, c, logprobs = terms
        first, d = self.score_mlp[0], r.shape[-1]
        h = a + F.linear(r, first.weight[:, d:])[:, :, None]  # (N, t, k, d)
        sigma = self.score_mlp[2](self.score_mlp[1](h)).squeeze(-1)
        if self.bilinear_rank:
            sigma = sigma + (c * self.prefix_proj(r)[:, :, None]).sum(-1) / self.bilinear_rank ** 0.5
        return sigma + logprobs if self.residual else sigma

    def score(self, g: torch.Tensor, r: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """g (N, t, k, d), r (N, t, d), the candidates' log-probs (N, t, k) -> σ (N, t, k)."""
        return self.score_terms(self.candidate_terms(g, logprobs), r)

    def forward(self, g: torch.Tensor, inputs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """Parallel (teacher-forced): g (N, n, k, d), inputs of ŷ_0..ŷ_{n-1} (N, n, d), log-probs
        (N, n, k) -> σ (N, n, k)."""
        return self.score(g, self.prefix_states(inputs)[0], logprobs)


class DRelay(EmbeddingBoundFolder, RepairMethod):
    """Reader + selector. `score`: teacher-forced training pass; `select`: the repair hook."""

    config_cls, folder_error = RelayConfig, RelayError
    name, folder_name = "drelay", "relay"
    needs_logits = False  # the engine's repair hook reads only the pool (fused lm_head_topk: no logits)

    def __init__(self, cfg: RelayConfig):
        super().__init__()
        self.config = cfg
        self.reader = GlobalReader(cfg)
        self.selector = CausalSelector(cfg)
        self.shared: SharedEmbedding | None = None
        self.ops: Ops = REFERENCE
        self.settings: DRelaySettings | None = None  # the joint objective's settings (set by `create`)

    @classmethod
    def for_drafter(cls, drafter: BlockDrafter, **kwargs) -> "DRelay":
        """A fresh relay sized for `drafter`, on its device and dtype, bound to its embedding."""
        cfg = RelayConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.config.block_size, **kwargs)
        w = drafter.fc.weight
        return cls(cfg).to(device=w.device, dtype=w.dtype).attach(drafter.shared.embed_tokens)

    @classmethod
    def _create(cls, drafter: BlockDrafter, settings: DRelaySettings, pool_size: int) -> "DRelay":
        relay = cls.for_drafter(drafter, reader_dim=settings.reader_dim, reader_layers=settings.reader_layers,
                                reader_heads=settings.reader_heads, pool_size=pool_size,
                                prefix_model=settings.prefix_model, residual=settings.residual_score,
                                bilinear_rank=settings.bilinear_rank)
        relay.settings = settings
        return relay

    def attach(self, embed_tokens: nn.Module) -> "DRelay":
        width = embed_tokens.weight.shape[-1]
        if width != self.config.hidden_size:
            raise RelayError(f"embedding width {width} != relay hidden_size {self.config.hidden_size}")
        self.shared = SharedEmbedding(embed_tokens)
        self.ops = kernel_ops(embed_tokens.weight.device)  # relay_select / support_loss, chosen once
        return self

    @classmethod
    def folder_what(cls) -> str:
        return "relay"

    # ------------------------------------------------------------------ the repair-method interface
    def joint_loss(self, drafter, hidden, labels, anchor_ids, *, gamma, progress):
        """L = CE + λ_s·(hinge + reader BCE) + λ_r·ω-weighted repair CE (`drelay_loss`): the pool from the
        detached logits, σ teacher-forced on the labels. The fused ops compute CE, hinge and pool without
        the logits (they stay fp32 inside the kernel, where autocast would round them to bf16)."""
        cfg = self.settings
        if cfg is None:
            raise RelayError("this relay has no training settings: make it with DRelay.create(drafter, settings, ...)")
        k = self.config.pool_size
        with bf16_autocast(hidden):
            if self.ops.fused:
                normed = drafter.norm(hidden)
                weight = drafter.shared.lm_head.weight
                ce, hinge, pool_ids, pool_logprobs = self.ops.support_loss(
                    normed.to(weight.dtype), weight, labels, k, gamma, cfg.hinge_margin)
                sigma, support = self.score(hidden, pool_ids, pool_logprobs, anchor_ids, labels)
                return drelay_loss_from_terms(ce, hinge, labels, sigma, support, pool_ids,
                                              lambda_support=cfg.lambda_support, lambda_repair=cfg.lambda_repair,
                                              eps=cfg.eps)
            logits = drafter.logits(hidden)  # (..., n, V)
            pool_ids, pool_logprobs = candidate_pool(logits.detach(), k)  # (..., n, k)
            sigma, support = self.score(hidden, pool_ids, pool_logprobs, anchor_ids, labels)
        return drelay_loss(logits, labels, sigma, support, pool_ids, gamma=gamma, lambda_support=cfg.lambda_support,
                           lambda_repair=cfg.lambda_repair, hinge_margin=cfg.hinge_margin, eps=cfg.eps)

    def tune(self, score: Score) -> dict[float, float]:
        """δ with the highest held-out replay τ among settings.repair_margins (ties: the smallest δ)."""
        margins = self.settings.repair_margins if self.settings else (self.config.repair_margin,)
        taus = {float(m): score(lambda block, m=float(m): self.select(block, repair_margin=m)) for m in sorted(margins)}
        self.config = dataclasses.replace(self.config, repair_margin=max(taus, key=lambda m: (taus[m], -m)))
        return taus

    def method_state(self) -> dict:
        return {"repair_margin": self.config.repair_margin}

    def load_method_state(self, state: dict) -> None:
        self.config = dataclasses.replace(self.config, repair_margin=state["repair_margin"])

    def eval_metrics(self) -> dict[str, float]:
        return {"repair_margin": self.config.repair_margin}

    # ------------------------------------------------------------------------------ computation
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            raise RelayError("relay has no embedding: call relay.attach(target.embed_tokens) first")
        return self.shared.embed_tokens(ids).to(self.reader.A.weight.dtype)

    def read(self, hidden, pool_ids, pool_logprobs):
        """hidden (N, n, H), pool (N, n, k) -> g (N, n, k, d), support logits (N, n, k)."""
        n, k = pool_ids.shape[-2:]
        if n > self.config.block_size - 1 or k > self.config.pool_size:
            raise RelayError(f"block of {n} positions x {k} candidates exceeds the relay's "
                             f"{self.config.block_size - 1} x {self.config.pool_size}")
        dtype = self.reader.A.weight.dtype
        return self.reader(self.embed(pool_ids), hidden.to(dtype), pool_logprobs.to(dtype))

    def _inputs(self, g, pool_ids, tokens):
        """Prefix inputs of tokens (N, t) sitting at the positions of g (N, t, k, d), pool_ids (N, t, k)."""
        tokens = torch.where(tokens < 0, pool_ids[..., 0], tokens)  # padding (IGNORE): any valid id
        match = pool_ids == tokens[..., None]  # (N, t, k)
        j = match.long().argmax(-1)  # (N, t): which candidate (0 when not in the pool)
        chosen = g.gather(2, j[..., None, None].expand(-1, -1, 1, g.shape[-1])).squeeze(2)  # (N, t, d)
        return self.selector.prefix_inputs(self.embed(tokens), chosen, match.any(-1))

    def score(self, hidden, pool_ids, pool_logprobs, anchor_ids, prefix_ids):
        """Teacher-forced σ and support logits (..., n, k), all positions in parallel.

        hidden (..., n, H); pool_ids, pool_logprobs (..., n, k); anchor_ids (...); prefix_ids (..., n):
        the true tokens y_1..y_n (only y_1..y_{n-1} feed the prefix; negative ids are padding).
        Conditioning on the true prefix is exact: position i only matters when all before it were right.
        """
        lead, (n, k) = pool_ids.shape[:-2], pool_ids.shape[-2:]
        pool_ids = pool_ids.reshape(-1, n, k)  # (N, n, k)
        g, support = self.read(hidden.reshape(-1, n, hidden.shape[-1]), pool_ids, pool_logprobs.reshape(-1, n, k))
        anchor = self.selector.prefix_inputs(self.embed(anchor_ids.reshape(-1, 1)))  # (N, 1, d)
        prev = prefix_ids.reshape(-1, n)[:, : n - 1]  # (N, n-1): y_1..y_{n-1}
        inputs = torch.cat([anchor, self._inputs(g[:, : n - 1], pool_ids[:, : n - 1], prev)], dim=1)  # (N, n, d)
        sigma = self.selector(g, inputs, pool_logprobs.reshape(-1, n, k))
        return sigma.view(*lead, n, k), support.view(*lead, n, k)

    @torch.no_grad()
    def select(self, block: DraftBlock, return_scores: bool = False, prefix_ids: torch.Tensor | None = None,
               repair_margin: float | None = None):
        """Repair one block left to right: tokens (b, n) [, σ (b, n, k)].

        Keeps the native c_{i,1} unless max_{j>1} σ_{i,j} - σ_{i,1} > δ (`repair_margin`, default the config's).
        prefix_ids (b, n), for tests and analysis: feed these tokens to the prefix state instead of the choices.
        """
        if repair_margin is None:
            repair_margin = self.config.repair_margin
        pool_ids = block.pool_ids
        g, _ = self.read(block.hidden, pool_ids, block.pool_logprobs)  # (b, n, k, d)
        sel = self.selector
        terms = sel.candidate_terms(g, block.pool_logprobs)  # the candidate-only parts of σ, once
        # the prefix input each candidate would feed if chosen (chosen tokens are always in the pool)
        chosen_inputs = sel.prefix_inputs(self.embed(pool_ids), g, torch.ones_like(pool_ids, dtype=torch.bool))
        anchor = sel.prefix_inputs(self.embed(block.anchor_ids[:, None]))  # (b, 1, d)
        if sel.kind == "gru" and prefix_ids is None:  # the whole loop in one op (one launch on CUDA)
            cand_hidden, cand_factor, logprobs = terms
            choice, sigma = self.ops.relay_select(sel.gru_input_gates(anchor[:, 0]), sel.gru_input_gates(chosen_inputs),
                                   cand_hidden, sel.gru_weights(), cand_factor,
                                   logprobs if sel.residual else None, repair_margin)
        else:
            choice, sigma = self._select_loop(g, terms, chosen_inputs, anchor, pool_ids, prefix_ids, repair_margin)
        tokens = pool_ids.gather(-1, choice[..., None]).squeeze(-1)  # (b, n)
        return (tokens, sigma) if return_scores else tokens

    def _select_loop(self, g, terms, chosen_inputs, x, pool_ids, prefix_ids, repair_margin):
        """`select` step by step through the prefix model's own forward (the attention prefix model, or a
        prefix fed `prefix_ids`): choice (b, n), σ (b, n, k)."""
        sel = self.selector
        n = pool_ids.shape[1]
        state, choices, scores = None, [], []
        for i in range(n):
            r, state = sel.prefix_states(x, state)  # (b, 1, d)
            sigma = sel.score_terms(tuple(t[:, i: i + 1] if t is not None else None for t in terms), r)[:, 0]  # (b, k)
            j = keep_or_replace(sigma, repair_margin)
            choices.append(j)
            scores.append(sigma)
            if i < n - 1:
                if prefix_ids is None:  # the chosen candidate's input
                    x = chosen_inputs[:, i].gather(1, j[:, None, None].expand(-1, 1, chosen_inputs.shape[-1]))
                else:
                    x = self._inputs(g[:, i: i + 1], pool_ids[:, i: i + 1], prefix_ids[:, i: i + 1])
        return torch.stack(choices, dim=1), torch.stack(scores, dim=1)
