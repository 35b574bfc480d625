"""Causal GQA attention (SDPA) with an optional KV cache for decoding.

Training calls it without a cache (plain causal attention). Decoding passes a `KVCache` layer slot
and explicit per-token positions: new keys/values are written at their absolute positions and each
query attends to cache rows at positions <= its own. Rolling back to an accepted prefix is then just
lowering the sequence's length in the cache owner: rows beyond it are rewritten before any query can
read them, because every forward covers a contiguous range starting right after the valid prefix.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import WholeWindow
from .documents import Documents
from .layers import InitRule, InitScales, RMSNorm, RotaryEmbedding, cached_attention
from .state import KVCache, LayerKV  # noqa: F401  (re-exported: callers import the cache from here)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.resolved_head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        rotary_dim = int(self.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(self.head_dim, rotary_dim, cfg.rope_theta, cfg.max_seq_len,
                                      cfg.rope_rule)

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        return ("normal", scales.residual_std) if name == "o_proj.weight" else None

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor,
                cache: Optional[LayerKV] = None, documents: Optional[Documents] = None,
                context: Optional[WholeWindow] = None) -> torch.Tensor:
        """`documents` (packed training windows, data.document_mask): attention stays inside each
        document (block-diagonal causal); `positions_bs` then count from each document's start.
        `context` (training under context parallelism): the queries are this rank's rows of the
        window, the keys and values every row's, gathered (models/context.py)."""
        b, s, _ = x_bsh.shape
        # Head counts come from the projection widths so tensor parallelism (which shards the
        # projections' output features) needs no change here.
        q = self.q_proj(x_bsh).view(b, s, -1, self.head_dim)
        k = self.k_proj(x_bsh).view(b, s, -1, self.head_dim)
        v = self.v_proj(x_bsh).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # per head, on the projections' contiguous rows
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q.transpose(1, 2), positions_bs), self.rotary(k.transpose(1, 2),
                                                                         positions_bs)
        out = attend(q, k, v, positions_bs, cache, documents, context)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions_bs: torch.Tensor,
           cache: Optional[LayerKV] = None, documents: Optional[Documents] = None,
           context: Optional[WholeWindow] = None, scale: Optional[float] = None,
           fold_heads: bool = False) -> torch.Tensor:
    """Causal attention of queries [B, Hq, S, D] over keys [B, Hk, S, D] and values [B, Hk, S, Dv]
    (Hk dividing Hq), shared by GQA and MLA layers: inside each document when `documents` is given,
    over the whole window under context parallelism (`context`), or over a decoding cache's prefix
    with the new keys and values written into it (`cache`). `scale`: the softmax scale, None for
    1 / sqrt(D); `fold_heads`: `cached_attention`'s `fold`. Returns [B, Hq, S, Dv]."""
    groups = q.shape[1] // k.shape[1]
    if cache is None and context is not None and context.sharded:
        return _over_window(q, k, v, context, documents, groups, scale)
    if cache is None and documents is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.attention_mask(),
                                              scale=scale, enable_gqa=groups > 1)
    if cache is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=groups > 1)
    k_all, v_all = cache.update(k, v, positions_bs)
    key_pos = torch.arange(k_all.shape[2], device=q.device)
    mask = key_pos[None, None, :] <= positions_bs[..., None]
    return cached_attention(q, k_all, v_all, mask, scale, fold_heads)


def _over_window(q_bhsd, k_bhsd, v_bhsd, context: WholeWindow, documents: Optional[Documents],
                 groups: int, scale: Optional[float]):
    """This rank's queries over the whole window's keys and values (gathered in window order),
    masked by window row: causal, and inside the query's document when documents are kept apart.
    Chunk by chunk, each over the keys up to its own end only (zigzag's early chunk reads
    few)."""
    k_all, v_all = (context.gather(t.transpose(1, 2)).transpose(1, 2) for t in (k_bhsd, v_bhsd))
    local = q_bhsd.shape[2]
    rows = context.rows(local, q_bhsd.device)
    length = local // context.chunks
    out = []
    for j, end in enumerate(context.chunk_ends(local)):
        mine = slice(j * length, (j + 1) * length)
        key_u = torch.arange(end, device=q_bhsd.device)
        mask = (key_u[None, :] <= rows[mine, None])[None]
        if documents is not None:
            mask = mask & (key_u[None, None, :] >= documents.starts_bs[:, mine, None])
        out.append(F.scaled_dot_product_attention(q_bhsd[:, :, mine], k_all[:, :, :end],
                                                  v_all[:, :, :end],
                                                  attn_mask=mask[:, None], scale=scale,
                                                  enable_gqa=groups > 1))
    return torch.cat(out, dim=2)
