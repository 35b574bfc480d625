"""QSA's indexer and what it selects: `QSAIndexer` (query heads and raw keys per token, block keys,
block scores), the selection a training forward hands between MTP depths (`QSASelection`), the block
layout of packed documents (`DocumentBlocks`) and the decode-time share of one depth's selection
with the depths that reuse it (`SelectionShare`). models/qsa.py's docstring states the semantics."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from .layers import RMSNorm, RotaryEmbedding


class QSASelection(NamedTuple):
    """The blocks each query selected: indices [B, S, k] and how many of the k slots are real [B,
    S].

    In training, MTP depth 1 returns its selection and depths 2..K receive it as an argument
    (`mtp.qsa_reuse_indices`): an explicit value, so a checkpointed depth recomputed in backward and
    a pipeline micro-batch both see the selection of their own forward, never one left in module
    state. With packed documents a block index means a row of `block_rows_bn` [B, S // r] (the row
    of each block's first token), carried along so a reusing depth reads the indices in the layout
    they were chosen in; None: block j starts at row j * r."""

    blocks_bsk: torch.Tensor
    counts_bs: torch.Tensor
    block_rows_bn: Optional[torch.Tensor] = None


class DocumentBlocks(NamedTuple):
    """A training window's QSA blocks under packed documents (see the module docstring). Padding
    blocks (a row with fewer than N = S // r complete blocks) have row S."""

    rows_bn: torch.Tensor
    """[B, N] row of each block's first token (S: padding)."""
    tokens_bm: torch.Tensor
    """[B, N * r] rows of each block's tokens in block order (clamped into the row for padding)."""
    positions_bn: torch.Tensor
    """[B, N] each block's start position within its document (j * r): its key's RoPE position."""
    key_block_bs: torch.Tensor
    """[B, S] the block holding each row's token (N: none, a document's incomplete end)."""
    first_bs: torch.Tensor
    """[B, S] row where each query's document starts."""
    at_bs: torch.Tensor
    """[B, S] each query's position within its document."""
    query_rows_s: Optional[torch.Tensor] = None
    """Context parallelism: the window row of each query (a rank's rows; `first_bs` and `at_bs` are
    then those queries', the other fields the whole window's). None: the queries are the window's
    rows."""

    @staticmethod
    def block_rows(starts_bs: torch.Tensor, r: int) -> torch.Tensor:
        """[B, S // r] rows of the complete blocks' first tokens, in row order, padded with S: a
        block starts where the position within the document is a multiple of r and the document
        still runs at row + r - 1 (blocks are disjoint r-row spans, so a row holds at most S //
        r)."""
        b, s = starts_bs.shape
        n = s // r
        row = torch.arange(s, device=starts_bs.device)
        last = (row + r - 1).clamp(max=s - 1)
        start = ((row - starts_bs) % r == 0) & (row + r - 1 < s) & (starts_bs[:, last] == starts_bs)
        # non-starts land in column n, dropped
        slot = torch.where(start, start.long().cumsum(1) - 1, n)
        rows = torch.full((b, n + 1), s, dtype=torch.long, device=starts_bs.device)
        return rows.scatter_(1, slot, row.expand(b, s))[:, :n]

    @classmethod
    def build(cls, starts_bs: torch.Tensor, rows_bn: torch.Tensor, r: int) -> "DocumentBlocks":
        b, s = starts_bs.shape
        n = rows_bn.shape[1]
        dev = starts_bs.device
        row = torch.arange(s, device=dev)
        real_bn = rows_bn < s
        tokens_bnr = rows_bn[..., None] + torch.arange(r, device=dev)
        at_bs = row - starts_bs
        positions_bn = at_bs.gather(1, rows_bn.clamp(max=s - 1))
        # each real block's tokens name it; every other token (and padding's) lands in column s,
        # dropped
        key_block = torch.full((b, s + 1), n, dtype=torch.long, device=dev)
        key_block.scatter_(1, torch.where(real_bn[..., None], tokens_bnr, s).flatten(1),
                           torch.arange(n, device=dev).repeat_interleave(r).expand(b, n * r))
        return cls(rows_bn, tokens_bnr.clamp(max=s - 1).flatten(1), positions_bn, key_block[:, :s],
                   starts_bs, at_bs)

    def query_rows(self) -> torch.Tensor:
        """[S_q] the window row of each query."""
        if self.query_rows_s is not None:
            return self.query_rows_s
        return torch.arange(self.first_bs.shape[1], device=self.first_bs.device)

    def visible(self, r: int, c0: int = 0, c1: Optional[int] = None, n0: int = 0,
                n1: Optional[int] = None) -> torch.Tensor:
        """[B, S, N] (queries c0..c1, blocks n0..n1 of it): the blocks a query may select, the
        complete ones of its document ending at or before it (a real block never straddles
        documents, so lying within [document start, query] is enough)."""
        query_t = self.query_rows()[c0:c1, None]
        rows = self.rows_bn[:, None, n0:n1]
        return (rows >= self.first_bs[:, c0:c1, None]) & (rows + r - 1 <= query_t)

    def reach(self, r: int) -> torch.Tensor:
        """[B, S_q] how many leading blocks may be visible to each query (rows_bn is ascending):
        every block it may select lies before this, so a streamed selection reads no further."""
        query_b = self.query_rows().expand(self.rows_bn.shape[0], -1).contiguous()
        return torch.searchsorted(self.rows_bn.contiguous(), query_b - (r - 1), right=True)


class SelectionShare:
    """Depth 1's QSA selection handed to the later MTP depths while decoding
    (`mtp.qsa_reuse_indices`, as the design documents and vLLM's `set_skip_topk` do): depth 1 runs
    the MTP layer's indexer and records the selected blocks of each query; depth k >= 2 attends over
    depth 1's selection at the same position (the query whose content lines up: depth k at position
    t drafts from depth 1's state at t), plus that source query's visible tail, without running the
    indexer. The selection is a position-indexed buffer shared by the depths' caches
    (`LayerCache.shared_buffer`), written only by depth 1 over committed inputs, so a reused
    selection is never one a query on a rejected branch chose. `read_offset` k-1 serves a decoder
    whose depth k runs k-1 positions after the content position (vLLM's convention). Training passes
    the selection explicitly instead (`QSASelection`)."""

    def __init__(self):
        self.mode: Optional[str] = None
        """`record` (depth 1), `reuse` (depths 2..K) or None (select as usual); decoding only."""
        self.read_offset = 0


class QSAIndexer(nn.Module):
    """Scores compressed key blocks for each query (transformers' `Qwen4ExpTextQSAIndexer`)."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.head_dim = head_dim
        # I query heads then one key head, as in the checkpoint
        self.index_qk_proj = nn.Linear(hidden_size, (heads + 1) * head_dim, bias=False)
        self.q_layernorm = RMSNorm(head_dim, eps, zero_centered=True)
        self.k_layernorm = RMSNorm(head_dim, eps, zero_centered=True)

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, rotary: RotaryEmbedding):
        """Normalised, roped queries [B, S, I, D_i] and raw (un-normalised) keys [B, S, D_i]."""
        b, s, _ = x_bsh.shape
        qk = self.index_qk_proj(x_bsh).view(b, s, -1, self.head_dim)
        q_bisd = rotary(self.q_layernorm(qk[:, :, :-1]).transpose(1, 2), positions_bs)
        return q_bisd.transpose(1, 2), qk[:, :, -1]

    def block_keys(self, raw_bsd: torch.Tensor, starts_bn: torch.Tensor, rotary: RotaryEmbedding):
        """Keys of the blocks of `raw_bsd` (which covers whole blocks) [B, N, D_i], roped at
        `starts_bn`."""
        b, n = starts_bn.shape
        pooled = raw_bsd.reshape(b, n, -1, self.head_dim).float().mean(2).to(raw_bsd.dtype)
        return rotary(self.k_layernorm(pooled).unsqueeze(1), starts_bn).squeeze(1)

    def block_scores(self, q_bsid: torch.Tensor, k_bnd: torch.Tensor) -> torch.Tensor:
        """sum_h relu(q_h . k_j) / sqrt(D_i), fp32 [B, S, N]."""
        b, s, i, d = q_bsid.shape
        # fp32 as in the reference, even under autocast
        with torch.autocast(q_bsid.device.type, enabled=False):
            dots = torch.matmul(q_bsid.float().reshape(b, s * i, d), k_bnd.float().transpose(1, 2))
        return dots.view(b, s, i, -1).relu().sum(2) / math.sqrt(d)
