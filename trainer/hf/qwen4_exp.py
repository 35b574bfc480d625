"""Qwen4-Exp (Qwen3.8-Flash-Next) checkpoints: transformers' `qwen4_exp_text` /
`Qwen4ExpForCausalLM` trunk plus vLLM's `Qwen4ExpMTP` drafter layout (`mtp.*`), mapped to this
model's names.

Verified against transformers 5.24 (`models/qwen4_exp/`) and vLLM 0.32
(`models/qwen4_exp/nvidia/mtp.py`):

- Norms are zero-centred in both (`x_hat * (1 + w)`): weights copy as they are.
- The final norm is the stream mixer `model.hyper_connection_mixer` (ours: `norm`).
- Routed experts are stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`; transformers
  fuses gate/up on load), the router is `mlp.gate`, the shared expert `mlp.shared_expert` with its
  sigmoid gate `mlp.shared_expert_gate`.
- A PLE table is stored as `split_ngram_parts` row blocks
  `ple.ple_embedding.ngram_embedding.shard_{j}` (transformers concatenates them on load and chunks
  them with `torch.chunk` on save); its hash buffers (`layer_multipliers`,
  `ngram_heads_vocab_sizes`, `ngram_heads_offsets`) are stored too.
- Gated DeltaNet's `in_proj_qkv` rows and `conv1d` channels are [q | k | v] in the checkpoint and by
  key-head group here (so tensor parallelism shards whole groups with Shard(0)): `Src.qkv_groups`
  permutes them on import and back on export.
- The drafter: `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` (over hc x H),
  `mtp.fc_embedding`, `mtp.fc_hidden`, `mtp.layers.0.*` (a decoder layer named like the trunk's) and
  `mtp.hyper_connection_mixer.*`; one set of fc/norms, so exactly one physical MTP layer. Its
  `block_inject_weight` is never stored (vLLM drops it); ours has none either.
"""

from __future__ import annotations

import math
import re
from typing import List, Optional

from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig
from tandem.models.ple import ngram_tables

from .names import FamilySpec, Src, UnsupportedCheckpoint

MODEL_TYPES = ("qwen4_exp_text",)
_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_MTP_TOP = {"pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc_embedding.weight",
            "fc_hidden.weight"}


def spec_from_hf(hf: dict) -> FamilySpec:
    n_mtp = int(hf.get("mtp_num_hidden_layers", 0) or 0)
    return FamilySpec("qwen4_exp", "qwen4_exp", num_mtp_layers=n_mtp,
                      extra={"split_ngram_parts": int(hf.get("split_ngram_parts", 512))})


def config_from_hf(hf: dict, rope, max_seq_len: Optional[int]) -> ModelConfig:
    """ModelConfig of a transformers `qwen4_exp_text` config.json (rope: rope.theta_and_partial)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"qwen4_exp: hidden_act={hf.get('hidden_act')!r} is not "
                                    "supported (silu only)")
    if hf.get("attention_bias"):
        raise UnsupportedCheckpoint("qwen4_exp: attention_bias=true is not supported")
    if hf.get("indexer_n_heads") is None:
        raise UnsupportedCheckpoint("qwen4_exp: checkpoints without a QSA indexer (indexer_n_heads "
                                    "unset) are not "
                                    "supported")
    if int(hf.get("indexer_kv_heads") or 1) != 1:
        raise UnsupportedCheckpoint("qwen4_exp: QSA needs indexer_kv_heads=1")
    theta, partial = rope
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % int(hf.get("full_attention_interval",
                                                   4)) else "indexed_attention"
        for i in range(n)]
    types = ["indexed_attention" if t == "full_attention" else t for t in types]
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    mpe = int(hf.get("max_position_embeddings", 4096))
    hidden = int(hf["hidden_size"])
    hf = {**_CONFIG_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    moe_width = int(hf["moe_intermediate_size"])
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), hidden_size=hidden, num_layers=n,
        num_heads=int(hf["num_attention_heads"]), num_kv_heads=int(hf["num_key_value_heads"]),
        head_dim=int(hf["head_dim"]),
        intermediate_size=moe_width, moe_intermediate_size=moe_width,
        num_experts=int(hf["num_experts"]), top_k=int(hf["num_experts_per_tok"]),
        num_shared_experts=1,
        shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
        shared_expert_gate=True, first_k_dense=0, router_score="softmax",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), balance="aux_loss",
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 1e-3)), rope_theta=theta,
        partial_rotary_factor=partial,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or min(mpe, 4096), zero_centered_norm=True, layer_types=types,
        linear_num_key_heads=int(hf["linear_num_key_heads"]),
        linear_num_value_heads=int(hf["linear_num_value_heads"]),
        linear_key_head_dim=int(hf["linear_key_head_dim"]),
        linear_value_head_dim=int(hf["linear_value_head_dim"]),
        linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        linear_gate_act=hf.get("output_gate_type") or hf.get("hidden_act", "silu"),
        indexer_heads=int(hf["indexer_n_heads"]), indexer_head_dim=int(hf["indexer_head_dim"]),
        indexer_budget=int(hf["indexer_budget"]),
        indexer_compress_ratio=int(hf["indexer_compress_ratio"]),
        hc_count=int(hf.get("hc_count", 4)), hc_lowrank=int(hf.get("hc_lowrank", 320)),
        # transformers sorts them and numbers each layer's table (its hash seed) in that order
        ple_layers=sorted({int(i) - 1 for i in (hf.get("ple_layer_ids") or [])}),
        ple_embed_dim=int(hf.get("ple_embed_dim") or hidden),
        ple_conv_kernel=int(hf.get("ple_conv_kernel_size", 4)),
        ngram_size=int(hf.get("ngram_size", 3)), heads_per_ngram=int(hf.get("heads_per_ngram", 8)),
        ngram_vocab_base=int(hf.get("ngram_vocab_size_base", 20_000_000)),
        ngram_vocab_multiple=int(hf.get("make_ngram_vocab_size_divisible_by", 128)),
        ngram_seed=int(hf.get("seed", 1234)), eos_token_id=-1 if eos is None else int(eos),
    )


_CONFIG_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 2, "num_experts": 512,
                    "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128}
"""Qwen4ExpTextConfig's defaults for the shape fields a config.json may leave out (transformers
5.x): a field left out is read as transformers reads it."""


def _block(prefix: str, rest: str, cfg: ModelConfig, spec: FamilySpec) -> Optional[Src]:
    m = re.match(r"^mlp\.experts\.(gate_proj|up_proj|down_proj)$", rest)
    if m:
        return Src([f"{prefix}mlp.experts.{e}.{m.group(1)}.weight" for e in range(cfg.num_experts)],
                   stacked=True)
    if rest == "mlp.router.weight":
        return Src([prefix + "mlp.gate.weight"])
    if rest == "mlp.router.e_score_correction_bias":
        return None  # softmax routing without a correction bias
    if rest.startswith("mlp.shared_experts."):
        return Src([prefix + "mlp.shared_expert." + rest[len("mlp.shared_experts."):]])
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        return Src([prefix + rest],
                   qkv_groups=(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                                cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    if rest == "ple.ple_embedding.ngram_embedding.weight":
        # torch.chunk's blocks: fewer than split_ngram_parts when they do not divide the rows
        rows = _ple_rows(cfg, cfg.ple_layers.index(int(prefix.split(".")[2])))
        block = -(-rows // int(spec.extra.get("split_ngram_parts", 1)))
        return Src([f"{prefix}ple.ple_embedding.ngram_embedding.shard_{j}.weight"
                    for j in range(-(-rows // block))], concat=True)
    return Src([prefix + rest])


def hf_name(name: str, cfg: ModelConfig, mtp: MTPConfig, spec: FamilySpec) -> Optional[Src]:
    if name == "embed_tokens.weight":
        return Src(["model.embed_tokens.weight"])
    if name == "lm_head.weight":
        return Src(["lm_head.weight"])
    if name.startswith("norm."):
        return Src(["model.hyper_connection_mixer." + name[len("norm."):]])
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        return _block(f"model.layers.{i}.", rest, cfg, spec)
    if name.startswith("mtp.layers."):
        j, rest = name[len("mtp.layers."):].split(".", 1)
        if mtp.num_layers != 1:
            raise UnsupportedCheckpoint("the Qwen4-Exp mtp.* layout has one fc/norm set, so it "
                                        "holds exactly 1 MTP "
                                        f"layer (mtp.num_layers={mtp.num_layers})")
        if rest in _MTP_TOP:
            return Src(["mtp." + rest])
        if rest.startswith("norm."):
            return Src(["mtp.hyper_connection_mixer." + rest[len("norm."):]])
        return _block(f"mtp.layers.{j}.", rest[len("block."):], cfg, spec)
    raise KeyError(f"no Hugging Face name for {name!r}")


def is_ple_buffer(name: str) -> bool:
    return any(name.endswith("ple_embedding." + b) for b in _PLE_BUFFERS)


def split_parts(cfg: ModelConfig) -> int:
    """`split_ngram_parts` for an export: transformers chunks every PLE table into that many row
    blocks with torch.chunk, so pick a count that divides every table's rows exactly (tables are
    padded to `ngram_vocab_multiple`), at most transformers' default 512."""

    parts = 512
    for index in range(len(cfg.ple_layers)):
        parts = math.gcd(parts, _ple_rows(cfg, index))
    return max(parts, 1)


def _ple_rows(cfg: ModelConfig, index: int) -> int:
    """The rows of the PLE table of the `index`-th PLE layer (padded to ngram_vocab_multiple)."""
    return ngram_tables(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ngram_vocab_base,
                        cfg.ngram_vocab_multiple, cfg.ngram_seed, index)[3]


def check_exportable(cfg: ModelConfig, mtp: Optional[MTPConfig]) -> List[str]:
    problems = []
    types = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    if "attention" in types:
        problems.append("model.layer_types has full `attention` layers (Qwen4-Exp layers are "
                        "linear_attention or "
                        "indexed_attention)")
    if "indexed_attention" not in types:
        problems.append("no indexed_attention layer (the family's attention layers all carry a QSA "
                        "indexer)")
    for key, ok in (
        ("hc_count", cfg.hc_count > 1),
        ("zero_centered_norm", cfg.zero_centered_norm),
        ("router_score", cfg.router_score == "softmax"),
        ("num_shared_experts", cfg.num_shared_experts == 1),
        ("shared_expert_gate", cfg.shared_expert_gate),
        ("first_k_dense", cfg.first_k_dense == 0),
        ("num_experts", cfg.num_experts > 0),
        ("n_group", cfg.n_group == 1),
        ("routed_scaling_factor", cfg.routed_scaling_factor == 1.0),
        ("attention_bias", not cfg.attention_bias),
    ):
        if not ok:
            problems.append(f"model.{key}={getattr(cfg, key)!r}")
    if mtp is not None and mtp.num_steps > 0:
        if mtp.num_layers != 1:
            problems.append(f"mtp.num_layers={mtp.num_layers} (the mtp.* layout holds one layer)")
        if mtp.style != "looped" or mtp.resolved_combine(cfg) != "qwen4_exp":
            problems.append("the MTP module must be the looped qwen4_exp drafter "
                            "(mtp.combine=qwen4_exp)")
        if not mtp.moe:
            problems.append("mtp.moe=false (the drafter's layer is an MoE layer)")
        if mtp.trunk_input != "pre_norm":
            problems.append("mtp.trunk_input must be pre_norm (the drafter reads the streams "
                            "before the final mixer)")
    return problems


def hf_config(cfg: ModelConfig, mtp: Optional[MTPConfig]) -> dict:
    n_mtp = mtp.num_layers if mtp is not None and mtp.num_steps > 0 else 0
    out = {
        "architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default",
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "use_cache": True, "dtype": "float32",
        "layer_types": [cfg.layer_type(i) for i in range(cfg.num_layers)],
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "output_gate_type": cfg.linear_gate_act, "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.resolved_shared_expert_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.aux_loss_coef, "output_router_logits": False,
        "hc_count": cfg.hc_count, "hc_lowrank": cfg.hc_lowrank,
        "ple_layer_ids": [i + 1 for i in cfg.ple_layers],
        "ple_embed_dim": cfg.resolved_ple_embed_dim,
        "ple_conv_kernel_size": cfg.ple_conv_kernel, "ngram_size": cfg.ngram_size,
        "heads_per_ngram": cfg.heads_per_ngram, "ngram_vocab_size_base": cfg.ngram_vocab_base,
        "make_ngram_vocab_size_divisible_by": cfg.ngram_vocab_multiple, "seed": cfg.ngram_seed,
        "split_ngram_parts": split_parts(cfg) if cfg.ple_layers else 512,
        "indexer_n_heads": cfg.indexer_heads, "indexer_kv_heads": 1,
        "indexer_head_dim": cfg.indexer_head_dim,
        "indexer_budget": cfg.indexer_budget, "indexer_compress_ratio": cfg.indexer_compress_ratio,
        "eos_token_id": cfg.eos_token_id if cfg.eos_token_id >= 0 else None,
    }
    if n_mtp:
        out["mtp_num_hidden_layers"] = n_mtp
        # vLLM's Qwen4ExpMTP proposer reuses depth 1's QSA selection only when told (default off):
        # serve the drafter as it was trained
        out["index_share_for_mtp_iteration"] = bool(mtp.qsa_reuse_indices)
    return out
