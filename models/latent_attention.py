"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2), laid out as transformers'
`DeepseekV3Attention` names it, so a checkpoint loads by name.

Per token, keys and values come from one compressed latent: kv_a_proj_with_mqa gives the latent
(kv_lora_rank channels, normalised by kv_a_layernorm) and one rotary key part (qk_rope_head_dim
channels) that every head shares; kv_b_proj expands the latent into each head's unrotated key
(qk_nope_head_dim) and value (v_head_dim). Queries are [unrotated | rotary] per head, from q_proj or
through the compressed q_a_proj -> q_a_layernorm -> q_b_proj. The softmax scale is
1 / sqrt(nope + rope), times YaRN's mscale^2 when the model stretches its context.

DeepSeek's checkpoints store the rotary channels interleaved (pairs (x0, x1), (x2, x3), ...); the
importer reorders those weight rows to [x0, x2, ... | x1, x3, ...] (trainer/hf/deepseek_v3.py),
where this project's half-split rotation computes the same dot products; the exporter puts them
back.

Attention itself is `attention.attend`, the GQA layer's: documents, context parallelism and the
decoding cache work unchanged. Decoding caches the latent, not each head's expanded key and value
(`_over_latents`: kv_b_proj absorbed into the query and the output).

Tensor parallelism (trainer/parallel/tensor_hybrid.py) shards q_proj / q_b_proj and kv_b_proj by
heads and o_proj by its input; the latent projections and their norms are replicated, so their
gradients are partial over tp; head counts here come from the projections' widths.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .attention import attend
from .config import ModelConfig
from .context import WholeWindow
from .documents import Documents
from .layers import InitRule, InitScales, RMSNorm, RotaryEmbedding
from .state import LayerKV

TP_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
"""The submodules every tensor-parallel rank holds whole (the latents' projections and norms),
their gradients partial over tp."""

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not the
config's rms_norm_eps."""


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                    cfg.v_head_dim)
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.compressed_queries = cfg.q_lora_rank > 0
        if self.compressed_queries:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (self.nope_dim + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)
        rule = cfg.rope_rule
        self.rotary = RotaryEmbedding(self.rope_dim, self.rope_dim, cfg.rope_theta,
                                      cfg.max_seq_len, rule)
        self.scale = qk_dim ** -0.5 * (rule.softmax_factor if rule else 1.0)

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        return ("normal", scales.residual_std) if name == "o_proj.weight" else None

    def queries(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """[B, S, heads x (nope + rope)]."""
        if self.compressed_queries:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_bsh)))
        return self.q_proj(x_bsh)

    def expansion_weight(self) -> torch.Tensor:
        """kv_b_proj's weight as this module computes with it ([heads x (nope + v), kv_lora_rank];
        the tensor-parallel module's: its local heads)."""
        return self.kv_b_proj.weight

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor,
                cache: Optional[LayerKV] = None, documents: Optional[Documents] = None,
                context: Optional[WholeWindow] = None) -> torch.Tensor:
        """As `attention.Attention.forward`; decoding (`cache`) attends over the cached latents
        (`_over_latents`)."""
        b, s, _ = x_bsh.shape
        q = self.queries(x_bsh).view(b, s, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x_bsh).split([self.kv_lora_rank, self.rope_dim],
                                                              dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = self.rotary(q_rope, positions_bs)
        k_rope = self.rotary(k_rope.unsqueeze(1), positions_bs)  # [B, 1, S, rope]: every head's
        if cache is not None:
            out = self._over_latents(q_nope, q_rope, latent.unsqueeze(1), k_rope, positions_bs,
                                     cache)
        else:
            kv = self.kv_b_proj(latent).view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rope.expand(-1, q.shape[1], -1, -1)], dim=-1)
            out = attend(torch.cat([q_nope, q_rope], dim=-1), k, v, positions_bs, None,
                         documents, context, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def _over_latents(self, q_nope, q_rope, latent_b1sc, k_rope_b1sr, positions_bs,
                      cache: LayerKV) -> torch.Tensor:
        """Decoding with kv_b_proj absorbed (DeepSeek-V2's inference form): head h's unrotated key
        is W_uk[h] c and its value W_uv[h] c for the token's latent c, so q . k = (W_uk[h]^T q) . c
        and the output W_uv[h] (attention-weighted sum of c). The cache then holds one key per
        token for all heads, [c | rotated k_rope] (kv_lora_rank + rope channels), and c again as
        the value (DeepSeek's own cache holds it once: 576), where the expanded form held heads x
        (nope + rope + v): 1,088 values per token and layer instead of 40,960 at DeepSeek-V3's
        shape. The same softmax, summed in another order."""
        w = self.expansion_weight()
        w = w.view(-1, self.nope_dim + self.v_dim, w.shape[-1])  # [heads, nope + v, latent]
        q_latent = torch.einsum("bhsn,hnc->bhsc", q_nope, w[:, :self.nope_dim].to(q_nope.dtype))
        # in the queries' dtype (the norm's fp32 weight under autocast would make the cache fp32)
        latent_b1sc = latent_b1sc.to(q_nope.dtype)
        keys = torch.cat([latent_b1sc, k_rope_b1sr.to(q_nope.dtype)], dim=-1)
        # every head reads the one latent key: fold the heads into the query length rather than
        # have the kernel copy the keys once per head (128 times at DeepSeek-V3's shape)
        out = attend(torch.cat([q_latent, q_rope], dim=-1), keys, latent_b1sc, positions_bs,
                     cache, scale=self.scale, fold_heads=True)  # [B, heads, S, latent]
        return torch.einsum("bhsc,hvc->bhsv", out, w[:, self.nope_dim:].to(out.dtype))
