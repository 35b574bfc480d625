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
decoding cache work unchanged. The cache holds each head's expanded key and value (not the latent:
simpler, and decoding here is the evaluator's, not a server's).

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
        self.rotary = RotaryEmbedding(self.rope_dim, self.rope_dim, cfg.rope_theta,
                                      cfg.max_seq_len, cfg.yarn)
        self.scale = qk_dim ** -0.5 * (cfg.yarn.softmax_factor if cfg.yarn is not None else 1.0)

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        return ("normal", scales.residual_std) if name == "o_proj.weight" else None

    def queries(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """[B, S, heads x (nope + rope)]."""
        if self.compressed_queries:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_bsh)))
        return self.q_proj(x_bsh)

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor,
                cache: Optional[LayerKV] = None, documents: Optional[Documents] = None,
                context: Optional[WholeWindow] = None) -> torch.Tensor:
        """As `attention.Attention.forward`."""
        b, s, _ = x_bsh.shape
        q = self.queries(x_bsh).view(b, s, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x_bsh).split([self.kv_lora_rank, self.rope_dim],
                                                              dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        heads = q.shape[1]
        q = torch.cat([q_nope, self.rotary(q_rope, positions_bs)], dim=-1)
        k_rope = self.rotary(k_rope.unsqueeze(1), positions_bs).expand(-1, heads, -1, -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = attend(q, k, v, positions_bs, cache, documents, context, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
