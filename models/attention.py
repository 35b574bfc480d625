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
from .layers import RMSNorm, RotaryEmbedding


class KVCache:
    """Per-layer key/value buffers [B, kv_heads, max_len, head_dim] for a batch of sequences.

    Each layer's buffers are allocated at its first write, shaped like the keys it receives: under
    tensor parallelism a rank holds only its own heads, and the attention module (not the caller)
    knows how many those are."""

    def __init__(self, num_layers: int, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.keys = [None] * num_layers
        self.values = [None] * num_layers
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device

    def _allocate(self, index: int, heads: int, head_dim: int) -> None:
        shape = (self.batch, heads, self.max_len, head_dim)
        self.keys[index] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values[index] = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def layer(self, index: int) -> "LayerKV":
        return LayerKV(self, index)


class LayerKV:
    """A view of one layer's slot in a KVCache."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k_bnsd: torch.Tensor, v_bnsd: torch.Tensor, positions_bs: torch.Tensor):
        """Write new keys/values at their positions; return the cache prefix covering them."""
        if self.cache.keys[self.index] is None:
            self.cache._allocate(self.index, k_bnsd.shape[1], k_bnsd.shape[-1])
        keys, values = self.cache.keys[self.index], self.cache.values[self.index]
        span = int(positions_bs.max()) + 1
        if span > self.cache.max_len:
            raise RuntimeError(f"KV cache overflow: position {span - 1} >= max_len {self.cache.max_len}")
        idx = positions_bs[:, None, :, None].expand(-1, k_bnsd.shape[1], -1, k_bnsd.shape[-1])
        keys.scatter_(2, idx, k_bnsd.to(keys.dtype))
        values.scatter_(2, idx, v_bnsd.to(values.dtype))
        return keys[:, :, :span], values[:, :, :span]


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
        self.rotary = RotaryEmbedding(self.head_dim, rotary_dim, cfg.rope_theta, cfg.max_seq_len)

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor,
                cache: Optional[LayerKV] = None) -> torch.Tensor:
        b, s, _ = x_bsh.shape
        # Head counts come from the projection widths so tensor parallelism (which shards the
        # projections' output features) needs no change here.
        q = self.q_proj(x_bsh).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_bsh).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_bsh).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions_bs), self.rotary(k, positions_bs)
        groups = q.shape[1] // k.shape[1]
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
        else:
            k_all, v_all = cache.update(k, v, positions_bs)
            key_pos = torch.arange(k_all.shape[2], device=x_bsh.device)
            mask = key_pos[None, None, None, :] <= positions_bs[:, None, :, None]
            out = F.scaled_dot_product_attention(q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=mask,
                                                 enable_gqa=groups > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
