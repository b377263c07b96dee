"""DRelay: a global reader over the whole block's candidate pools and a causal selector that
repairs the drafter's native choices left to right (DESIGN §1.2-§1.4).

    pool     : c_{i,1..k}, s_{i,1..k} = top-k of log_softmax(z_i)            (c_{i,1} = native)
    lattice  : L_i(p, c) = <P[p] ⊙ W_h h_i, S[c]>, a k x k table per position over the pools (the
               anchor is position 0); forward/backward messages over it per candidate
    reader   : u_{i,j} = A·E(c_{i,j}) + T_c[c_{i,j}] + Bh·h_i + f(s_{i,j}) + pos_i + rank_j + msg_{i,j},
               plus one token for the anchor -> R pre-norm encoder layers, FULL attention -> g_{i,j}
    selector : r_i = GRU(proj(E(ŷ_m)) + T_in[ŷ_m] + g_{m,chosen} for m < i), ŷ_0 = anchor
               σ_{i,j} = a_i·s_{i,j} + b_i·[j = 1] + L_i(ŷ_{i-1}, c_{i,j}) + MLP([g_{i,j}; r_i]) + <P' g_{i,j}, Q' r_i>
               (float32); replace the native only if max_{j>1} σ_{i,j} - σ_{i,1} > δ (the repair margin)

Every v2 part (token tables, lattice, messages, anchor token, calibration) is a config switch, off in
`drelay-lite` (the paper-literal version: σ = s + MLP + bilinear). Each part that adds to σ starts at
zero (S, the token tables, the MLP's last layer, Q'; a_i = 1, b_i = 0), so an untrained selector ranks
exactly like the drafter and keeps every native choice; training learns the corrections.

`score` runs the selector teacher-forced on the true tokens (training, all positions at once);
`select` runs it sequentially on its own choices (inference, the engine's repair hook; a beam over
the block is an option); `joint_loss` is the method's whole joint objective (drelay/models/repair.py
has the interface).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from drelay.data.records import IGNORE
from drelay.kernels.ops import Ops, REFERENCE, kernel_ops
from drelay.kernels.reference import (SelectorWeights, candidate_pool, dflash_ce, keep_or_replace, lattice_messages,
                                      support_hinge)
from drelay.models.folder import EmbeddingBoundFolder, SharedEmbedding
from drelay.models.relay_loss import drelay_loss_from_terms
from drelay.models.repair import DraftBlock, RepairMethod, Score

if TYPE_CHECKING:
    from drelay.config import DRelayLiteSettings, DRelaySettings
    from drelay.models.drafter import BlockDrafter

MIN_LOGPROB = -30.0  # pool log-probs are clamped here before f(s): lower all means "never"
FEW_QUERY_ROWS = 8  # `Lattice.vocabulary` of at most this many grad-free float32 CPU rows: the float16 table


class Derived:
    """A tensor derived from some parameters and buffers (a table over the vocabulary), kept for grad-free calls
    while every source is unchanged: the same storage at the same version counter (an optimizer step, a
    load_state_dict or a `.to` changes one or the other). Sources that are inference tensors carry no version:
    then it is rebuilt each time. Not part of the state dict."""

    def __init__(self):
        self._stamp, self._value = None, None

    def get(self, sources: list[torch.Tensor], build) -> torch.Tensor:
        if any(t.is_inference() for t in sources):
            return build()
        stamp = tuple((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in sources)
        if stamp != self._stamp:
            self._value = None  # the old table's memory first
            self._value, self._stamp = build(), stamp
        return self._value


def wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (a calibrated σ; float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


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
    repair_margin: float = 0.0  # δ: a replacement must beat the native's score by more than this (may be < 0)
    residual: bool = True  # σ = s (the drafter's log-prob) + MLP: starts as the native ranking
    bilinear_rank: int = 64  # rank of the candidate x prefix-state bilinear score term (0: none)
    dropout: float = 0.0
    # v2 parts (DESIGN §1.3-§1.4); the defaults are drelay-lite, so relays saved before v2 load as they were
    vocab_size: int = 0  # V: the ids the token tables and the lattice take (needed when either is on)
    table_rows: int = 0  # rows of those tables: 0, one per id (V); N + 1 with a draft vocabulary of N ids: one
    # per draft id plus one shared by every other id (candidates are always draft ids; a predecessor or the
    # anchor may not be); TableRows' `row_of` buffer maps an id to its row.
    token_rank: int = 0  # learned token tables T_c (reader) and T_in (prefix) of rank token_rank (0: none)
    lattice_rank: int = 0  # transition lattice P, S (V x r), W_h (H -> r) inside σ (0: none)
    lattice_messages: bool = False  # forward/backward lattice messages as reader inputs
    lattice_bigram: bool = False  # the lattice's query gets a learned bias b (= 1 at the start): <P[p] ⊙ (W_h h + b), S[c]>
    lattice_pool: bool = False  # the pool is the top-k of z_i + L_i(prev, ·) over the vocabulary, not of z_i alone
    lattice_pool_first: bool = False  # the same at position 1 only, where prev is the anchor (known in training and
    # inference alike); the later pools stay the top-k of z_i
    anchor_token: bool = False  # the anchor as a reader token
    calibrate: bool = False  # σ in float32, per-position scale a_i on s and bias b_i on the native
    beam_width: int = 1  # select: a beam of this width over the block (1: the greedy walk)

    renamed_keys = {"margin": "repair_margin"}  # config.json keys of relays saved before a rename

    def __post_init__(self):
        if self.prefix_model not in ("gru", "attn"):
            raise ValueError(f"prefix_model must be 'gru' or 'attn', got {self.prefix_model!r}")
        if self.block_size < 2 or self.pool_size < 1 or self.reader_dim % self.reader_heads:
            raise ValueError(f"need block_size >= 2, pool_size >= 1 and reader_dim divisible by "
                             f"reader_heads, got {self.block_size}, {self.pool_size}, "
                             f"{self.reader_dim}/{self.reader_heads}")
        if (self.token_rank or self.lattice_rank) and self.vocab_size < 1:
            raise ValueError("token tables and the lattice need vocab_size >= 1")
        if (self.lattice_messages or self.lattice_bigram or self.lattice_pool or self.lattice_pool_first) \
                and not self.lattice_rank:
            raise ValueError("lattice_messages, lattice_bigram and lattice_pool need lattice_rank >= 1 (lattice_pool_first too)")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if not 0 <= self.table_rows <= self.vocab_size + 1:
            raise ValueError(f"table_rows must be in [0, vocab_size + 1], got {self.table_rows}")


class TableRows(nn.Module):
    """Which row of a token-indexed table an id reads: the id itself (rows = 0: one row per id), or, for
    tables sized to a draft vocabulary of N ids (rows = N + 1), a buffer (V,) mapping the draft ids to 0..N-1
    in id order and every other id to row N. Filled by `set_vocabulary`; a saved relay carries it."""

    def __init__(self, vocab_size: int, rows: int):
        super().__init__()
        self.count, self.compact = rows or vocab_size, bool(rows)
        if rows:
            self.register_buffer("row_of", torch.zeros(vocab_size, dtype=torch.long))
        self._is_vocabulary = Derived()  # `of_vocabulary`'s check, per ids tensor (the engine passes the same)

    def set_vocabulary(self, vocab_ids: torch.Tensor) -> None:
        if not self.compact or vocab_ids.numel() != self.count - 1:
            raise RelayError(f"a table of {self.count} rows cannot hold a draft vocabulary of "
                             f"{vocab_ids.numel()} ids")
        self.row_of.fill_(self.count - 1)
        self.row_of[vocab_ids.to(self.row_of.device)] = torch.arange(self.count - 1, device=self.row_of.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.row_of[ids] if self.compact else ids

    def of_vocabulary(self, ids: torch.Tensor) -> slice | torch.Tensor:
        """The rows of `ids` (N_ids,) as an index: the slice :N when they are the draft vocabulary itself (a view,
        no copy), else a tensor of rows."""
        if not self.compact or ids.numel() != self.count - 1:
            return self(ids)
        same = self._is_vocabulary.get([ids, self.row_of], lambda: torch.tensor(torch.equal(
            self.row_of[ids], torch.arange(ids.numel(), device=ids.device))))
        return slice(0, ids.numel()) if same else self(ids)


class TokenTable(nn.Module):
    """A learned token table of rank r (V x r, or one row per draft id + one: TableRows; zero-initialised,
    then r -> d): token identity in a space of its own, not only through the frozen target embedding the
    drafter's logits come from."""

    def __init__(self, vocab_size: int, rank: int, dim: int, rows: int = 0):
        super().__init__()
        self.index = TableRows(vocab_size, rows)
        self.table = nn.Embedding(self.index.count, rank)
        nn.init.zeros_(self.table.weight)  # an untrained table adds nothing
        self.proj = nn.Linear(rank, dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.table(self.index(ids)))

    def sources(self) -> list[torch.Tensor]:
        """The tensors its rows come from (what a `Derived` table of them is stamped with)."""
        return [self.table.weight, self.proj.weight, *([self.index.row_of] if self.index.compact else [])]


class Lattice(nn.Module):
    """L_i(p, c) = <P[p] ⊙ W_h h_i, S[c]>: how well candidate c at position i follows token p at i-1
    (DFlash2's selector signal). S starts at zero (no term); P ~ N(0, 1) as in our DFlash2, so S's first
    gradients are not vanishingly small. bigram: W_h gets a bias b starting at 1, so the lattice holds a
    plain low-rank bigram <P[p] ⊙ b, S[c]> (DSpark's Markov term) that the hidden state modulates."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, bigram: bool = False, rows: int = 0):
        super().__init__()
        self.index = TableRows(vocab_size, rows)
        self.predecessor = nn.Parameter(torch.randn(self.index.count, rank))  # P
        self.successor = nn.Parameter(torch.zeros(self.index.count, rank))  # S
        self.hidden_proj = nn.Linear(hidden_size, rank, bias=bigram)  # W_h (+ b)
        if bigram:
            nn.init.ones_(self.hidden_proj.bias)
        self.scale = rank ** -0.5  # a sum of r terms: the score stays O(1) as r grows (as the bilinear term)
        self._half_successor = Derived()

    def half_successor(self) -> torch.Tensor:
        """S in float16 (rows as S), kept while S is unchanged: `vocabulary`'s few-row products read it."""
        return self._half_successor.get([self.successor], lambda: self.successor.detach().half())

    def query(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """P[p] ⊙ W_h h_i: predecessors (...), hidden (..., H) -> (..., r)."""
        return self.predecessor[self.index(prev_ids)] * self.hidden_proj(hidden)

    def forced(self, prev_ids: torch.Tensor, hidden: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: predecessors (N, n), hidden (N, n, H), candidates (N, n, k) -> L (N, n, k), >= float32."""
        successor = self.successor[self.index(cand_ids)]
        return wide(torch.einsum("nir,nikr->nik", self.query(prev_ids, hidden), successor)) * self.scale

    def vocabulary(self, prev_ids: torch.Tensor, hidden: torch.Tensor,
                   ids: torch.Tensor | None = None) -> torch.Tensor:
        """L_i(y_{i-1}, v) for every token v (or every v in `ids`, (N_ids,)): predecessors (N, n), hidden (N, n, H)
        -> (N, n, V or N_ids), >= float32.

        A grad-free float32 product of at most FEW_QUERY_ROWS rows on CPU (the live decoders' position-1 pool)
        reads a float16 copy of S instead, kept while S is unchanged: on CPU that product is bound by reading
        S (V x r, 8 MB at r = 256, out of cache after a target forward), and half the bytes take a third of the
        time on a 2-core EPYC (~0.27 vs ~0.83 ms); the products are summed in float32, within ~2e-4 of the float32
        L at r = 256 (rounding can swap near-tied candidates of the pool, which verification makes harmless)."""
        rows = ((self.index.row_of if self.index.compact else slice(None)) if ids is None
                else self.index.of_vocabulary(ids))
        query = self.query(prev_ids, hidden)
        if (not torch.is_grad_enabled() and query.device.type == "cpu" and query.dtype == torch.float32
                and query.numel() // query.shape[-1] <= FEW_QUERY_ROWS):
            return F.linear(query.half(), self.half_successor()[rows]).float() * self.scale
        return wide(query @ self.successor[rows].T) * self.scale

    def table(self, anchor_ids: torch.Tensor, pool_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Over the pools: anchor (N,), pool_ids (N, n, k), hidden (N, n, H) -> T (N, n, k, k) (>= float32) with
        T[:, i, p, c] = L_i(pool_{i-1, p}, pool_{i, c}); at i = 0 every row p is the anchor's."""
        N, n, k = pool_ids.shape
        prev = torch.cat([anchor_ids.reshape(N, 1, 1).expand(N, 1, k), pool_ids[:, : n - 1]], dim=1)  # (N, n, k)
        query = self.query(prev, hidden[:, :, None])  # (N, n, k, r)
        return wide(torch.einsum("nipr,nijr->nipj", query, self.successor[self.index(pool_ids)])) * self.scale


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer: full attention (reader) or causal attention (attn prefix model)."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, causal: bool = False, keep: int | None = None) -> torch.Tensor:
        """x (b, t, d) -> (b, t, d); with `keep` (full attention only), the outputs of the first `keep` tokens
        (b, keep, d): every token is still attended to, only the others' queries and MLP rows are skipped."""
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (b, nh, t, hs) each
        if keep is not None and keep < t and not causal:
            q, x, t = q[:, :, :keep], x[:, :keep], keep
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=self.dropout if self.training else 0.0)
        x = x + F.dropout(self.out(y.transpose(1, 2).reshape(b, t, d)), self.dropout, self.training)  # (b, t, d)
        return x + self.mlp(self.norm2(x))


class GlobalReader(nn.Module):
    """One token per candidate (and one for the anchor), full attention over the block: "York" at 3 can
    vouch for "New" at 2."""

    def __init__(self, cfg: RelayConfig):
        super().__init__()
        d = cfg.reader_dim
        self.A = nn.Linear(cfg.hidden_size, d, bias=False)  # candidate embedding E(c) -> d_r
        self.Bh = nn.Linear(cfg.hidden_size, d)  # drafter hidden h_i -> d_r
        self.f = nn.Sequential(nn.Linear(1, d), nn.GELU(), nn.Linear(d, d))  # log-prob s -> d_r
        self.pos = nn.Parameter(torch.randn(cfg.block_size - 1, d) * 0.02)
        self.rank = nn.Parameter(torch.randn(cfg.pool_size, d) * 0.02)
        self.tokens = (TokenTable(cfg.vocab_size, cfg.token_rank, d, cfg.table_rows)  # T_c
                       if cfg.token_rank else None)
        self.messages = (nn.Sequential(nn.Linear(3, d), nn.GELU(), nn.Linear(d, d))  # lattice messages -> d_r
                         if cfg.lattice_messages else None)
        self.anchor_pos = nn.Parameter(torch.randn(d) * 0.02) if cfg.anchor_token else None
        self.layers = nn.ModuleList(EncoderLayer(d, cfg.reader_heads, cfg.dropout) for _ in range(cfg.reader_layers))
        self.norm = nn.LayerNorm(d)
        self.support_head = nn.Linear(d, 1)  # "c_{i,j} is the correct token at i"

    def token_input(self, embeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A·E(c) [+ T_c[c]] for tokens `ids` (...) with frozen embeddings (..., H) -> (..., d)."""
        x = self.A(embeds)
        return x if self.tokens is None else x + self.tokens(ids)

    def token_sources(self) -> list[torch.Tensor]:
        """The weights `token_input` reads besides the embedding (attribute reads: on the select path)."""
        return [self.A.weight, *(self.tokens.sources() if self.tokens is not None else [])]

    def forward(self, cand_inputs: torch.Tensor, hidden: torch.Tensor,
                pool_logprobs: torch.Tensor, messages: torch.Tensor | None = None,
                anchor: torch.Tensor | None = None, positions: int | None = None):
        """cand_inputs (N, n, k, d): `token_input` of the pool, hidden (N, n, H), pool_logprobs (N, n, k), messages
        (N, n, k, 3) | None, anchor input (N, d) | None -> g (N, n, k, d), support (N, n, k), g_anchor (N, d) | None.
        positions: only the first `positions` positions' outputs are wanted (a walk that stops there): every
        candidate is still read, and the last layer computes only the wanted tokens (g, support: (N, positions, k))."""
        N, n, k, _ = cand_inputs.shape
        s = pool_logprobs.clamp(min=MIN_LOGPROB)[..., None]  # (N, n, k, 1)
        u = cand_inputs + self.Bh(hidden)[:, :, None] + self.f(s) \
            + self.pos[:n, None] + self.rank[:k]
        if self.messages is not None:
            u = u + self.messages(messages.to(u.dtype))
        x = u.view(N, n * k, -1)  # (N, n*k, d): every candidate of the block is one token
        if anchor is not None:
            x = torch.cat([(anchor + self.anchor_pos)[:, None].to(x.dtype), x], dim=1)
        wanted = n if positions is None else min(n, positions)
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            x = layer(x, keep=wanted * k + (anchor is not None) if last and wanted < n else None)
        if not self.layers:
            x = x[:, : wanted * k + (anchor is not None)]
        x = self.norm(x)
        g_anchor, x = (x[:, 0], x[:, 1:]) if anchor is not None else (None, x)
        g = x.reshape(N, wanted, k, -1)  # (N, wanted, k, d)
        return g, self.support_head(g).squeeze(-1), g_anchor


class CausalSelector(nn.Module):
    """Prefix state r_i over the selected tokens ŷ_0..ŷ_{i-1}, and scores σ_{i,j} (see the module docstring)."""

    def __init__(self, cfg: RelayConfig):
        super().__init__()
        d = cfg.reader_dim
        self.embed_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.tokens = (TokenTable(cfg.vocab_size, cfg.token_rank, d, cfg.table_rows)  # T_in
                       if cfg.token_rank else None)
        self.no_feature = nn.Parameter(torch.randn(d) * 0.02)  # the anchor, or a true token outside the pool
        self.kind = cfg.prefix_model
        self.prefix = (nn.GRU(d, d, batch_first=True) if self.kind == "gru"
                       else EncoderLayer(d, cfg.reader_heads, cfg.dropout))
        self.prefix_norm = nn.LayerNorm(d)
        self.score_mlp = nn.Sequential(nn.Linear(2 * d, d), nn.GELU(), nn.Linear(d, 1))
        self.residual = cfg.residual
        self.bilinear_rank = cfg.bilinear_rank
        self.calibrate = cfg.calibrate
        if self.calibrate:  # σ's s term: a_i·s_{i,j} + b_i·[j = 1], per position (a = 1, b = 0: the plain s)
            self.scale = nn.Parameter(torch.ones(cfg.block_size - 1))
            self.native_bias = nn.Parameter(torch.zeros(cfg.block_size - 1))
        if self.bilinear_rank:
            self.cand_proj = nn.Linear(d, cfg.bilinear_rank, bias=False)
            self.prefix_proj = nn.Linear(d, cfg.bilinear_rank, bias=False)
        if self.residual:  # an untrained selector scores exactly the drafter's log-probs
            nn.init.zeros_(self.score_mlp[-1].weight)
            nn.init.zeros_(self.score_mlp[-1].bias)
            if self.bilinear_rank:
                nn.init.zeros_(self.prefix_proj.weight)

    def token_input(self, embeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """proj(E(ŷ)) [+ T_in[ŷ]] for tokens `ids` (...) with frozen embeddings (..., H) -> (..., d)."""
        x = self.embed_proj(embeds)
        return x if self.tokens is None else x + self.tokens(ids)

    def token_sources(self) -> list[torch.Tensor]:
        """The weights `token_input` reads besides the embedding (attribute reads: on the select path)."""
        return [self.embed_proj.weight, *(self.tokens.sources() if self.tokens is not None else [])]

    def prefix_inputs(self, token_inputs, feature=None, has_feature=None) -> torch.Tensor:
        """Tokens with `token_input` (N, t, d), the chosen candidates' g (N, t, d) where has_feature (N, t)
        -> (N, t, d). feature without has_feature: every position has one."""
        if feature is None:
            feat = self.no_feature
        else:
            feat = feature if has_feature is None else torch.where(has_feature[..., None], feature, self.no_feature)
        return token_inputs + feat

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

    def native_term(self, scores: torch.Tensor) -> torch.Tensor | None:
        """σ's term in the drafter's own scores s (N, t, k) of positions 0..t-1: s, or a_i·s + b_i·[j = 1]
        in float32 (calibrate); None when σ is not residual."""
        if not self.residual:
            return None
        s = scores.clamp(min=MIN_LOGPROB)
        if not self.calibrate:
            return s
        s, t = wide(s), s.shape[1]
        native = torch.zeros(s.shape[-1], device=s.device, dtype=s.dtype)
        native[0] = 1.0
        return s * self.scale[:t, None].to(s.dtype) + self.native_bias[:t, None].to(s.dtype) * native

    def candidate_terms(self, g: torch.Tensor, scores: torch.Tensor) -> tuple:
        """The parts of σ that depend on the candidates alone, computed once per block: the MLP's first
        layer on g (N, t, k, d), the bilinear candidate factor (N, t, k, R) and `native_term`."""
        d = g.shape[-1]
        first = self.score_mlp[0]
        a = F.linear(g, first.weight[:, :d], first.bias)
        c = self.cand_proj(g) if self.bilinear_rank else None
        native = self.native_term(scores)
        return a, c, native if native is None or self.calibrate else native.to(a.dtype)

    def score_terms(self, terms: tuple, r: torch.Tensor, lattice: torch.Tensor | None = None) -> torch.Tensor:
        """σ (N, t, k) from `candidate_terms`, the prefix states r (N, t, d) and the lattice term (N, t, k):
        the MLP on [g; r] is its first layer split into a g part (precomputed) and an r part, so the
        sequential loop only pays for r. Summed in float32 when calibrated."""
        a, c, native = terms
        first, d = self.score_mlp[0], r.shape[-1]
        h = a + F.linear(r, first.weight[:, d:])[:, :, None]  # (N, t, k, d)
        sigma = self.score_mlp[2](self.score_mlp[1](h)).squeeze(-1)
        if self.calibrate:
            sigma = wide(sigma)
        if self.bilinear_rank:
            sigma = sigma + (c * self.prefix_proj(r)[:, :, None]).sum(-1).to(sigma.dtype) / self.bilinear_rank ** 0.5
        if native is not None:
            sigma = sigma + native
        if lattice is not None:
            sigma = sigma + lattice.to(sigma.dtype)
        return sigma

    def forward(self, g: torch.Tensor, inputs: torch.Tensor, scores: torch.Tensor,
                lattice: torch.Tensor | None = None) -> torch.Tensor:
        """Parallel (teacher-forced): g (N, n, k, d), inputs of ŷ_0..ŷ_{n-1} (N, n, d), the drafter's scores
        (N, n, k), the lattice term of the true predecessors (N, n, k) | None -> σ (N, n, k)."""
        return self.score_terms(self.candidate_terms(g, scores), self.prefix_states(inputs)[0], lattice)


class DRelay(EmbeddingBoundFolder, RepairMethod):
    """Reader + selector (+ lattice). `score`: teacher-forced training pass; `select`: the repair hook."""

    config_cls, folder_error = RelayConfig, RelayError
    name, folder_name = "drelay", "relay"
    needs_logits = False  # the engine's repair hook reads only the pool (fused lm_head_topk: no logits)

    def __init__(self, cfg: RelayConfig):
        super().__init__()
        self.config = cfg
        self.reader = GlobalReader(cfg)
        self.selector = CausalSelector(cfg)
        self.lattice = (Lattice(cfg.vocab_size, cfg.hidden_size, cfg.lattice_rank, cfg.lattice_bigram,
                                cfg.table_rows) if cfg.lattice_rank else None)
        self.shared: SharedEmbedding | None = None
        self._token_tables: dict[str, Derived] = {}  # `token_inputs`' tables, by part
        self.ops: Ops = REFERENCE
        self.settings: DRelaySettings | None = None  # the joint objective's settings (set by `create`)

    @classmethod
    def for_drafter(cls, drafter: BlockDrafter, **kwargs) -> "DRelay":
        """A fresh relay sized for `drafter`, on its device and dtype, bound to its embedding. With a draft
        vocabulary of N ids its token tables and lattice get N + 1 rows, not V (TableRows)."""
        embed, vocab_ids = drafter.shared.embed_tokens, drafter.vocab_ids
        if vocab_ids is not None:
            kwargs = {"table_rows": vocab_ids.numel() + 1, **kwargs}
        cfg = RelayConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.config.block_size,
                          vocab_size=embed.weight.shape[0], **kwargs)
        w = drafter.fc.weight
        relay = cls(cfg).to(device=w.device, dtype=w.dtype).attach(embed)
        if cfg.table_rows:
            for index in (m for m in relay.modules() if isinstance(m, TableRows)):
                index.set_vocabulary(vocab_ids)
        return relay

    @classmethod
    def _create(cls, drafter: BlockDrafter, settings: DRelaySettings, pool_size: int) -> "DRelay":
        relay = cls.for_drafter(drafter, reader_dim=settings.reader_dim, reader_layers=settings.reader_layers,
                                reader_heads=settings.reader_heads, pool_size=pool_size,
                                prefix_model=settings.prefix_model, residual=settings.residual_score,
                                bilinear_rank=settings.bilinear_rank, token_rank=settings.token_rank,
                                lattice_rank=settings.lattice_rank, lattice_messages=settings.lattice_messages,
                                lattice_bigram=settings.lattice_bigram, lattice_pool=settings.lattice_pool,
                                lattice_pool_first=settings.lattice_pool_first, anchor_token=settings.anchor_token,
                                calibrate=settings.calibrate,
                                beam_width=settings.beam_width)
        relay.settings = settings
        return relay

    def attach(self, embed_tokens: nn.Module) -> "DRelay":
        width = embed_tokens.weight.shape[-1]
        if width != self.config.hidden_size:
            raise RelayError(f"embedding width {width} != relay hidden_size {self.config.hidden_size}")
        rows = embed_tokens.weight.shape[0]
        if self.config.vocab_size and rows != self.config.vocab_size:
            raise RelayError(f"embedding of {rows} tokens != relay vocab_size {self.config.vocab_size}")
        self.shared = SharedEmbedding(embed_tokens)
        self.ops = kernel_ops(embed_tokens.weight.device)  # relay_select / support_loss, chosen once
        return self

    @classmethod
    def folder_what(cls) -> str:
        return "relay"

    @property
    def needs_logits(self) -> bool:
        """A lattice pool is drawn from the whole vocabulary: the engine must hand over the logits."""
        return self.config.lattice_pool or self.config.lattice_pool_first

    @property
    def narrow_logits(self) -> bool:
        """A lattice pool also takes the logits over the draft vocabulary only (block.logit_ids): every other
        id's logit is OUT_OF_VOCAB, never in a top-k, so the pool is the same at a fraction of the cost."""
        return self.config.lattice_pool or self.config.lattice_pool_first

    def lattice_pool(self, logits: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                     prefix_ids: torch.Tensor | None = None,
                     ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool of config.lattice_pool: logits (N, n, C), hidden (N, n, H), anchor_ids (N,) -> pool_ids,
        pool_logprobs (N, n, k). Candidates are the top-k of z_i + L_i(p, ·) over the vocabulary (the bigram
        the lattice CE trains reaches tokens outside z_i's own top-k), sorted by it, so column 0 is the
        lattice's native; their s is still log_softmax(z_i) (σ adds the lattice term after the selected
        predecessor itself). p = y_{i-1} teacher-forced (prefix_ids (N, n), training), else the previous
        position's lattice native (inference: the pool is fixed before the selector walks). ids (C,): the
        token id of each column of `logits` (a draft vocabulary's; None: column j is token j)."""
        N, n, _ = logits.shape
        k, dtype = self.config.pool_size, self.reader.A.weight.dtype
        logprobs = torch.log_softmax(wide(logits), dim=-1)
        hidden = hidden.to(dtype)
        if prefix_ids is not None:
            prev = torch.cat([anchor_ids.reshape(N, 1), prefix_ids[:, : n - 1].clamp(min=0)], dim=1)
            cols = (logprobs + self.lattice.vocabulary(prev, hidden, ids)).topk(k, dim=-1).indices
        else:
            columns, prev = [], anchor_ids.reshape(N)
            for i in range(n):
                corrected = logprobs[:, i] + self.lattice.vocabulary(prev[:, None], hidden[:, i: i + 1], ids)[:, 0]
                columns.append(corrected.topk(k, dim=-1).indices)  # (N, k) column indices
                prev = columns[-1][:, 0] if ids is None else ids[columns[-1][:, 0]]
            cols = torch.stack(columns, dim=1)
        return (cols if ids is None else ids[cols]), logprobs.gather(-1, cols)

    @torch.no_grad()
    def with_first_lattice_pool(self, logits, hidden, anchor_ids, pool_ids, pool_logprobs, ids=None):
        """config.lattice_pool_first: the pool (..., n, k) with position 1's candidates replaced by the top-k of
        z_1 + L_1(anchor, ·) over the vocabulary (`lattice_pool` of that one position; its predecessor is the
        anchor, so training and inference see the same pool there). logits (..., n, C), hidden (..., n, H),
        anchor_ids (...); ids (C,): each logit column's token id (None: column j is token j)."""
        lead, n, k = pool_ids.shape[:-2], pool_ids.shape[-2], pool_ids.shape[-1]
        first_ids, first_lp = self.lattice_pool(logits[..., :1, :].reshape(-1, 1, logits.shape[-1]),
                                                hidden[..., :1, :].reshape(-1, 1, hidden.shape[-1]),
                                                anchor_ids.reshape(-1), ids=ids)
        pool_ids = torch.cat([first_ids.view(*lead, 1, k), pool_ids[..., 1:, :]], dim=-2)
        pool_logprobs = torch.cat([first_lp.view(*lead, 1, k).to(pool_logprobs.dtype), pool_logprobs[..., 1:, :]], dim=-2)
        return pool_ids, pool_logprobs

    # ------------------------------------------------------------------ the repair-method interface
    def joint_loss(self, drafter, hidden, labels, anchor_ids, *, gamma, progress):
        """L = w_ce·CE + λ_s·(hinge + reader BCE) + λ_r·ω-weighted repair CE (`drelay_loss_from_terms`): the
        pool from the detached logits, σ teacher-forced on the labels. The fused ops compute CE, hinge and
        pool without the logits. Co-adaptation (settings.coadapt): s inside σ keeps its gradient; the
        log-softmax normaliser is the same for every candidate of a position, so s_{i,j} = z_{i,j} - lse_i
        with lse_i detached has the exact gradient of every pool softmax and margin σ enters."""
        cfg = self.settings
        if cfg is None:
            raise RelayError("this relay has no training settings: make it with DRelay.create(drafter, settings, ...)")
        k = self.config.pool_size
        hinge_gamma = gamma if cfg.hinge_position_weighted else None
        # Everything over the columns the drafter scores: the draft vocabulary's rows when it has one (every
        # other id's logit is OUT_OF_VOCAB: exp() = 0, never in a top-k, so CE, hinge and pool are the V-wide
        # ones; labels outside it are IGNORE in training batches), else all V. `columns` maps a column to its id.
        weight, columns = drafter.head_weight(), drafter.vocab_ids
        normed = drafter.norm(hidden).to(weight.dtype)
        draft_labels = drafter.draft_positions(labels, IGNORE)  # (..., n) column indices
        logits = None  # (..., n, C)
        if self.ops.fused:  # CE, hinge and pool without the logits
            ce, hinge, pool_cols, pool_logprobs = self.ops.support_loss(normed, weight, draft_labels, k, gamma,
                                                                        cfg.hinge_margin, hinge_gamma)
        else:
            logits = F.linear(normed, weight)
            ce, _ = dflash_ce(logits, draft_labels, gamma)
            hinge = support_hinge(logits, draft_labels, k, cfg.hinge_margin, hinge_gamma)
            pool_cols, pool_logprobs = candidate_pool(logits.detach(), k)  # (..., n, k)
        pool_ids = pool_cols if columns is None else columns[pool_cols]
        if logits is None and (self.needs_logits or (cfg.lattice_ce and self.lattice is not None)):
            with torch.set_grad_enabled(cfg.lattice_coadapt and torch.is_grad_enabled()):  # the fused op never
                logits = F.linear(normed, weight)  # made the logits: the lattice's terms need them
        if self.config.lattice_pool:  # teacher-forced: the pool after the true predecessor, over the drafter's columns
            n, lead = labels.shape[-1], labels.shape[:-1]
            with torch.no_grad():
                pool_ids, pool_logprobs = self.lattice_pool(logits.detach().reshape(-1, n, logits.shape[-1]),
                                                            hidden.detach().reshape(-1, n, hidden.shape[-1]),
                                                            anchor_ids.reshape(-1), labels.reshape(-1, n), columns)
            pool_ids, pool_logprobs = pool_ids.view(*lead, n, k), pool_logprobs.view(*lead, n, k)
            pool_cols = drafter.draft_positions(pool_ids, IGNORE).clamp(min=0)
        elif self.config.lattice_pool_first:  # position 1's pool after the anchor: the same in training and inference
            pool_ids, pool_logprobs = self.with_first_lattice_pool(logits.detach(), hidden.detach(), anchor_ids,
                                                                   pool_ids, pool_logprobs, columns)
            pool_cols = drafter.draft_positions(pool_ids, IGNORE).clamp(min=0)
        z_pool = None
        if cfg.coadapt:
            z_pool = ((normed[..., None, :] * drafter.shared.lm_head.weight[pool_ids]).sum(-1) if self.ops.fused
                      else logits.gather(-1, pool_cols))
        scores = pool_logprobs if z_pool is None else pool_logprobs + wide(z_pool - z_pool.detach())
        sigma, support = self.score(hidden, pool_ids, pool_logprobs, anchor_ids, labels, scores=scores)
        loss, terms = drelay_loss_from_terms(ce, hinge, labels, sigma, support, pool_ids,
                                             lambda_support=cfg.lambda_support, lambda_repair=cfg.lambda_repair,
                                             eps=cfg.eps, ce_weight=1.0 + (cfg.ce_weight_final - 1.0) * progress,
                                             repair_weight=cfg.repair_weight, omega=cfg.omega,
                                             positions=cfg.repair_positions)
        if cfg.lattice_ce and self.lattice is not None:
            lattice_ce = self.lattice_ce(hidden, logits if cfg.lattice_coadapt else logits.detach(), labels,
                                         anchor_ids, gamma, drafter)
            loss = loss + cfg.lattice_ce * lattice_ce
            terms = {**terms, "loss": loss.detach(), "lattice_ce": lattice_ce.detach()}
        return loss, terms

    def lattice_ce(self, hidden, logits, labels, anchor_ids, gamma: float,
                   drafter: BlockDrafter | None = None) -> torch.Tensor:
        """The lattice's vocabulary-wide CE: softmax over all V of z_i (detached unless settings.lattice_coadapt:
        then the backbone learns the bigram's residual, as DSpark's does) + L_i(y_{i-1}, ·) against y_i,
        position-weighted like the DFlash CE. Teacher-forced on the true predecessors (y_0 = the anchor).
        It trains every row of P and S (the pool-only σ reaches just the rows of pool tokens), so the lattice
        learns the drafter's residual bigram as DSpark's head does; σ then reads it over the pool.
        hidden (..., n, H), logits (..., n, V) or, with a draft vocabulary, over its N ids only (..., n, N),
        labels (..., n), anchor_ids (...). With a draft vocabulary (`drafter.vocab_ids`) the softmax runs over
        its ids only: every other id has z = OUT_OF_VOCAB, so it adds exp(-1e9) = 0 to the normaliser and gets
        no gradient, and the loss is the same at a fraction of the cost (labels outside it are IGNORE in
        training batches)."""
        n = labels.shape[-1]
        labels = labels.reshape(-1, n)
        prev = torch.cat([anchor_ids.reshape(-1, 1), labels[:, : n - 1].clamp(min=0)], dim=1)
        vocab_ids = None if drafter is None else drafter.vocab_ids
        bigram = self.lattice.vocabulary(prev, hidden.reshape(-1, n, hidden.shape[-1]).to(self.reader.A.weight.dtype),
                                         vocab_ids)
        if vocab_ids is not None:  # narrowed before the upcast: only the draft vocabulary's columns are widened
            if logits.shape[-1] != vocab_ids.numel():
                logits = logits.index_select(-1, vocab_ids)
            labels = drafter.draft_positions(labels, IGNORE)
        return dflash_ce(wide(logits).reshape(bigram.shape) + bigram, labels, gamma)[0]

    def tune(self, score: Score) -> dict[float, float]:
        """δ with the highest held-out replay τ among settings.repair_margins (ties: the δ closest to 0,
        then the larger: the fewest replacements)."""
        margins = self.settings.repair_margins if self.settings else (self.config.repair_margin,)
        taus = {float(m): score(lambda block, m=float(m): self.select(block, repair_margin=m)) for m in sorted(margins)}
        self.config = dataclasses.replace(self.config,
                                          repair_margin=max(taus, key=lambda m: (taus[m], -abs(m), m)))
        return taus

    def method_state(self) -> dict:
        return {"repair_margin": self.config.repair_margin}

    def load_method_state(self, state: dict) -> None:
        self.config = dataclasses.replace(self.config, repair_margin=state["repair_margin"])

    def eval_metrics(self) -> dict[str, float]:
        return {"repair_margin": self.config.repair_margin}

    @torch.no_grad()
    def prepare_inference(self) -> None:
        """The reader's and the prefix's token tables and the lattice's float16 S (`token_inputs`,
        `Lattice.vocabulary`), built before a timed decode (each takes ~0.1-0.3 s on 2 CPU cores)."""
        if self.shared is None:
            return
        ids = torch.zeros(1, dtype=torch.long, device=self.shared.embed_tokens.weight.device)
        self.token_inputs(self.reader, ids)
        self.token_inputs(self.selector, ids)
        if self.lattice is not None and self.needs_logits:
            self.lattice.half_successor()

    # ------------------------------------------------------------------------------ computation
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            raise RelayError("relay has no embedding: call relay.attach(target.embed_tokens) first")
        return self.shared.embed_tokens(ids).to(self.reader.A.weight.dtype)

    def token_inputs(self, part: GlobalReader | CausalSelector, ids: torch.Tensor) -> torch.Tensor:
        """`part.token_input` of tokens `ids` (...) -> (..., d): the reader's A·E(c) [+ T_c[c]] or the prefix's
        proj(E(ŷ)) [+ T_in[ŷ]]. Grad-free calls read it from a table over the whole vocabulary (V x d), built
        once and kept while the embedding and the part's weights are unchanged: one gather instead of an
        embedding lookup, a product and a token-table lookup per call (the same values up to float rounding)."""
        if torch.is_grad_enabled() or self.shared is None:  # (embed names a missing embedding)
            return part.token_input(self.embed(ids), ids)
        weight = self.shared.embed_tokens.weight
        cache = self._token_tables.setdefault("reader" if part is self.reader else "selector", Derived())
        table = cache.get([weight, *part.token_sources()], lambda: torch.cat(
            [part.token_input(self.embed(v), v) for v in torch.arange(weight.shape[0], device=ids.device).split(8192)]))
        return F.embedding(ids, table)  # a row gather (faster on CPU than table[ids])

    def read(self, hidden, pool_ids, pool_logprobs, anchor_ids, need_table: bool = True, positions: int | None = None):
        """hidden (N, n, H), pool (N, n, k), anchor_ids (N,) -> g (N, n, k, d), support logits (N, n, k), the
        anchor's reader feature (N, d) | None and the lattice table over the pools (N, n, k, k) | None
        (computed when there is a lattice and the messages or `need_table` ask for it). positions: g and support
        of the first `positions` positions only (the reader still reads them all; see GlobalReader)."""
        n, k = pool_ids.shape[-2:]
        if n > self.config.block_size - 1 or k > self.config.pool_size:
            raise RelayError(f"block of {n} positions x {k} candidates exceeds the relay's "
                             f"{self.config.block_size - 1} x {self.config.pool_size}")
        dtype = self.reader.A.weight.dtype
        hidden = hidden.to(dtype)
        table = None
        if self.lattice is not None and (need_table or self.reader.messages is not None):
            table = self.lattice.table(anchor_ids, pool_ids, hidden)
        messages = None
        if self.reader.messages is not None:
            messages = lattice_messages(wide(pool_logprobs.detach()).clamp(min=MIN_LOGPROB), table)
        anchor = None
        if self.reader.anchor_pos is not None:
            anchor = self.token_inputs(self.reader, anchor_ids)
        g, support, g_anchor = self.reader(self.token_inputs(self.reader, pool_ids), hidden, pool_logprobs.to(dtype),
                                           messages, anchor, positions)
        return g, support, g_anchor, table

    def anchor_input(self, anchor_ids: torch.Tensor, g_anchor: torch.Tensor | None) -> torch.Tensor:
        """The prefix input of ŷ_0 = the anchor (N, 1, d): its reader feature when it is a reader token."""
        ids = anchor_ids.reshape(-1, 1)
        feature = None if g_anchor is None else g_anchor[:, None]
        return self.selector.prefix_inputs(self.token_inputs(self.selector, ids), feature)

    def _inputs(self, g, pool_ids, tokens):
        """Prefix inputs of tokens (N, t) sitting at the positions of g (N, t, k, d), pool_ids (N, t, k)."""
        tokens = torch.where(tokens < 0, pool_ids[..., 0], tokens)  # padding (IGNORE): any valid id
        match = pool_ids == tokens[..., None]  # (N, t, k)
        j = match.long().argmax(-1)  # (N, t): which candidate (0 when not in the pool)
        chosen = g.gather(2, j[..., None, None].expand(-1, -1, 1, g.shape[-1])).squeeze(2)  # (N, t, d)
        return self.selector.prefix_inputs(self.token_inputs(self.selector, tokens), chosen, match.any(-1))

    def score(self, hidden, pool_ids, pool_logprobs, anchor_ids, prefix_ids, scores=None):
        """Teacher-forced σ and support logits (..., n, k), all positions in parallel.

        hidden (..., n, H); pool_ids, pool_logprobs (..., n, k); anchor_ids (...); prefix_ids (..., n):
        the true tokens y_1..y_n (only y_1..y_{n-1} feed the prefix; negative ids are padding); scores
        (..., n, k): the drafter's s inside σ (default pool_logprobs; with gradient for co-adaptation).
        Conditioning on the true prefix is exact: position i only matters when all before it were right.
        """
        lead, (n, k) = pool_ids.shape[:-2], pool_ids.shape[-2:]
        pool_ids = pool_ids.reshape(-1, n, k)  # (N, n, k)
        anchor_ids = anchor_ids.reshape(-1)
        hidden = hidden.reshape(-1, n, hidden.shape[-1])
        g, support, g_anchor, _ = self.read(hidden, pool_ids, pool_logprobs.reshape(-1, n, k), anchor_ids,
                                            need_table=False)
        prev = prefix_ids.reshape(-1, n)[:, : n - 1]  # (N, n-1): y_1..y_{n-1}
        inputs = torch.cat([self.anchor_input(anchor_ids, g_anchor), self._inputs(g[:, : n - 1], pool_ids[:, : n - 1], prev)],
                           dim=1)  # (N, n, d)
        lattice = None
        if self.lattice is not None:
            true_prev = torch.cat([anchor_ids[:, None], prev.clamp(min=0)], dim=1)  # (N, n): y_0..y_{n-1}
            lattice = self.lattice.forced(true_prev, hidden.to(self.reader.A.weight.dtype), pool_ids)
        scores = pool_logprobs if scores is None else scores
        sigma = self.selector(g, inputs, scores.reshape(-1, n, k), lattice)
        return sigma.view(*lead, n, k), support.view(*lead, n, k)

    @torch.no_grad()
    def select(self, block: DraftBlock, return_scores: bool = False, prefix_ids: torch.Tensor | None = None,
               repair_margin: float | None = None):
        """Repair one block left to right: tokens (b, n) [, σ (b, n, k)].

        Keeps the native c_{i,1} unless max_{j>1} σ_{i,j} - σ_{i,1} > δ (`repair_margin`, default the config's);
        with config.beam_width > 1, the beam's best path instead (see `_beam_select`).
        prefix_ids (b, n), for tests and analysis: feed these tokens to the prefix state instead of the choices.
        """
        if repair_margin is None:
            repair_margin = self.config.repair_margin
        if self.config.lattice_pool:
            if block.logits is None:
                raise RelayError("a lattice-pool relay needs the block's logits (the engine gives them: needs_logits)")
            pool_ids, pool_logprobs = self.lattice_pool(block.logits, block.hidden, block.anchor_ids,
                                                        ids=block.logit_ids)
        elif self.config.lattice_pool_first:
            if block.logits is None:
                raise RelayError("a lattice-pool relay needs the block's logits (the engine gives them: needs_logits)")
            pool_ids, pool_logprobs = self.with_first_lattice_pool(block.logits, block.hidden, block.anchor_ids,
                                                                   block.pool_ids, block.pool_logprobs, block.logit_ids)
        else:
            pool_ids, pool_logprobs = block.pool_ids, block.pool_logprobs
        # the walk stops at the last draft the target checks (block.checked): the walk is causal, so its choices
        # there are the whole walk's; the reader still reads the whole block, and later drafts stay native
        n = pool_ids.shape[1]
        walk = n if return_scores or prefix_ids is not None or self.config.beam_width > 1 else block.walk_length()
        g, _, g_anchor, table = self.read(block.hidden, pool_ids, pool_logprobs, block.anchor_ids, positions=walk)
        full_pool, pool_ids, pool_logprobs = pool_ids, pool_ids[:, :walk], pool_logprobs[:, :walk]
        table = None if table is None else table[:, :walk]
        sel = self.selector
        terms = sel.candidate_terms(g, pool_logprobs)  # the candidate-only parts of σ, once
        # the prefix input each candidate would feed if chosen (chosen tokens are always in the pool)
        chosen_inputs = sel.prefix_inputs(self.token_inputs(sel, pool_ids), g)
        anchor = self.anchor_input(block.anchor_ids, g_anchor)  # (b, 1, d)
        if self.config.beam_width > 1 and prefix_ids is None:
            choice, sigma = self._beam_select(terms, chosen_inputs, anchor, table, repair_margin)
        elif sel.kind == "gru" and prefix_ids is None:  # the whole loop in one op (one launch on CUDA)
            cand_hidden, cand_factor, native = terms
            start, gates, weights = sel.gru_input_gates(anchor[:, 0]), sel.gru_input_gates(chosen_inputs), sel.gru_weights()
            if sel.calibrate:  # σ in (at least) float32: the selector's small tensors upcast for the walk
                start, gates, cand_hidden = wide(start), wide(gates), wide(cand_hidden)
                cand_factor = None if cand_factor is None else wide(cand_factor)
                weights = weights.to(cand_hidden.dtype)
                native = None if native is None else native.to(cand_hidden.dtype)
            if table is not None:
                table = table.to(cand_hidden.dtype)
            choice, sigma = self.ops.relay_select(start, gates, cand_hidden, weights, cand_factor, native,
                                                  repair_margin, table)
        else:
            if prefix_ids is not None and self.lattice is not None:  # the lattice after the given tokens
                true_prev = torch.cat([block.anchor_ids[:, None], prefix_ids[:, :-1].clamp(min=0)], dim=1)
                table = self.lattice.forced(true_prev, block.hidden.to(g.dtype), pool_ids)[:, :, None]
            choice, sigma = self._select_loop(g, terms, chosen_inputs, anchor, table, pool_ids, prefix_ids,
                                              repair_margin)
        tokens = pool_ids.gather(-1, choice[..., None]).squeeze(-1)  # (b, walk)
        tokens = torch.cat([tokens, full_pool[:, walk:, 0]], dim=1)  # (b, n): the unchecked drafts native
        return (tokens, sigma) if return_scores else tokens

    @staticmethod
    def _lattice_row(table: torch.Tensor | None, i: int, prev: torch.Tensor) -> torch.Tensor | None:
        """The lattice term (b, 1, k) at position i after pool index `prev` (b,) at i-1 (any at i = 0)."""
        if table is None:
            return None
        return table[:, i].gather(1, prev[:, None, None].expand(-1, 1, table.shape[-1]))

    def _select_loop(self, g, terms, chosen_inputs, x, table, pool_ids, prefix_ids, repair_margin):
        """`select` step by step through the prefix model's own forward (the attention prefix model, or a
        prefix fed `prefix_ids`): choice (b, n), σ (b, n, k). table: the lattice over the pools (b, n, k, k),
        or with `prefix_ids` the lattice after those tokens (b, n, 1, k)."""
        sel = self.selector
        n = pool_ids.shape[1]
        state, choices, scores = None, [], []
        prev = torch.zeros(pool_ids.shape[0], dtype=torch.long, device=pool_ids.device)
        for i in range(n):
            r, state = sel.prefix_states(x, state)  # (b, 1, d)
            part = tuple(t[:, i: i + 1] if t is not None else None for t in terms)
            sigma = sel.score_terms(part, r, self._lattice_row(table, i, prev))[:, 0]  # (b, k)
            j = keep_or_replace(sigma, repair_margin)
            choices.append(j)
            scores.append(sigma)
            if i < n - 1:
                if prefix_ids is None:  # the chosen candidate's input
                    x = chosen_inputs[:, i].gather(1, j[:, None, None].expand(-1, 1, chosen_inputs.shape[-1]))
                    prev = j
                else:  # the lattice term is already the given token's: row 0 of (b, n, 1, k)
                    x = self._inputs(g[:, i: i + 1], pool_ids[:, i: i + 1], prefix_ids[:, i: i + 1])
        return torch.stack(choices, dim=1), torch.stack(scores, dim=1)

    def _beam_select(self, terms, chosen_inputs, anchor, table, repair_margin):
        """A beam of config.beam_width paths over the block, kept by their expected accepted length so far
        Σ_{m<=i} Π_{l<=m} π_l, with π_i = softmax(σ_i + δ·[j = 1]) (the repair margin δ as the native's prior);
        the best path at the end. Width 1 is the greedy walk. Returns choice (b, n), σ (b, n, k) of that path."""
        sel, W = self.selector, self.config.beam_width
        b, n, k = chosen_inputs.shape[:3]
        rows = torch.arange(b, device=anchor.device)
        x = anchor.repeat_interleave(W, 0)  # (b*W, 1, d)
        state = None
        value = torch.full((b, W), float("-inf"), device=anchor.device)
        value[:, 0] = 0.0  # one live path at the start
        reach = torch.ones(b, W, device=anchor.device)  # Π π along each path
        paths = torch.zeros(b, W, 0, dtype=torch.long, device=anchor.device)
        sigmas = torch.zeros(b, W, 0, k, device=anchor.device)
        prev = torch.zeros(b * W, dtype=torch.long, device=anchor.device)
        native = torch.zeros(k, device=anchor.device)
        native[0] = repair_margin
        for i in range(n):
            r, state = sel.prefix_states(x, state)  # (b*W, 1, d)
            part = tuple(t[:, i: i + 1].repeat_interleave(W, 0) if t is not None else None for t in terms)
            rows_table = None if table is None else table.repeat_interleave(W, 0)
            sigma = wide(sel.score_terms(part, r, self._lattice_row(rows_table, i, prev))[:, 0])  # (b*W, k)
            pi = torch.softmax(sigma + native, -1).view(b, W, k)
            new_reach = reach[..., None] * pi  # (b, W, k)
            new_value = value[..., None] + new_reach  # -inf for dead paths
            flat = new_value.view(b, W * k)
            # ties: the lower flat index (earlier beam, then the native first)
            top = flat.topk(W, dim=-1, sorted=True)
            beam, j = top.indices // k, top.indices % k  # (b, W)
            value = top.values
            reach = new_reach.view(b, W * k).gather(1, top.indices)
            paths = torch.cat([paths.gather(1, beam[..., None].expand(-1, -1, paths.shape[-1])), j[..., None]], -1)
            sigma = sigma.view(b, W, k).gather(1, beam[..., None].expand(-1, -1, k))
            sigmas = torch.cat([sigmas.gather(1, beam[..., None, None].expand(-1, -1, i, k)), sigma[:, :, None]], 2)
            src = (rows[:, None] * W + beam).reshape(-1)  # (b*W,) the parent of each new path
            state = state[:, src] if sel.kind == "gru" else state[src]
            x = chosen_inputs[:, i].repeat_interleave(W, 0).gather(
                1, j.reshape(-1)[:, None, None].expand(-1, 1, chosen_inputs.shape[-1]))
            prev = j.reshape(-1)
        best = value.argmax(-1)  # (b,)
        return paths[rows, best], sigmas[rows, best]


class DRelayLite(DRelay):
    """drelay-lite: the paper-literal DRelay (its settings, DRelayLiteSettings, switch every v2 part off),
    kept as a method so every v2 addition is measured against it."""

    name = "drelay-lite"
