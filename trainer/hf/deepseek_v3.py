"""DeepSeek-V3 (and Kimi-K2, which ships the same architecture): config.json <-> ModelConfig, and
the attention tensors whose rows differ from this model's.

The trunk is GLM-4.5's MoE (sigmoid routing with `e_score_correction_bias`, group-limited top-k,
shared experts, dense first layers) around multi-head latent attention (models/latent_attention.py),
and the MTP layers sit at `model.layers.{N + j}` as GLM's do, so only the attention and the config
defaults are this family's own. Verified against transformers' `DeepseekV3ForCausalLM`
(tests/unit/test_hf_parity.py): logits within 1e-4 in fp32, export back to identical tensors.

`rope_interleave` (transformers' default for this family, and how DeepSeek's checkpoints are
written): the rotary channels of q_proj / q_b_proj rows (per head, after the nope channels) and of
kv_a_proj_with_mqa rows (after the latent) are interleaved pairs; they are reordered to this model's
[even | odd] half-split on import and back on export (`Src.interleaved_rope`).
"""

from __future__ import annotations

from typing import List, Optional

from tandem.models.config import ModelConfig

from .names import Src, UnsupportedCheckpoint, required_field

MODEL_TYPES = ("deepseek_v3", "kimi_k2")

_DEFAULTS = dict(n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                 first_k_dense_replace=3, norm_topk_prob=True, routed_scaling_factor=2.5,
                 n_group=8, topk_group=4, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536)
"""DeepseekV3Config's defaults, for a config.json that leaves a key out."""


def _get(hf: dict, key: str):
    value = hf.get(key)
    return _DEFAULTS[key] if value is None else value


def apply_config(hf: dict, cfg: ModelConfig) -> None:
    """The experts and the MLA widths of a DeepSeek-V3 config.json, onto the common fields."""
    if hf.get("attention_bias"):
        raise UnsupportedCheckpoint("deepseek_v3: attention_bias=true is not supported (MLA here "
                                    "has no projection biases)")
    if hf.get("rope_interleave") is False:
        raise UnsupportedCheckpoint("deepseek_v3: rope_interleave=false is not supported (its "
                                    "checkpoints interleave the rotary channels)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method",
                                                                "noaux_tc") != "noaux_tc":
        raise UnsupportedCheckpoint("deepseek_v3: only sigmoid scoring with noaux_tc top-k "
                                    "routing is supported")
    cfg.num_experts = int(_get(hf, "n_routed_experts"))
    cfg.top_k = int(_get(hf, "num_experts_per_tok"))
    cfg.moe_intermediate_size = int(required_field(hf, "deepseek_v3", "moe_intermediate_size"))
    cfg.num_shared_experts = int(_get(hf, "n_shared_experts"))
    cfg.first_k_dense = min(int(_get(hf, "first_k_dense_replace")), cfg.num_layers)
    cfg.norm_topk_prob = bool(_get(hf, "norm_topk_prob"))
    cfg.routed_scaling_factor = float(_get(hf, "routed_scaling_factor"))
    cfg.n_group, cfg.topk_group = int(_get(hf, "n_group")), int(_get(hf, "topk_group"))
    cfg.router_score, cfg.balance = "sigmoid", "aux_free"
    cfg.kv_lora_rank = int(_get(hf, "kv_lora_rank"))
    # null: one q_proj (DeepSeek-V2-Lite's layout); left out: the class default
    cfg.q_lora_rank = int((hf["q_lora_rank"] if "q_lora_rank" in hf else
                           _DEFAULTS["q_lora_rank"]) or 0)
    cfg.qk_nope_head_dim = int(_get(hf, "qk_nope_head_dim"))
    cfg.qk_rope_head_dim = int(_get(hf, "qk_rope_head_dim"))
    cfg.v_head_dim = int(_get(hf, "v_head_dim"))
    cfg.num_kv_heads, cfg.head_dim, cfg.partial_rotary_factor = cfg.num_heads, 0, 1.0
    if cfg.num_shared_experts < 1:
        raise UnsupportedCheckpoint("deepseek_v3: n_shared_experts must be >= 1")


def attention_src(prefix: str, rest: str, cfg: ModelConfig) -> Optional[Src]:
    """The source of a projection whose rotary rows the checkpoint interleaves, else None."""
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
        return Src([prefix + rest], interleaved_rope=(qk, cfg.qk_nope_head_dim,
                                                      cfg.qk_rope_head_dim))
    if rest == "self_attn.kv_a_proj_with_mqa.weight":
        return Src([prefix + rest], interleaved_rope=(cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                                      cfg.kv_lora_rank, cfg.qk_rope_head_dim))
    return None


def problems(cfg: ModelConfig) -> List[str]:
    """What DeepSeek-V3's class cannot express beyond GLM-4.5's MoE limits (families.py)."""
    if not cfg.kv_lora_rank:
        return ["model.kv_lora_rank=0 (DeepSeek-V3's attention is MLA)"]
    return []


def config_fields(cfg: ModelConfig) -> dict:
    """config.json's keys of this family beyond the experts and routing it spells as GLM-4.5 does
    (families.hf_config)."""
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        num_key_value_heads=cfg.num_heads, scoring_func="sigmoid", topk_method="noaux_tc",
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim, rope_interleave=True)
