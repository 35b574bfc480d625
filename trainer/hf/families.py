"""Hugging Face families: config.json <-> ModelConfig/MTPConfig, and tensor names <-> this model's.

Supported trunks: Llama, Qwen3 (dense, qk-norm), Qwen3-MoE (softmax router, no shared expert) and
GLM-4.5-MoE (`Glm4MoeForCausalLM`: partial rotary with rotate_half on the first rotary_dim channels,
sigmoid router with `e_score_correction_bias`, group-limited routing, shared experts,
`first_k_dense_replace`). Verified against transformers' modeling files:

- GLM-4.5-MoE rotary: `apply_rotary_pos_emb` rotates the first `rotary_dim` channels with
  rotate_half (not interleaved), exactly this project's `RotaryEmbedding`.
- MTP layouts. `glm` (GLM-4.5, DeepSeek-V3): layer j at `model.layers.{N + j}.{enorm, hnorm,
  eh_proj, shared_head.norm, <decoder block>}`, input `eh_proj(cat(enorm(emb), hnorm(h)))`, output
  head shared with `lm_head` (`shared_head.head` / `embed_tokens` copies are ignored on import, not
  written). `qwen3_next` (Qwen3-Next / Qwen3.5, `mtp.*`): `mtp.fc` = eh_proj with the same
  embedding-first order, `mtp.pre_fc_norm_embedding` = enorm, `mtp.pre_fc_norm_hidden` = hnorm,
  `mtp.layers.0.*` = block, `mtp.norm` = final norm; Qwen3-Next's RMSNorms are zero-centred (`x * (1
  + w)`), so norm weights gain +1 on import and lose it on export for those model types.
- Qwen3-Next / Qwen3.5 trunks (Gated DeltaNet linear attention, gated attention) are rejected with
  a clear error (Qwen4-Exp's hybrid trunk imports: trainer/hf/qwen4_exp.py); DeepSeek-V3 / Kimi-K2's
  MLA imports through trainer/hf/deepseek_v3.py.

Names are mapped one tensor of this model -> a `Src` (one checkpoint key, or per-expert keys stacked
along dim 0), so a reader can fetch any slice of a parameter without materialising the rest.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch

from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig

from . import deepseek_v3, qwen4_exp
from .names import (  # noqa: F401  (FamilySpec, Src re-exported)
    FamilySpec,
    Src,
    UnsupportedCheckpoint,
    required_field,
)
from .rope import (
    legacy_rope_fields,
    read_scaling,
    rope_fields,
    rope_parameters,
    theta_and_partial,
)

FAMILIES = ("llama", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_next_mtp",
            "qwen4_exp")
DRAFT_STEPS_KEY = "tandem_mtp_num_steps"
"""config.json's key for the draft length K an export's MTP module was trained at: a looped module
holds fewer layers (num_nextn_predict_layers) than the steps it drafts, and a re-import took K =
its layers (the draft length to pass vLLM as num_speculative_tokens)."""
_MLA_TYPES = ("deepseek_v2", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa")
"""MLA families whose routing or sparse attention this model lacks."""
_LINEAR_ATTN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


# --------------------------------------------------------------------------------------------------
# config.json -> ModelConfig / MTPConfig
# --------------------------------------------------------------------------------------------------
def detect_family(hf: dict, mtp_keys: Optional[List[str]] = None) -> FamilySpec:
    """Family of a config.json dict (and, for the MTP layout, the checkpoint's key names)."""
    archs = hf.get("architectures") or []
    mtype = hf.get("model_type", "")
    arch = archs[0] if archs else mtype
    n_mtp = int(hf.get("num_nextn_predict_layers",
                       hf.get("mtp_num_hidden_layers", hf.get("num_mtp_layers", 0))) or 0)
    if mtype in deepseek_v3.MODEL_TYPES:
        return FamilySpec("deepseek_v3", "glm", router_bias=True, num_mtp_layers=n_mtp)
    if mtype in _MLA_TYPES or "kv_lora_rank" in hf or "q_lora_rank" in hf:
        raise UnsupportedCheckpoint(
            f"{arch}: this MLA family is not supported (DeepSeek-V3's and Kimi-K2's are; its "
            "routing or sparse attention is not)")
    if mtype in qwen4_exp.MODEL_TYPES:
        return qwen4_exp.spec_from_hf(hf)
    if mtype == "qwen4_exp":
        raise UnsupportedCheckpoint(f"{arch}: the multimodal Qwen4-Exp checkpoint is not "
                                    "supported; use its text "
                                    "model (model_type qwen4_exp_text, Qwen4ExpForCausalLM)")
    if mtype in _LINEAR_ATTN_TYPES:
        raise UnsupportedCheckpoint(
            f"{arch}: the Qwen3-Next/Qwen3.5 trunk uses linear attention (Gated DeltaNet) and "
            "gated attention, "
            "which this model lacks; only its mtp.* naming is supported (on a Qwen3-family trunk)")
    has_qwen_mtp = any(k.startswith("mtp.") for k in (mtp_keys or []))
    layout = "qwen3_next" if has_qwen_mtp else "glm"
    if mtype == "llama":
        return FamilySpec("llama", layout, num_mtp_layers=n_mtp)
    if mtype == "qwen3":
        return FamilySpec("qwen3_next_mtp" if has_qwen_mtp else "qwen3", layout,
                          num_mtp_layers=n_mtp)
    if mtype == "qwen3_moe":
        return FamilySpec("qwen3_moe", layout, num_mtp_layers=n_mtp)
    if mtype == "glm4_moe":
        return FamilySpec("glm4_moe", layout, router_bias=True, num_mtp_layers=n_mtp)
    raise UnsupportedCheckpoint(
        f"unsupported architecture {arch!r} (model_type={mtype!r}); supported: LlamaForCausalLM, "
        "Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM, Glm4MoeForCausalLM, DeepseekV3ForCausalLM (+ Qwen3-Next-style mtp.* "
        "weights)")


def model_config_from_hf(hf: dict, spec: FamilySpec,
                         max_seq_len: Optional[int] = None) -> ModelConfig:
    """The trunk config of a Hugging Face config.json (raises UnsupportedCheckpoint for options
    this model lacks)."""
    try:
        cfg = _config_from_hf(hf, spec, max_seq_len)
    except KeyError as exc:  # a bare KeyError named neither the file nor the family
        raise UnsupportedCheckpoint(f"{spec.name}: config.json lacks {exc.args[0]!r}") from None
    try:
        cfg.validate()
    except ValueError as exc:  # it names the `model.*` key, which the user never wrote
        raise UnsupportedCheckpoint(f"{spec.name}: config.json describes a model Tandem cannot "
                                    f"build: {exc}") from None
    return cfg


def _config_from_hf(hf: dict, spec: FamilySpec, max_seq_len: Optional[int]) -> ModelConfig:
    name = spec.name
    if name == "qwen4_exp":
        if (rope_fields(hf).get("rope_type") or "default") != "default":
            raise UnsupportedCheckpoint("qwen4_exp: only default RoPE is supported")
        return qwen4_exp.config_from_hf(hf, theta_and_partial(hf), max_seq_len)
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: swish is silu
        raise UnsupportedCheckpoint(f"hidden_act={hf.get('hidden_act')!r} is not supported "
                                    "(SwiGLU/silu only)")
    if hf.get("mlp_bias"):
        raise UnsupportedCheckpoint("mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise UnsupportedCheckpoint("use_sliding_window=true is not supported (full causal "
                                    "attention only)")
    attention_bias = bool(hf.get("attention_bias", False))
    if attention_bias and name not in ("glm4_moe", "deepseek_v3"):
        raise UnsupportedCheckpoint(f"{name}: attention_bias=true also biases o_proj there, which "
                                    "this model lacks")
    theta, partial = theta_and_partial(hf)
    if name != "glm4_moe":  # transformers' Llama and Qwen3 classes rotate the whole head, whatever
        partial = 1.0  # a config's partial_rotary_factor says
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    mpe = int(hf.get("max_position_embeddings", 4096))
    cfg = ModelConfig(
        vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=0 if head_dim * heads == hidden else head_dim,
        intermediate_size=int(required_field(hf, name, "intermediate_size")), rope_theta=theta,
        partial_rotary_factor=partial,
        # the families' config classes' defaults: GLM4-MoE's 1e-5, the others' 1e-6
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5 if name == "glm4_moe" else 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or min(mpe, 4096), attention_bias=attention_bias, num_experts=0,
        num_shared_experts=0, first_k_dense=0,
        qk_norm=name in ("qwen3", "qwen3_moe", "qwen3_next_mtp"),
    )
    read_scaling(hf, cfg)
    if name == "qwen3_moe":
        _qwen3_moe_fields(hf, cfg)
    elif name == "glm4_moe":
        _glm4_moe_fields(hf, cfg)
    elif name == "deepseek_v3":
        deepseek_v3.apply_config(hf, cfg)
    return cfg


def _qwen3_moe_fields(hf: dict, cfg: ModelConfig) -> None:
    """Qwen3-MoE's experts: softmax routing with an auxiliary balance loss, dense layers first."""
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)))
    step = int(hf.get("decoder_sparse_step", 1))
    # transformers reads an index past the last layer as nothing to do (a truncated config)
    dense = sorted({int(i) for i in hf.get("mlp_only_layers", []) if int(i) < cfg.num_layers} |
                   {i for i in range(cfg.num_layers) if step > 1 and (i + 1) % step})
    if dense != list(range(len(dense))):
        raise UnsupportedCheckpoint(
            f"qwen3_moe: dense layers {dense} (from mlp_only_layers/decoder_sparse_step) are "
            "not a leading block; only first_k_dense is supported")
    cfg.num_experts, cfg.first_k_dense = experts, len(dense)
    cfg.top_k = int(required_field(hf, "qwen3_moe", "num_experts_per_tok"))
    cfg.moe_intermediate_size = int(required_field(hf, "qwen3_moe", "moe_intermediate_size"))
    cfg.norm_topk_prob = bool(hf.get("norm_topk_prob", False))
    cfg.router_score, cfg.balance = "softmax", "aux_loss"
    cfg.aux_loss_coef = float(hf.get("router_aux_loss_coef", 1e-3))


def _glm4_moe_fields(hf: dict, cfg: ModelConfig) -> None:
    """GLM-4.5's experts: grouped sigmoid routing, shared experts, aux-free balancing."""
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    if experts is None:
        experts = required_field(hf, "glm4_moe", "n_routed_experts")
    cfg.num_experts = int(experts)
    cfg.top_k = int(required_field(hf, "glm4_moe", "num_experts_per_tok"))
    cfg.moe_intermediate_size = int(required_field(hf, "glm4_moe", "moe_intermediate_size"))
    cfg.num_shared_experts = int(hf.get("n_shared_experts", 1))
    # past the last layer it means every layer is dense, as first_k_dense = num_layers says
    cfg.first_k_dense = min(int(hf.get("first_k_dense_replace", 1)), cfg.num_layers)
    cfg.norm_topk_prob = bool(hf.get("norm_topk_prob", True))
    cfg.routed_scaling_factor = float(hf.get("routed_scaling_factor", 1.0))
    cfg.n_group = int(hf.get("n_group", 1) or 1)
    cfg.topk_group = int(hf.get("topk_group", 1) or 1)
    cfg.router_score, cfg.balance = "sigmoid", "aux_free"
    cfg.qk_norm = bool(hf.get("use_qk_norm", False))
    rope = rope_fields(hf)
    if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in hf:
        cfg.partial_rotary_factor = 0.5  # Glm4MoeConfig's default
    if cfg.num_shared_experts < 1:
        raise UnsupportedCheckpoint("glm4_moe: n_shared_experts must be >= 1")


# --------------------------------------------------------------------------------------------------
# tensor names
# --------------------------------------------------------------------------------------------------
_EXPERT_PARAM = re.compile(r"^mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def _block(prefix: str, rest: str, cfg: ModelConfig, spec: FamilySpec) -> Optional[Src]:
    if spec.name == "deepseek_v3" and cfg.kv_lora_rank:
        src = deepseek_v3.attention_src(prefix, rest, cfg)
        if src is not None:
            return src
    m = _EXPERT_PARAM.match(rest)
    if m:
        return Src([f"{prefix}mlp.experts.{e}.{m.group(1)}.weight" for e in range(cfg.num_experts)],
                   stacked=True)
    if rest == "mlp.router.weight":
        return Src([prefix + "mlp.gate.weight"])
    if rest == "mlp.router.e_score_correction_bias":
        return Src([prefix + "mlp.gate.e_score_correction_bias"]) if spec.router_bias else None
    return Src([prefix + rest])


def trunk_input_of(hf: dict) -> str:
    """MTP input convention of a checkpoint: `final_norm` unless config.json says otherwise
    (Qwen4-Exp's drafter always reads the trunk's streams before the final mixer)."""
    if hf.get("model_type") in qwen4_exp.MODEL_TYPES:
        return "pre_norm"
    return "pre_norm" if hf.get("tie_last_hidden_states") is False else "final_norm"


def hf_name(name: str, cfg: ModelConfig, mtp: MTPConfig, spec: FamilySpec) -> Optional[Src]:
    """The checkpoint source of this model's tensor `name` (a parameter or persistent buffer), or
    None when the family has no such tensor (it then stays at its initial value / must be zero)."""
    n = cfg.num_layers
    if spec.name == "qwen4_exp":
        return qwen4_exp.hf_name(name, cfg, mtp, spec)
    if name == "embed_tokens.weight":
        src = Src(["model.embed_tokens.weight"])
    elif name == "norm.weight":
        src = Src(["model.norm.weight"])
    elif name == "lm_head.weight":
        src = Src(["lm_head.weight"])
    elif name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        src = _block(f"model.layers.{i}.", rest, cfg, spec)
    elif name.startswith("mtp.layers."):
        j, rest = name[len("mtp.layers."):].split(".", 1)
        j = int(j)
        if spec.mtp_layout == "glm":
            prefix = f"model.layers.{n + j}."
            table = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                     "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
            src = Src([prefix + table[rest]]) if rest in table else _block(prefix,
                                                                           rest[len("block."):],
                                                                           cfg, spec)
        else:
            if mtp.num_layers != 1:
                raise UnsupportedCheckpoint(
                    "the Qwen3-Next mtp.* layout has one fc/norm set, so it holds exactly 1 MTP "
                    "layer "
                    f"(mtp.num_layers={mtp.num_layers})")
            table = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                     "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
                     "eh_proj.weight": "mtp.fc.weight", "norm.weight": "mtp.norm.weight"}
            src = Src([table[rest]]) if rest in table else _block(f"mtp.layers.{j}.",
                                                                  rest[len("block."):], cfg, spec)
        if src is not None and rest == "eh_proj.weight" and mtp.concat_order == "hidden_emb":
            src.swap_halves = True
    else:
        raise KeyError(f"no Hugging Face name for {name!r}")
    if src is not None and spec.zero_centered_norm and name.endswith("norm.weight"):
        src.plus_one = True
    return src


def ignorable_key(key: str, cfg: ModelConfig, spec: FamilySpec) -> bool:
    """Checkpoint keys that are deliberately not loaded (duplicated shared tensors, a tied head,
    rotary caches)."""
    if key.endswith("rotary_emb.inv_freq"):
        return True
    if key == "lm_head.weight" and cfg.tie_embeddings:  # transformers ties it to the embedding
        return True
    m = re.match(r"^model\.layers\.(\d+)\.(shared_head\.head\.weight|embed_tokens\.weight)$", key)
    return bool(m and int(m.group(1)) >= cfg.num_layers)


def is_mtp_key(key: str, cfg: ModelConfig) -> bool:
    if key.startswith("mtp."):
        return True
    m = re.match(r"^model\.layers\.(\d+)\.", key)
    return bool(m and int(m.group(1)) >= cfg.num_layers)


def mtp_layer_of_key(key: str, cfg: ModelConfig) -> int:
    """Physical MTP layer index of an MTP checkpoint key."""
    m = re.match(r"^model\.layers\.(\d+)\.", key)
    if m:
        return int(m.group(1)) - cfg.num_layers
    m = re.match(r"^mtp\.layers\.(\d+)\.", key)
    return int(m.group(1)) if m else 0


# --------------------------------------------------------------------------------------------------
# export: family choice and config.json
# --------------------------------------------------------------------------------------------------
def default_family(cfg: ModelConfig) -> str:
    """The family whose transformers class computes exactly what these knobs compute."""
    if cfg.hc_count > 1:
        return "qwen4_exp"
    if cfg.kv_lora_rank:
        return "deepseek_v3"
    if cfg.num_experts == 0:
        return "qwen3" if cfg.qk_norm else "llama"
    if (cfg.router_score == "softmax" and cfg.num_shared_experts == 0 and cfg.qk_norm
        and cfg.n_group == 1
            and cfg.routed_scaling_factor == 1.0 and cfg.partial_rotary_factor == 1.0
        and not cfg.attention_bias):
        return "qwen3_moe"
    return "glm4_moe"


def check_exportable(family: str, cfg: ModelConfig, mtp: Optional[MTPConfig]) -> None:
    """Raise UnsupportedCheckpoint listing every knob the target family cannot express."""
    problems = []
    if family not in FAMILIES:
        raise UnsupportedCheckpoint(f"unknown export family {family!r}; choose one of "
                                    f"{', '.join(FAMILIES)}")
    if family == "qwen4_exp":
        problems = qwen4_exp.check_exportable(cfg, mtp)
        if problems:
            raise UnsupportedCheckpoint(f"cannot export as {family}: " + "; ".join(problems))
        return
    if cfg.hc_count > 1 or any(cfg.layer_type(i) != "attention" for i in range(cfg.num_layers)):
        raise UnsupportedCheckpoint(f"cannot export as {family}: the trunk has hyper-connections "
                                    "or non-attention "
                                    "token mixers (Qwen4-Exp layers); export as qwen4_exp")
    trunk = "qwen3_moe" if family == "qwen3_next_mtp" and cfg.num_experts else (
        "qwen3" if family == "qwen3_next_mtp" else family)
    if cfg.zero_centered_norm:
        problems.append("model.zero_centered_norm=true (the family's norms scale by w, not 1 + w)")
    if mtp is not None and mtp.num_steps > 0 and mtp.style != "looped":
        problems.append("mtp.style=parallel (the family's MTP layers combine the embedding and the "
                        "hidden state through fc)")
    if trunk in ("llama", "qwen3", "qwen3_moe"):
        if cfg.attention_bias:
            problems.append("model.attention_bias=true (the family would also bias o_proj)")
        if cfg.partial_rotary_factor != 1.0:
            problems.append(
                f"model.partial_rotary_factor={cfg.partial_rotary_factor} (must be 1.0)"
            )
        if cfg.qk_norm != (trunk != "llama"):
            problems.append(f"model.qk_norm={cfg.qk_norm} (must be {trunk != 'llama'})")
    if trunk in ("llama", "qwen3") and cfg.num_experts:
        problems.append(f"model.num_experts={cfg.num_experts} (the family is dense)")
    if trunk == "qwen3_moe":
        if cfg.num_experts == 0:
            problems.append("model.num_experts=0 (the family is MoE)")
        for key, ok in (("router_score", cfg.router_score == "softmax"), ("num_shared_experts",
                                                                          cfg.num_shared_experts
                                                                          == 0),
                        ("n_group", cfg.n_group == 1),
                        ("routed_scaling_factor", cfg.routed_scaling_factor == 1.0)):
            if not ok:
                problems.append(f"model.{key}={getattr(cfg, key)!r}")
    if trunk in ("glm4_moe", "deepseek_v3"):
        problems += _glm4_moe_problems(cfg, mtp)
    if trunk == "deepseek_v3":
        problems += deepseek_v3.problems(cfg)
    elif cfg.kv_lora_rank:
        problems.append(f"model.kv_lora_rank={cfg.kv_lora_rank} (MLA: export as deepseek_v3)")
    if family == "qwen3_next_mtp" and mtp is not None and mtp.num_steps > 0 and mtp.num_layers != 1:
        problems.append(f"mtp.num_layers={mtp.num_layers} (the mtp.* layout holds one layer)")
    if problems:
        raise UnsupportedCheckpoint(f"cannot export as {family}: " + "; ".join(problems))


def _glm4_moe_problems(cfg: ModelConfig, mtp: Optional[MTPConfig]) -> List[str]:
    """What GLM-4.5-MoE's transformers class cannot express."""
    problems = []
    if cfg.num_experts == 0:
        problems.append("model.num_experts=0 (the family is MoE)")
    if cfg.router_score != "sigmoid":
        problems.append(
            f"model.router_score={cfg.router_score!r} (GLM-4.5 routes with sigmoid)"
        )
    if cfg.num_shared_experts < 1:
        problems.append("model.num_shared_experts=0 (GLM-4.5 always has a shared expert)")
    if cfg.shared_expert_gate:
        problems.append("model.shared_expert_gate=true (GLM-4.5's shared experts are ungated)")
    shared = cfg.moe_intermediate_size * cfg.num_shared_experts
    if cfg.shared_expert_intermediate_size not in (0, shared):
        problems.append(f"model.shared_expert_intermediate_size="
                        f"{cfg.shared_expert_intermediate_size} (GLM-4.5's is "
                        f"moe_intermediate_size x num_shared_experts = {shared})")
    if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
        problems.append("fewer than 2 experts per group (GLM group scores sum the top-2)")
    if mtp is not None and mtp.num_steps > 0:
        if not mtp.moe:
            problems.append("mtp.moe=false (GLM MTP layers are MoE layers)")
    return problems


def hf_config(family: str, cfg: ModelConfig, mtp: Optional[MTPConfig]) -> Tuple[dict, FamilySpec]:
    """config.json for `family` and the FamilySpec used to name tensors."""
    check_exportable(family, cfg, mtp)
    if family == "qwen4_exp":
        hf = qwen4_exp.hf_config(cfg, mtp)
        return hf, qwen4_exp.spec_from_hf(hf)
    n_mtp = mtp.num_layers if mtp is not None and mtp.num_steps > 0 else 0
    base = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope_parameters(cfg),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "use_cache": True, "dtype": "float32",
    }
    if family == "llama":
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", mlp_bias=False)
    elif family in ("qwen3", "qwen3_next_mtp") and cfg.num_experts == 0:
        base.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                    use_sliding_window=False)
    elif family in ("qwen3_moe", "qwen3_next_mtp"):
        base.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                    num_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_intermediate_size,
                    norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                    mlp_only_layers=list(range(min(cfg.first_k_dense, cfg.num_layers))),
                    use_sliding_window=False, router_aux_loss_coef=cfg.aux_loss_coef)
    else:
        # GLM-4.5's and DeepSeek-V3's experts, routing and MTP layers are spelt alike
        base.update(
            n_routed_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.moe_intermediate_size,
            n_shared_experts=cfg.num_shared_experts,
            first_k_dense_replace=min(cfg.first_k_dense, cfg.num_layers),
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            num_nextn_predict_layers=n_mtp,
        )
        if family == "deepseek_v3":
            base.update(deepseek_v3.config_fields(cfg))
        else:
            base["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
            base.update(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
                        use_qk_norm=cfg.qk_norm)
    base.update(legacy_rope_fields(base["rope_parameters"]))
    layout = "glm" if family in ("glm4_moe", "deepseek_v3") else "qwen3_next"
    if n_mtp and layout == "qwen3_next":
        base["mtp_num_hidden_layers"] = n_mtp
    if n_mtp and mtp.trunk_input == "pre_norm":
        # transformers' MTP drafting reads hidden_states[-1]; untied, that is the pre-norm trunk
        # state.
        base["tie_last_hidden_states"] = False
    spec = FamilySpec(family, layout, router_bias=family in ("glm4_moe", "deepseek_v3"),
                      num_mtp_layers=n_mtp)
    return base, spec


def meta_state(cfg: ModelConfig, mtp: MTPConfig) -> Dict[str, torch.Size]:
    """Every parameter and persistent buffer of the full (unsharded) model with its shape, built
    on the meta device (nothing allocated)."""

    with torch.device("meta"):
        model = TandemModel(cfg, mtp)
    out = {name: p.shape for name, p in model.named_parameters()}
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias") or qwen4_exp.is_ple_buffer(name):
            out[name] = b.shape
    return out
