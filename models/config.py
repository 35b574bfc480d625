"""The trunk's configuration (`ModelConfig`) and its checks; the MTP module's is in
models/mtp_config.py.

Plain dataclasses so `models/` stays free of trainer concerns; the trainer embeds them in its
omegaconf tree as `model` and `mtp`. Knobs cover what Qwen3 / Qwen3-MoE / GLM-4.5-MoE /
DeepSeek-V3-style checkpoints need, so importing one is a weight mapping, not a new model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .layers import Llama3Rope, Yarn


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    """Rows of the embedding and output head (>= the tokenizer's vocabulary)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Trunk transformer layers."""
    num_heads: int = 4
    """Attention (query) heads."""
    num_kv_heads: int = 2
    """Key/value heads (GQA); must divide num_heads."""
    head_dim: int = 0
    """Per-head width; 0 means hidden_size // num_heads."""
    intermediate_size: int = 384
    """SwiGLU width of dense MLP layers."""
    moe_intermediate_size: int = 128
    """SwiGLU width of each routed expert (and of each shared expert)."""
    num_experts: int = 8
    """Routed experts per MoE layer; 0 makes every layer dense."""
    top_k: int = 2
    """Experts each token is routed to."""
    num_shared_experts: int = 1
    """Always-on shared experts per MoE layer (their widths add up into one SwiGLU)."""
    first_k_dense: int = 1
    """The first k trunk layers use a dense MLP instead of MoE (DeepSeek/GLM
    `first_k_dense_replace`)."""
    router_score: str = "sigmoid"
    """Router scoring function: `softmax` (Qwen3-MoE, Mixtral, Qwen4-Exp) or `sigmoid` (DeepSeek-V3,
    GLM-4.5). Use the one the checkpoint you import or will export to was trained with; from
    scratch, `sigmoid` pairs with balance=aux_free (scores independent of the other experts, so a
    bias shifts selection without rescaling the rest)."""
    norm_topk_prob: bool = True
    """Renormalise the selected experts' scores to sum to 1."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' combined output weights."""
    n_group: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3); 1 disables grouping."""
    topk_group: int = 1
    """Groups a token may route into when n_group > 1."""
    balance: str = "aux_free"
    """Load balancing: `aux_free` (DeepSeek-V3's per-expert routing bias, nudged each step toward
    even loads; no gradient through the loss, so the LM objective is untouched: the default from
    scratch), `aux_loss` (switch-style loss weighted by aux_loss_coef: what Qwen3-MoE / Qwen4-Exp
    trained with, so use it to continue those) or `none` (fine-tuning a trained router briefly, or a
    dense model)."""
    aux_loss_coef: float = 1e-3
    """Weight of the load-balancing auxiliary loss when balance=aux_loss: each MoE layer adds
    coef * E * sum_i f_i P_i with f_i = c_i / (T k) (DeepSeek-V3's and Megatron's normalisation).
    transformers' Qwen3-MoE loss is k times that per layer and one loss over all layers; an
    imported router_aux_loss_coef is taken as it is."""
    bias_update_rate: float = 1e-3
    """Step size u of the aux-free bias update b_i += u * sign(mean_load - load_i)."""
    z_loss_coef: float = 0.0
    """Router z-loss weight (0 disables): coef * mean(logsumexp(router_logits)^2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3)."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2, GLM-4.5); the output projection never has one."""
    rope_theta: float = 10000.0
    """RoPE base."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that is rotated (GLM-4.5 uses 0.5)."""
    rope_scaling: str = "none"
    """`none`, `yarn` (YaRN: DeepSeek-V3, Kimi-K2; the rope_* keys below) or `llama3` (Llama 3.1's;
    rope_factor, rope_original_max_len, rope_*_freq_factor); full attention and MLA layers only."""
    rope_factor: float = 1.0
    """YaRN, llama3: how many times the original context the positions stretch to."""
    rope_original_max_len: int = 4096
    """YaRN, llama3: the context length the model was pretrained at."""
    rope_low_freq_factor: float = 1.0
    """llama3: pairs turning fewer times than this over the original context are stretched."""
    rope_high_freq_factor: float = 4.0
    """llama3: pairs turning more times than this keep their frequency (blended between)."""
    rope_beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept as it was (extrapolated)."""
    rope_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is divided by rope_factor (interpolated)."""
    rope_mscale: float = 0.0
    """YaRN: cos/sin are scaled by mscale(rope_mscale) / mscale(rope_mscale_all_dim), where
    mscale(m) = 0.1 m ln(rope_factor) + 1 (either 0: by mscale(1))."""
    rope_mscale_all_dim: float = 0.0
    """YaRN on MLA: the softmax scale gains mscale(rope_mscale_all_dim)^2, as DeepSeek-V3's does."""
    kv_lora_rank: int = 0
    """> 0: every `attention` layer is multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2),
    its keys and values expanded per head from one latent of this width; num_kv_heads must then
    equal num_heads and head_dim is unused (the qk_*/v_head_dim keys say the widths). 0: GQA."""
    q_lora_rank: int = 0
    """MLA: width of the compressed query (q_a_proj, q_a_layernorm, q_b_proj; DeepSeek-V3: 1536);
    0: one q_proj (DeepSeek-V2-Lite)."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query and key channels without RoPE."""
    qk_rope_head_dim: int = 64
    """MLA: per-head query and key channels with RoPE (the key's are one set shared by all
    heads)."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the output head's weight with the token embedding: for small vocab-dominated models or
    a checkpoint that ties them; not supported with parallel.tp > 1 or loss depths spread over
    pipeline stages."""
    max_seq_len: int = 4096
    """Longest position RoPE tables are built for (training window plus decode budget)."""
    init_std: float = 0.02
    """Std of the normal initialisation of linear and embedding weights."""
    init_from: str = ""
    """Initialise weights from a Hugging Face directory or a Tandem checkpoint (fine-tuning)."""
    layer_types: List[str] = field(default_factory=list)
    """Token mixer of each trunk layer: `attention` (full causal GQA), `linear_attention` (Gated
    DeltaNet) or `indexed_attention` (QSA sparse attention). Empty: every layer `attention`, unless
    `full_attention_interval` is set."""
    full_attention_interval: int = 0
    """With `layer_types` empty and n > 0: layers n, 2n, ... (1-based) are `indexed_attention`, the
    others `linear_attention` (Qwen3-Next / Qwen4-Exp's hybrid schedule)."""
    zero_centered_norm: bool = False
    """RMSNorm weights hold w - 1 (output x_hat * (1 + w), initialised to 0), as Qwen3-Next /
    Qwen4-Exp."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert's SwiGLU; 0 means num_shared_experts x moe_intermediate_size."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(shared_expert_gate(x)) (Qwen3-Next /
    Qwen4-Exp)."""
    linear_num_key_heads: int = 2
    """Gated DeltaNet query/key heads."""
    linear_num_value_heads: int = 4
    """Gated DeltaNet value heads (a multiple of linear_num_key_heads; each q/k head serves a
    group)."""
    linear_key_head_dim: int = 32
    """Gated DeltaNet query/key head width."""
    linear_value_head_dim: int = 32
    """Gated DeltaNet value head width."""
    linear_conv_kernel: int = 4
    """Width of Gated DeltaNet's causal depthwise convolution over q, k and v."""
    linear_gate_act: str = "silu"
    """Activation of Gated DeltaNet's output gate: `silu` or `sigmoid` (transformers'
    output_gate_type)."""
    linear_kernel: str = "auto"
    """Gated DeltaNet kernels: `torch` (pure PyTorch, every device), `fla` (flash-linear-attention's
    CUDA kernels; an error when not installed) or `auto` (fla on CUDA when installed, else torch).
    Keep `auto`; set `torch` to compare against the reference form, `fla` to fail loudly where it is
    missing."""
    indexer_heads: int = 4
    """QSA indexer query heads (the indexer has one key head)."""
    indexer_head_dim: int = 32
    """QSA indexer head width (must hold the attention's rotary width)."""
    indexer_budget: int = 64
    """QSA: tokens each query may select from complete compressed blocks (budget / ratio blocks)."""
    indexer_compress_ratio: int = 4
    """QSA: consecutive tokens averaged into one indexer block key."""
    qsa_form: str = "auto"
    """QSA training form (same outputs either way): `mask` (masked dense attention, O(S^2) memory;
    fast for short windows), `gather` (attends over the gathered selected tokens, O(S x budget);
    long windows) or `auto` (gather when the mask would be large): keep `auto` unless measuring one
    form."""
    indexer_loss_coef: float = 1.0
    """Weight of the QSA indexer's KL loss (DeepSeek-V3.2: the indexer learns the main attention's
    head-summed distribution); 0 disables it. Logged as `loss/indexer`."""
    indexer_warmup_steps: int = 0
    """QSA dense warm-up: the first N training steps (of the run's first global batch: the warm-up
    follows consumed samples, as the LR does) attend densely while the indexers learn by their KL
    over every visible block; afterwards attention is sparse and the KL covers the selected blocks
    only. With `model.init_from` (whose indexers come trained) 0 unless the recipe's own sections
    or the overrides set it, or the drafter starts fresh (no MTP weights to load: its indexer is
    warmed up)."""
    indexer_warmup: str = "auto"
    """What trains during the dense warm-up. `joint`: every parameter (the indexer by its KL alone,
    its input detached), for a model trained from scratch, whose first steps would otherwise be
    thrown away while the indexer imitates a random network's attention. `indexer_only`: only the
    indexers (DeepSeek-V3.2's recipe), for continued pretraining of a dense-trained trunk. `auto`:
    indexer_only when `model.init_from` brings a trunk, joint otherwise."""
    hc_count: int = 1
    """Residual streams (hyper-connections, Qwen4-Exp); 1 is the plain residual."""
    hc_lowrank: int = 32
    """Rank of each hyper-connection's input mixer."""
    ple_layers: List[int] = field(default_factory=list)
    """Trunk layers (0-based) with PLE n-gram memory (transformers' one-based `ple_layer_ids` minus
    1); only `linear_attention` layers may carry it."""
    ple_embed_dim: int = 0
    """Width of each PLE layer's concatenated n-gram embedding; 0 means hidden_size."""
    ple_conv_kernel: int = 4
    """Kernel of PLE's dilated depthwise convolution (dilation = ngram_size)."""
    ngram_size: int = 3
    """Largest token n-gram PLE hashes (orders 2..ngram_size)."""
    heads_per_ngram: int = 8
    """Independently hashed PLE heads per n-gram order."""
    ngram_vocab_base: int = 20_000_000
    """Each PLE head's table has a distinct prime number of rows above this base."""
    ngram_vocab_multiple: int = 128
    """The concatenated PLE table is padded to a multiple of this."""
    ngram_seed: int = 1234
    """Seed of PLE's per-layer hash multipliers (splitmix64)."""
    eos_token_id: int = -1
    """End-of-document token: PLE's n-grams never reach across it (-1: unset; required with PLE)."""
    expert_matmul: str = "auto"
    """Routed experts' matmuls: `grouped` (one `torch._grouped_mm` per projection, torch_npu's
    `npu_grouped_matmul` on Ascend; counts stay on the device), `loop` (one matmul per expert; needs
    the counts on the host) or `auto` (grouped where the device/dtype/shapes support it, else loop).
    Numerics agree to rounding; weights are the same. Keep `auto` (`moe/expert_path` in
    metrics.jsonl says which ran); `grouped` makes a missing kernel an error, `loop` is the
    reference to compare against."""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.num_experts > 0 and layer_index >= self.first_k_dense

    @property
    def resolved_indexer_warmup(self) -> str:
        """`indexer_warmup` with `auto` resolved: indexer_only when init_from brings a trained
        trunk."""
        if self.indexer_warmup != "auto":
            return self.indexer_warmup
        return "indexer_only" if self.init_from else "joint"

    def layer_type(self, layer_index: int) -> str:
        """The token mixer of trunk layer `layer_index` (see `layer_types`)."""
        if self.layer_types:
            return self.layer_types[layer_index]
        if self.full_attention_interval > 0:
            return (
                "indexed_attention"
                if (layer_index + 1) % self.full_attention_interval == 0
                else "linear_attention"
            )
        return "attention"

    @property
    def resolved_shared_expert_size(self) -> int:
        return self.shared_expert_intermediate_size or (self.moe_intermediate_size
                                                        * self.num_shared_experts)

    @property
    def resolved_ple_embed_dim(self) -> int:
        return self.ple_embed_dim or self.hidden_size

    @property
    def computes_aux_loss(self) -> bool:
        """Whether a MoE layer's training forward adds the balance or z loss (`balance=aux_loss`
        with a positive coefficient, or a positive z_loss_coef)."""
        return (self.balance == "aux_loss" and self.aux_loss_coef > 0) or self.z_loss_coef > 0

    @property
    def rope_rule(self) -> Optional[Yarn | Llama3Rope]:
        """The RoPE scaling's parameters (rope_scaling), None for plain RoPE."""
        if self.rope_scaling == "llama3":
            return Llama3Rope(self.rope_factor, self.rope_original_max_len,
                              self.rope_low_freq_factor, self.rope_high_freq_factor)
        if self.rope_scaling != "yarn":
            return None
        return Yarn(self.rope_factor, self.rope_original_max_len, self.rope_beta_fast,
                    self.rope_beta_slow, self.rope_mscale, self.rope_mscale_all_dim)

    @property
    def uses_head_dim(self) -> bool:
        """Whether some layer's heads are head_dim wide: GQA attention or QSA (not MLA, whose widths
        are the qk_*/v_head_dim keys)."""
        return not self.kv_lora_rank or self.uses_qsa

    @property
    def uses_qsa(self) -> bool:
        return any(self.layer_type(i) == "indexed_attention" for i in range(self.num_layers))

    def validate(self) -> None:
        """Raise ValueError naming the offending `model.*` key for an impossible trunk shape or
        choice (`load_config` runs it with the other sections' checks, before any work)."""
        positive = {
            "model.vocab_size": self.vocab_size,
            "model.hidden_size": self.hidden_size,
            "model.num_layers": self.num_layers,
            "model.num_heads": self.num_heads,
            "model.num_kv_heads": self.num_kv_heads,
            "model.intermediate_size": self.intermediate_size,
            "model.max_seq_len": self.max_seq_len,
            "model.rope_theta": self.rope_theta,
            "model.rms_norm_eps": self.rms_norm_eps,
        }
        for key, value in positive.items():
            if not 0 < value < float("inf"):
                raise ValueError(f"{key} must be positive and finite, got {value}")
        if not self.init_std >= 0:
            raise ValueError(f"model.init_std must be >= 0, got {self.init_std}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                             f"model.num_heads={self.num_heads}")
        if self.head_dim < 0:
            raise ValueError(f"model.head_dim must be >= 0, got {self.head_dim}")
        # (MLA's widths are its own: _validate_attention)
        if self.uses_head_dim and not self.head_dim and self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_heads={self.num_heads}; set model.head_dim")
        factor, head = self.partial_rotary_factor, self.resolved_head_dim  # range first: int(inf)
        if not 0.0 < factor <= 1.0 or self.uses_head_dim and int(head * factor) % 2:
            raise ValueError(f"model.partial_rotary_factor={factor} must give an even rotary width "
                             "in (0, head_dim]")
        if self.num_experts < 0:
            raise ValueError(f"model.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            _validate_moe(self)
        if self.expert_matmul not in ("auto", "grouped", "loop"):
            raise ValueError("model.expert_matmul must be 'auto', 'grouped' or 'loop', got "
                             f"{self.expert_matmul!r}")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ValueError("model.router_score must be 'softmax' or 'sigmoid', got "
                             f"{self.router_score!r}")
        if self.balance not in ("aux_free", "aux_loss", "none"):
            raise ValueError("model.balance must be 'aux_free', 'aux_loss' or 'none', got "
                             f"{self.balance!r}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"model.first_k_dense must be in [0, model.num_layers="
                             f"{self.num_layers}], got {self.first_k_dense}")
        _validate_hybrid(self)
        _validate_attention(self)


def _validate_moe(model: ModelConfig) -> None:
    """The routed experts' sizes, grouping and loss weights (model.num_experts > 0)."""
    for key in ("num_shared_experts", "shared_expert_intermediate_size", "aux_loss_coef",
                "z_loss_coef", "bias_update_rate"):
        if not 0 <= getattr(model, key) < float("inf"):
            raise ValueError(f"model.{key} must be >= 0 and finite, got {getattr(model, key)}")
    for key in ("moe_intermediate_size", "n_group", "routed_scaling_factor"):
        if not 0 < getattr(model, key) < float("inf"):
            raise ValueError(f"model.{key} must be positive and finite, got {getattr(model, key)}")
    if model.shared_expert_gate and not model.num_shared_experts:
        raise ValueError("model.shared_expert_gate=true gates the shared expert, but "
                         "model.num_shared_experts=0 builds none")
    if not 0 < model.top_k <= model.num_experts:
        raise ValueError(f"model.top_k={model.top_k} must be in [1, "
                         f"model.num_experts={model.num_experts}]")
    if model.num_experts % model.n_group:
        raise ValueError(f"model.n_group={model.n_group} must divide "
                         f"model.num_experts={model.num_experts}")
    if not 0 < model.topk_group <= model.n_group:
        raise ValueError(f"model.topk_group={model.topk_group} must be in [1, "
                         f"model.n_group={model.n_group}]")
    if model.n_group > 1 and model.top_k > model.topk_group * (model.num_experts // model.n_group):
        raise ValueError("model.top_k exceeds the experts reachable in model.topk_group groups")


def _validate_attention(model: ModelConfig) -> None:
    """MLA's widths and the RoPE scaling's parameters."""
    scaling = model.rope_scaling
    if scaling not in ("none", "yarn", "llama3"):
        raise ValueError(f"model.rope_scaling must be 'none', 'yarn' or 'llama3', got {scaling!r}")
    if scaling != "none":
        yarn = scaling == "yarn"
        if not (model.rope_factor >= 1 and model.rope_original_max_len > 0 and (
                model.rope_beta_fast >= model.rope_beta_slow > 0 and model.rope_mscale >= 0
                and model.rope_mscale_all_dim >= 0 if yarn
                else 0 < model.rope_low_freq_factor < model.rope_high_freq_factor)):
            raise ValueError(f"model.rope_scaling={scaling} needs rope_factor >= 1, "
                             "rope_original_max_len > 0, " + (
                                 "rope_beta_fast >= rope_beta_slow > 0 and mscales >= 0" if yarn
                                 else "0 < rope_low_freq_factor < rope_high_freq_factor"))
        if model.uses_qsa:
            raise ValueError(f"model.rope_scaling={scaling}: QSA (indexed_attention) layers use "
                             "plain RoPE")
    if model.kv_lora_rank < 0 or model.q_lora_rank < 0:
        raise ValueError("model.kv_lora_rank and model.q_lora_rank must be >= 0")
    if not model.kv_lora_rank:
        if model.q_lora_rank:
            raise ValueError("model.q_lora_rank is an MLA width; set model.kv_lora_rank too")
        return
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(model, key) <= 0:
            raise ValueError(f"model.{key} must be positive with MLA, got {getattr(model, key)}")
    if model.qk_rope_head_dim % 2:
        raise ValueError(f"model.qk_rope_head_dim={model.qk_rope_head_dim} must be even (RoPE "
                         "rotates pairs)")
    if model.num_kv_heads != model.num_heads:
        raise ValueError(f"model.num_kv_heads={model.num_kv_heads} must equal model.num_heads="
                         f"{model.num_heads} with MLA (model.kv_lora_rank > 0): every head has "
                         "its own keys")
    if model.attention_bias or model.qk_norm or model.partial_rotary_factor != 1.0:
        raise ValueError("MLA (model.kv_lora_rank > 0) takes no model.attention_bias, "
                         "model.qk_norm or model.partial_rotary_factor (its checkpoints have none)")


LAYER_TYPES = ("attention", "linear_attention", "indexed_attention")

HYBRID_CHOICES = {"linear_gate_act": ("silu", "sigmoid"), "linear_kernel": ("auto", "torch", "fla"),
                  "qsa_form": ("auto", "mask", "gather"),
                  "indexer_warmup": ("auto", "joint", "indexer_only")}
"""The hybrid layers' keys that name a choice: checked whatever the layer types, so a misspelt one
fails in every recipe, not only once a layer that reads it is added."""


def _validate_hybrid(model: ModelConfig) -> None:
    """The Qwen4-Exp invariants transformers validates, named by our keys, before any work."""
    if model.layer_types and len(model.layer_types) != model.num_layers:
        raise ValueError(f"model.layer_types has {len(model.layer_types)} entries but "
                         f"model.num_layers={model.num_layers}")
    bad = sorted(set(model.layer_types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"model.layer_types has unknown entries {bad}; each must be one of "
                         f"{', '.join(LAYER_TYPES)}")
    if model.full_attention_interval < 0:
        raise ValueError("model.full_attention_interval must be >= 0, got "
                         f"{model.full_attention_interval}")
    if model.hc_count < 1:
        raise ValueError("model.hc_count must be >= 1 (1 = plain residual; hyper-connections need "
                         "> 1), got "
                         f"{model.hc_count}")
    if model.hc_count > 1 and model.hc_lowrank <= 0:
        raise ValueError(f"model.hc_lowrank must be positive with model.hc_count={model.hc_count}, "
                         "got "
                         f"{model.hc_lowrank}")
    for key, choices in HYBRID_CHOICES.items():
        if getattr(model, key) not in choices:
            raise ValueError(f"model.{key}={getattr(model, key)!r} must be one of "
                             f"{', '.join(choices)}")
    types = [model.layer_type(i) for i in range(model.num_layers)]
    if "linear_attention" in types:
        _validate_linear_attention(model)
    if "indexed_attention" in types:
        _validate_indexed_attention(model)
    if model.ple_layers:
        _validate_ple(model, types)


def _validate_linear_attention(model: ModelConfig) -> None:
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel"):
        if getattr(model, key) <= 0:
            raise ValueError(f"model.{key} must be positive, got {getattr(model, key)}")
    if model.linear_num_value_heads % model.linear_num_key_heads:
        raise ValueError(f"model.linear_num_key_heads={model.linear_num_key_heads} must divide "
                         f"model.linear_num_value_heads={model.linear_num_value_heads}")


def _validate_indexed_attention(model: ModelConfig) -> None:
    for key in ("indexer_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"):
        if getattr(model, key) <= 0:
            raise ValueError(f"model.{key} must be positive, got {getattr(model, key)}")
    if model.indexer_budget % model.indexer_compress_ratio:
        raise ValueError(f"model.indexer_budget={model.indexer_budget} must be divisible by "
                         f"model.indexer_compress_ratio={model.indexer_compress_ratio}")
    rot = int(model.resolved_head_dim * model.partial_rotary_factor)
    if rot > model.indexer_head_dim:
        raise ValueError(f"model.indexer_head_dim={model.indexer_head_dim} must hold the "
                         "attention's rotary width "
                         f"{rot} (head_dim x partial_rotary_factor)")
    if not (model.indexer_loss_coef >= 0 and model.indexer_warmup_steps >= 0):  # NaN fails too
        raise ValueError("model.indexer_loss_coef and model.indexer_warmup_steps must be >= 0")


def _validate_ple(model: ModelConfig, types: List[str]) -> None:
    if model.hc_count <= 1:
        raise ValueError("model.ple_layers needs hyper-connections (model.hc_count > 1), got "
                         f"hc_count={model.hc_count}")
    if model.ngram_size < 2 or model.heads_per_ngram < 1:
        raise ValueError(f"model.ngram_size={model.ngram_size} must be >= 2 (PLE hashes orders "
                         f"2..n) and model.heads_per_ngram={model.heads_per_ngram} >= 1")
    ngram_heads = (model.ngram_size - 1) * model.heads_per_ngram
    if model.resolved_ple_embed_dim % ngram_heads:
        raise ValueError(f"model.ple_embed_dim={model.resolved_ple_embed_dim} must be a positive "
                         "multiple of the "
                         f"{ngram_heads} n-gram heads ((model.ngram_size - 1) x "
                         "model.heads_per_ngram)")
    if list(model.ple_layers) != sorted(set(model.ple_layers)):
        # each layer's table (its hash seed and prime sizes) is numbered in this order, which
        # transformers' qwen4_exp sorts
        raise ValueError(f"model.ple_layers={list(model.ple_layers)} must be increasing, without "
                         "repeats")
    for i in model.ple_layers:
        if not 0 <= i < model.num_layers:
            raise ValueError(f"model.ple_layers entry {i} is not a trunk layer (0-based, < "
                             f"{model.num_layers})")
        if types[i] != "linear_attention":
            raise ValueError("model.ple_layers: PLE is only supported on linear_attention layers, "
                             f"layer {i} is "
                             f"{types[i]}")
    if model.eos_token_id < 0:
        raise ValueError("model.eos_token_id must be set when model.ple_layers is not empty (PLE "
                         "n-grams stop at "
                         "it)")
    if model.ple_conv_kernel <= 0 or model.ngram_vocab_base <= 1 or model.ngram_vocab_multiple <= 0:
        raise ValueError("model.ple_conv_kernel, model.ngram_vocab_base and "
                         "model.ngram_vocab_multiple must be "
                         "positive")
