"""Size a recipe before launching it: FLOPs per token, exact parameter counts and a per-rank memory
estimate.

FLOPs (matmul FLOPs, 2 per multiply-add, per token of a training window of S tokens; norms,
activations and elementwise products are not counted) per layer kind, forward:
- attention: 2H(q + 2kv) + 2qH projections + 4q(S/2) causal QK^T and AV (q = heads x head_dim, kv = kv
  heads x head_dim);
- QSA (indexed attention): projections 2H(2q) (query + gate) + 4H kv + 2qH + the indexer's 2H(I+1)D_i,
  block scores 2 I D_i x (complete blocks visible, S/(2r) on average) and attention over the selected
  tokens only: 4q x (mean keys a query attends, min(t+1, budget + the incomplete tail) averaged over
  the window), not over the full sequence. Training with the indexer's KL adds a no-grad dense QK^T
  of every head over the window (2qS; `qsa_indexer_target_flops`): a real cost of the step (counted
  by `parallel.pp_balance`), not a model FLOP (left out of MFU, as recomputation is);
- Gated DeltaNet: projections 2H(2K + V) + 2HV + 4H n_v + 2VH (K = key heads x d_k, V = value heads x
  d_v), the causal conv 2(2K + V) x kernel, and the chunked delta rule per value head,
  6C d_k + 4C d_v + 6 d_k d_v + 2C^2/3 with C = 64 the chunk (intra-chunk K K^T, q K^T, the two WY
  products and A V, the carried state's three products, the triangular inverse as fla computes it;
  the pure-PyTorch CPU path inverts by doubling, 4C^2(log2 C - 1), which is not counted);
- hyper-connections (X = hc_count x H streams, rank R): a block's two mixers 2 x (4XR + 2X hc), the
  final mixer (the norm of the trunk and of each MTP layer) 4XR;
- PLE: 2E(X + H) for its key and value projections (E = ple_embed_dim) + 2X x conv kernel; the n-gram
  lookup is a gather;
- MLP 6H I; MoE 2H n_experts (router) + top_k x 6H I_e + 6H I_shared (+ 2H with the shared gate);
- the qwen4_exp drafter's combine 2H^2 (fc_embedding) + 2H^2 hc (fc_hidden on every stream); the
  concat_proj combine 4H^2; a vocabulary head 2HV.
Model FLOPs (`training_flops_per_token`, what MFU counts): 3x the forward (forward + backward), the
head included, over each depth's share of valid targets (S - d of S). Hardware FLOPs
(`hardware_flops_per_token`, what the step executes: HFU and the step-time-over-FLOPs benches) add
recomputation: each head 4x (its logits are recomputed in backward), the QSA indexer KL's dense
target, and under `train.activation_checkpointing=full` one more forward of every block (`selective`
keeps the matmul and attention outputs, so what it recomputes is not counted).

Parameters: `layer_params` counts each trunk layer's parameters by kind from the config (tested
against the modules on the meta device); `estimate` counts them exactly from the model built on the
meta device (no memory). Memory per rank for the recipe's layout is an estimate:
- model states: fp32 parameter + fp32 gradient + two fp32 AdamW moments = 16 bytes per parameter this
  rank owns (with train.freeze_trunk only the MTP module's; the frozen trunk costs 2 or 4 bytes per
  parameter, train.frozen_dtype, and keeps no activations), summed over the parameters of the pp rank
  holding the most: routed experts split over ep and tp and FSDP-sharded over dp; the PLE n-gram table
  split by rows over the stage's dp x ep x tp ranks (trainer/parallel/tensor_hybrid.py, out of FSDP:
  never gathered); everything else split over tp and FSDP-sharded over dp x ep. The table is trained by
  the same dense AdamW as every other parameter, over those shards: every row's moments live (and are
  updated) every step;
- FSDP's gathered copies (compute dtype: bf16 under mixed precision): the rank's two largest layers
  (one gathered, the next prefetched; a PLE layer without its table) and the root pieces (embedding,
  head, final norm, MTP module), kept gathered through the step;
- FSDP's gradient buffers of the root group (embedding, head, final norm and the MTP module's own
  parameters: `root_grad_bytes`): their unsharded gradients (compute dtype) live from the head's
  backward, the first, to the group's reduce-scatter at the end of each micro-batch's backward, whose
  input (reduce dtype) is then added where it exceeds the activations it follows. A block's own
  buffers (one layer's) are left out;
- with several micro-batches per step and `parallel.reshard_after_microbatch=false` (one gradient
  sync per step, in the last micro-batch's backward; torch's pipeline stages did so before the option),
  `single_sync_bytes`: from the first backward to that sync every FSDP-managed parameter of the rank
  holds its unsharded fp32 gradient (in place of its sharded one: + 4 bytes x (unsharded - owned)) and
  its gathered copy (compute dtype; beyond the two layers above). Without a pipeline the copies stand
  between micro-batches, when the activations are freed (the next forward reshards them as it goes),
  so they count only where they exceed the activations; a pipeline stage holds them while other
  micro-batches' activations are in flight (counted in full). Under dp_mode=allreduce the gradients
  are whole either way and only the copies count. The default (a reduce-scatter and reshard after
  every micro-batch) adds nothing to the figures above;
- the PLE lookup (`ple_lookup_bytes`), transient, one micro-batch: the hashed ids and their sort by
  owner, the rows exchanged both ways (fp32 looked up, sent in the compute dtype) and the tp gather of
  the rows (the backward adds the rows' gradients into the table's gradient in place: no dense copy);
- activations (bf16 on accelerators): about 34 * s * b * h / tp bytes per transformer layer per
  micro-batch in flight (Korthikanti et al. 2022, SDPA/flash attention, no s^2 term) plus, with
  hyper-connections, the four hc x H-wide tensors each of a block's two mixers keeps for backward (its
  input, the grouped norm's output, the sigmoid mixing weights and the weighted streams; 4.5 measured
  on the module in fp32): 16 * hc * s * b * h / tp; with up to `pp` micro-batches in flight on the
  first stage under 1F1B; the last stage adds the K MTP depths and one chunk of logits. Gated
  DeltaNet's and QSA's own activations are taken as an attention layer's (not modelled separately).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

from tandem.models import MTPConfig, ModelConfig, TandemModel

from .config import TandemConfig

GIB = 2**30
GDN_CHUNK = 64
"""Gated DeltaNet's chunk length (models/gated_deltanet.py CHUNK; fla uses the same)."""


# --- FLOPs per token (forward) -----------------------------------------------------------------------
def _attention_forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 2 * q * (seq_len / 2)  # projections + causal QK^T and AV


def qsa_mean_blocks(cfg: ModelConfig, seq_len: int) -> float:
    """Mean number of complete indexer blocks visible to a query of the window (what it scores)."""
    r, s = cfg.indexer_compress_ratio, seq_len
    q, rem = divmod(s, r)
    return (r * q * (q - 1) / 2 + q * (rem + 1)) / s  # sum over u = t + 1 of floor(u / r)


def qsa_mean_keys(cfg: ModelConfig, seq_len: int) -> float:
    """Mean number of tokens a query attends to: every visible token until budget / ratio complete
    blocks exist, then the budget plus the incomplete tail block."""
    r, budget, s = cfg.indexer_compress_ratio, cfg.indexer_budget, seq_len
    first = min(s, budget + r - 1)  # u = t + 1 < budget + r: every visible token
    total = first * (first + 1) / 2
    n2 = max(0, s - (budget + r) + 1)  # u >= budget + r: budget + (u mod r), u mod r cycling from 0
    full, rem = divmod(n2, r)
    total += n2 * budget + full * r * (r - 1) / 2 + rem * (rem - 1) / 2
    return total / s


def qsa_forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    """QSA: projections (query + gate, k, v, o, the indexer's I query heads and one key head), the
    indexer's block scores and attention over the selected tokens."""
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    i, di = cfg.indexer_heads, cfg.indexer_head_dim
    proj = 2 * h * 2 * q + 2 * h * 2 * kv + 2 * q * h + 2 * h * (i + 1) * di
    return proj + 2 * i * di * qsa_mean_blocks(cfg, seq_len) + 2 * 2 * q * qsa_mean_keys(cfg, seq_len)


def qsa_indexer_target_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Per token, the indexer KL's target: every head's dense QK^T over the window, no grad (training
    only, with model.indexer_loss_coef > 0)."""
    return 2 * cfg.num_heads * cfg.resolved_head_dim * seq_len if cfg.indexer_loss_coef > 0 else 0.0


def gdn_forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Gated DeltaNet: projections, the causal depthwise conv and the chunked gated delta rule."""
    h, nv, dk, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd, vd = cfg.linear_num_key_heads * dk, nv * dv
    proj = 2 * h * (2 * kd + vd) + 2 * h * vd + 2 * h * 2 * nv + 2 * vd * h
    conv = 2 * (2 * kd + vd) * cfg.linear_conv_kernel
    c = GDN_CHUNK
    rule = nv * (6 * c * dk + 4 * c * dv + 6 * dk * dv + 2 * c * c / 3)
    return proj + conv + rule


def mixer_forward_flops(cfg: ModelConfig, kind: str, seq_len: int) -> float:
    """Forward FLOPs per token of a token mixer (`attention`, `indexed_attention`, `linear_attention`)."""
    if kind == "indexed_attention":
        return qsa_forward_flops(cfg, seq_len)
    if kind == "linear_attention":
        return gdn_forward_flops(cfg, seq_len)
    return _attention_forward_flops(cfg, seq_len)


def hyper_connection_flops(cfg: ModelConfig, combine: bool = True) -> float:
    """One HyperConnection: the low-rank mixer down and up (+ the injection weights unless it is a
    final mixer). 0 without hyper-connections."""
    if cfg.hc_count <= 1:
        return 0.0
    x = cfg.hc_count * cfg.hidden_size
    return 4 * x * cfg.hc_lowrank + (2 * x * cfg.hc_count if combine else 0)


def final_norm_forward_flops(cfg: ModelConfig) -> float:
    """The head's input norm: an RMSNorm (0), or the final stream mixer with hyper-connections."""
    return hyper_connection_flops(cfg, combine=False)


def ple_forward_flops(cfg: ModelConfig) -> float:
    """PLE: key and value projections of the n-gram embedding and the dilated depthwise conv."""
    x, h, e = cfg.hc_count * cfg.hidden_size, cfg.hidden_size, cfg.resolved_ple_embed_dim
    return 2 * e * (x + h) + 2 * x * cfg.ple_conv_kernel


def _mlp_forward_flops(cfg: ModelConfig, moe: bool) -> float:
    h = cfg.hidden_size
    if not moe:
        return 3 * 2 * h * cfg.intermediate_size
    routed = cfg.top_k * 3 * 2 * h * cfg.moe_intermediate_size
    shared = 3 * 2 * h * cfg.resolved_shared_expert_size if cfg.num_shared_experts > 0 else 0
    gate = 2 * h if cfg.shared_expert_gate and cfg.num_shared_experts > 0 else 0
    return 2 * h * cfg.num_experts + routed + shared + gate


def layer_forward_flops(cfg: ModelConfig, moe: bool, seq_len: int, kind: str = "attention", ple: bool = False) -> float:
    """Forward FLOPs per token of one block: its token mixer, MLP or MoE, hyper-connections, PLE."""
    out = mixer_forward_flops(cfg, kind, seq_len) + _mlp_forward_flops(cfg, moe) + 2 * hyper_connection_flops(cfg)
    return out + (ple_forward_flops(cfg) if ple else 0.0)


def trunk_layer_forward_flops(cfg: ModelConfig, index: int, seq_len: int) -> float:
    """Forward FLOPs per token of trunk layer `index`."""
    return layer_forward_flops(cfg, cfg.is_moe_layer(index), seq_len, cfg.layer_type(index), index in cfg.ple_layers)


def trunk_layer_training_flops(cfg: ModelConfig, index: int, seq_len: int) -> float:
    """Training FLOPs per token of trunk layer `index`: 3x its forward, plus the QSA indexer KL's
    no-grad target (what a pipeline stage spends; MFU counts the 3x forward only)."""
    extra = qsa_indexer_target_flops(cfg, seq_len) if cfg.layer_type(index) == "indexed_attention" else 0.0
    return 3 * trunk_layer_forward_flops(cfg, index, seq_len) + extra


def mtp_kind(cfg: ModelConfig) -> str:
    """The MTP blocks' token mixer: QSA when the trunk has it, else full attention (never PLE)."""
    return "indexed_attention" if cfg.uses_qsa else "attention"


def mtp_layer_forward_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one MTP step's layer: the looped style's input combination, the block
    and its final norm (the head itself is `head_forward_flops`)."""
    h = cfg.hidden_size
    combine = 0.0
    if mtp.style == "looped":
        if mtp.resolved_combine(cfg) == "qwen4_exp":
            combine = 2 * h * h + 2 * h * h * cfg.hc_count  # fc_embedding once, fc_hidden on every stream
        else:
            combine = 2 * 2 * h * h  # eh_proj over cat(emb, h)
    block = layer_forward_flops(cfg, mtp.moe and cfg.num_experts > 0, seq_len, mtp_kind(cfg))
    return block + combine + final_norm_forward_flops(cfg)


def mtp_layer_training_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> float:
    extra = qsa_indexer_target_flops(cfg, seq_len) if mtp_kind(cfg) == "indexed_attention" else 0.0
    return 3 * mtp_layer_forward_flops(cfg, mtp, seq_len) + extra


def head_forward_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one vocabulary head."""
    return 2 * cfg.hidden_size * cfg.vocab_size


def forward_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> tuple[float, float]:
    """(forward FLOPs per token of all transformer layers incl. MTP and the trunk's final norm,
    forward FLOPs of one head)."""
    layers = sum(trunk_layer_forward_flops(cfg, i, seq_len) for i in range(cfg.num_layers))
    layers += final_norm_forward_flops(cfg)
    layers += mtp.num_steps * mtp_layer_forward_flops(cfg, mtp, seq_len)
    return layers, head_forward_flops(cfg)


def _valid_fraction(mtp: MTPConfig, seq_len: int) -> float:
    """Targets per window token summed over the depths: depth d has S - d targets per window."""
    return sum((seq_len - d) / seq_len for d in range(1 + mtp.num_steps))


def training_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> float:
    """Model FLOPs per trained token, forward + backward (3x the forward, heads included, no
    recomputation): MFU's."""
    layers, head = forward_flops_per_token(cfg, mtp, seq_len)
    return 3 * (layers + head * _valid_fraction(mtp, seq_len))


def hardware_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int, activation_checkpointing: str = "none") -> float:
    """FLOPs per trained token the step executes: the model FLOPs plus each head's recomputed logits
    (4x its forward), the QSA indexer KL's no-grad dense target, and under full activation
    checkpointing a second forward of every trunk and MTP block (the target included): HFU's."""
    layers, head = forward_flops_per_token(cfg, mtp, seq_len)
    trunk_extra = sum(trunk_layer_training_flops(cfg, i, seq_len) - 3 * trunk_layer_forward_flops(cfg, i, seq_len)
                      for i in range(cfg.num_layers))
    mtp_extra = mtp.num_steps * (mtp_layer_training_flops(cfg, mtp, seq_len) - 3 * mtp_layer_forward_flops(cfg, mtp, seq_len))
    out = 3 * layers + 4 * head * _valid_fraction(mtp, seq_len) + trunk_extra + mtp_extra
    if activation_checkpointing == "full":
        mtp_block = layer_forward_flops(cfg, mtp.moe and cfg.num_experts > 0, seq_len, mtp_kind(cfg))
        out += (sum(trunk_layer_forward_flops(cfg, i, seq_len) for i in range(cfg.num_layers)) + trunk_extra
                + mtp.num_steps * mtp_block + mtp_extra)
    return out


def flops_by_kind(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> Dict[str, float]:
    """Forward FLOPs per token of each trunk layer kind present (one layer each, without its MLP),
    and of one MLP / MoE, for the --check breakdown."""
    out = {}
    for i in range(cfg.num_layers):
        kind = cfg.layer_type(i)
        name = {"attention": "attn", "indexed_attention": "qsa", "linear_attention": "gdn"}[kind]
        out.setdefault(name, mixer_forward_flops(cfg, kind, seq_len))
    if cfg.hc_count > 1:
        out["hc"] = 2 * hyper_connection_flops(cfg)
    if cfg.ple_layers:
        out["ple"] = ple_forward_flops(cfg)
    out["moe" if cfg.num_experts else "mlp"] = _mlp_forward_flops(cfg, cfg.num_experts > 0)
    return out


# --- parameters per layer (from the config) ---------------------------------------------------------
def _norm_params(cfg: ModelConfig) -> int:
    """A block's two norms (plain residual) or two hyper-connections (hc_norm, down, up, inject)."""
    if cfg.hc_count <= 1:
        return 2 * cfg.hidden_size
    x = cfg.hc_count * cfg.hidden_size
    return 2 * (x + 2 * x * cfg.hc_lowrank + x * cfg.hc_count)


def final_norm_params(cfg: ModelConfig) -> int:
    if cfg.hc_count <= 1:
        return cfg.hidden_size
    x = cfg.hc_count * cfg.hidden_size
    return x + 2 * x * cfg.hc_lowrank


def mixer_params(cfg: ModelConfig, kind: str) -> int:
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    if kind == "indexed_attention":
        i, di = cfg.indexer_heads, cfg.indexer_head_dim
        return h * 2 * q + 2 * h * kv + q * h + 2 * hd + h * (i + 1) * di + 2 * di
    if kind == "linear_attention":
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, nv * dv
        conv = 2 * kd + vd
        return h * conv + h * vd + 2 * h * nv + conv * cfg.linear_conv_kernel + 2 * nv + dv + vd * h
    bias = q + 2 * kv if cfg.attention_bias else 0
    return h * (q + 2 * kv) + q * h + bias + (2 * hd if cfg.qk_norm else 0)


def mlp_params(cfg: ModelConfig, moe: bool) -> Dict[str, int]:
    """{"dense": ..., "experts": routed expert parameters}."""
    h = cfg.hidden_size
    if not moe:
        return {"dense": 3 * h * cfg.intermediate_size, "experts": 0}
    shared = 3 * h * cfg.resolved_shared_expert_size if cfg.num_shared_experts > 0 else 0
    gate = h if cfg.shared_expert_gate and cfg.num_shared_experts > 0 else 0
    return {"dense": cfg.num_experts * h + shared + gate,
            "experts": cfg.num_experts * 3 * h * cfg.moe_intermediate_size}


def ple_table_rows(cfg: ModelConfig, ple_index: int) -> int:
    """Rows of PLE layer `ple_index`'s n-gram table (distinct primes above the base, padded)."""
    from tandem.models.ple import ngram_tables

    return ngram_tables(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ngram_vocab_base,
                        cfg.ngram_vocab_multiple, cfg.ngram_seed, ple_index)[3]


def ple_params(cfg: ModelConfig, ple_index: int) -> Dict[str, int]:
    """{"dense": projections, norms and conv, "table": the n-gram embedding} of one PLE layer."""
    x, h, e = cfg.hc_count * cfg.hidden_size, cfg.hidden_size, cfg.resolved_ple_embed_dim
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    return {"dense": e * x + e * h + 3 * x + x * cfg.ple_conv_kernel,
            "table": ple_table_rows(cfg, ple_index) * (e // heads)}


def layer_params(cfg: ModelConfig, index: int) -> Dict[str, int]:
    """Trunk layer `index`'s parameters by kind: `mixer`, `mlp` (dense MLP, or the MoE's router, shared
    expert and its gate), `experts` (routed), `norms` (norms or hyper-connections), `ple`, `ple_table`."""
    mlp = mlp_params(cfg, cfg.is_moe_layer(index))
    out = {"mixer": mixer_params(cfg, cfg.layer_type(index)), "mlp": mlp["dense"], "experts": mlp["experts"],
           "norms": _norm_params(cfg), "ple": 0, "ple_table": 0}
    if index in cfg.ple_layers:
        ple = ple_params(cfg, cfg.ple_layers.index(index))
        out["ple"], out["ple_table"] = ple["dense"], ple["table"]
    return out


def mtp_layer_params(cfg: ModelConfig, mtp: MTPConfig) -> int:
    """One physical MTP layer: combine, block (the trunk's attention kind, no PLE) and its final norm."""
    h = cfg.hidden_size
    combine = 0
    if mtp.style == "looped":
        if mtp.resolved_combine(cfg) == "qwen4_exp":
            combine = h + cfg.hc_count * h + 2 * h * h
        else:
            combine = 2 * h + 2 * h * h
    mlp = mlp_params(cfg, mtp.moe and cfg.num_experts > 0)
    return combine + mixer_params(cfg, mtp_kind(cfg)) + mlp["dense"] + mlp["experts"] + _norm_params(cfg) \
        + final_norm_params(cfg)


@dataclass
class Estimate:
    total_params: int
    """Every parameter of trunk + MTP (tied embeddings counted once)."""
    expert_params: int
    """Routed-expert parameters (sharded over ep)."""
    active_params_per_token: int
    """Parameters a token touches in a forward (top-k routed experts only, the embedding included, the
    PLE n-gram tables not: a token reads a few rows of them)."""
    mtp_params: int
    """Parameters of the MTP module."""
    states_gib_per_rank: float
    """Parameters, gradients and AdamW moments held by one rank."""
    activations_gib_per_rank: float
    """Peak activations of one rank's pipeline stage."""
    gathered_gib_per_rank: float = 0.0
    """FSDP's unsharded copies: the rank's two largest layers (one gathered, the next prefetched; their
    tp/ep shards) and the root group (embedding, head, MTP module), kept gathered through the step."""
    grad_buffers_gib_per_rank: float = 0.0
    """FSDP's unsharded gradients of the root group (compute dtype) through each backward and their
    reduce-scatter input at its end (`root_grad_bytes`)."""
    accumulation_gib_per_rank: float = 0.0
    """What the one-sync-per-step mode (parallel.reshard_after_microbatch=false) holds beyond the above:
    unsharded fp32 gradients and gathered parameters between micro-batches (`single_sync_bytes`); 0 in
    the default mode, which syncs and reshards every micro-batch."""
    single_sync_gib_per_rank: float = 0.0
    """What parallel.reshard_after_microbatch=false would hold beyond the default mode's figures (equal
    to accumulation_gib_per_rank when that mode is set; 0 with one micro-batch or no data parallelism)."""
    ple_table_params: int = 0
    """PLE n-gram table parameters (every PLE layer's), part of total_params."""
    ple_states_gib_per_rank: float = 0.0
    """The PLE tables' share of the states of the pp rank holding them."""
    ple_lookup_gib_per_rank: float = 0.0
    """The PLE lookup's transient buffers on the rank holding a table (`ple_lookup_bytes`, the largest
    table's), part of the total."""
    ple_exchange_bytes: float = 0.0
    """Bytes one rank sends for one PLE table's lookup per micro-batch, forward and backward (ids, rows,
    their gradients, the tp gather); the table itself never moves."""
    ple_shard: str = ""
    """How the table is split, e.g. `1/16 = dp 2 x ep 4 x tp 2`."""
    train_flops_per_token: float = 0.0
    """Model FLOPs per trained token (`training_flops_per_token`, what MFU divides by)."""
    flops_by_kind: Dict[str, float] = None
    """Forward FLOPs per token of one layer's mixer of each kind, the block's hyper-connections, PLE and
    the MLP/MoE."""

    @property
    def total_gib_per_rank(self) -> float:
        return (self.states_gib_per_rank + self.activations_gib_per_rank + self.gathered_gib_per_rank
                + self.ple_lookup_gib_per_rank + self.grad_buffers_gib_per_rank + self.accumulation_gib_per_rank)

    def summary(self) -> str:
        out = (f"params total={self.total_params / 1e9:.3f}B active/token={self.active_params_per_token / 1e9:.3f}B "
               f"experts={self.expert_params / 1e9:.3f}B mtp={self.mtp_params / 1e6:.1f}M; per-rank memory "
               f"states={self.states_gib_per_rank:.1f} GiB activations={self.activations_gib_per_rank:.1f} GiB "
               f"gathered={self.gathered_gib_per_rank:.1f} GiB grad_buffers={self.grad_buffers_gib_per_rank:.1f} GiB "
               + (f"ple_lookup={self.ple_lookup_gib_per_rank:.1f} GiB " if self.ple_table_params else "")
               + (f"accumulation={self.accumulation_gib_per_rank:.1f} GiB " if self.accumulation_gib_per_rank else "")
               + f"total={self.total_gib_per_rank:.1f} GiB")
        if self.accumulation_gib_per_rank:
            out += ("\n  accumulation: unsharded fp32 gradients and gathered parameters held between micro-batches "
                    "(parallel.reshard_after_microbatch=false: one gradient sync per step); the default syncs and "
                    f"reshards every micro-batch and saves {_gib(self.accumulation_gib_per_rank)}")
        elif self.single_sync_gib_per_rank:
            out += (f"\n  parallel.reshard_after_microbatch=false (one gradient sync per step instead of one per "
                    f"micro-batch) would add {_gib(self.single_sync_gib_per_rank)} per rank")
        if self.ple_table_params:
            out += (f"\n  PLE n-gram table: {_count(self.ple_table_params)} params, sharded {self.ple_shard} "
                    f"(rows over the stage's ranks, out of FSDP, never gathered): per rank "
                    f"states={_gib(self.ple_states_gib_per_rank)} (fp32 param + grad + AdamW m, v: dense AdamW "
                    f"over the shards, every row every step) lookup={_gib(self.ple_lookup_gib_per_rank)} "
                    f"(ids, exchanged rows, the tp gather; one micro-batch) "
                    f"exchange={self.ple_exchange_bytes / 2**20:.1f} MiB sent per rank per micro-batch "
                    f"(forward + backward, all-to-alls over the stage's ranks and the tp gather); counted in "
                    f"the figures above for the pp rank holding it")
        if self.train_flops_per_token:
            kinds = " ".join(f"{k}={v / 1e6:.3g}M" for k, v in (self.flops_by_kind or {}).items())
            out += (f"\n  FLOPs/token: train={self.train_flops_per_token / 1e9:.4g} GFLOP (model FLOPs, MFU's); "
                    f"forward per layer: {kinds}")
        return out


def _gib(x: float) -> str:
    return f"{x:.2f} GiB" if x >= 0.05 else f"{x * 1024:.2f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def frozen_bytes(cfg: TandemConfig) -> int:
    """Bytes per parameter of a frozen trunk (train.frozen_dtype; `auto` = the compute dtype: bf16 on
    accelerators under train.dtype=auto, bf16 under train.dtype=bf16)."""
    choice = cfg.train.frozen_dtype
    if choice == "auto":
        return compute_bytes(cfg)
    return 2 if choice == "bf16" else 4


def compute_bytes(cfg: TandemConfig) -> int:
    """Bytes of a parameter FSDP gathers: the compute dtype under mixed precision (bf16 under
    train.dtype=bf16, and under auto on accelerators), fp32 otherwise."""
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and cfg.device in ("cuda", "npu"))
    return 2 if bf16 else 4


def ple_lookup_bytes(cfg: TandemConfig) -> tuple:
    """(transient bytes, bytes sent) of one rank's lookup in a PLE table, for one micro-batch (see the module docstring and tensor_hybrid.ShardedNGramTable).
    Each tp rank asks for the ids of 1/tp of the positions; rows travel in the compute dtype."""
    m, p = cfg.model, cfg.parallel
    tokens = cfg.data.seq_len * cfg.train.micro_batch_size
    heads = (m.ngram_size - 1) * m.heads_per_ngram
    e = m.resolved_ple_embed_dim
    width = compute_bytes(cfg) if p.dp_mode == "fsdp" else 4
    asked = tokens * heads / p.tp  # ids this rank looks up (and, on average, serves)
    ids = tokens * heads * 8 * 4 + asked * (8 * 3 + 4 + 4 + 8)  # hashing; owner, order, inverse; sent, received
    rows = asked * (e // heads) * (4 + 2 * width) + tokens * e * width  # served fp32 + cast, back, tp gather
    sent = 2 * asked * (e // heads) * width + asked * 4 + 2 * tokens * e * width * (p.tp - 1) / p.tp
    return ids + rows, sent


def _kind(name: str) -> str:
    if ".experts." in name:
        return "experts"
    if name.endswith("ple_embedding.ngram_embedding.weight"):
        return "ple_table"
    return "dense"


def estimate(cfg: TandemConfig, world_size: int | None = None) -> Estimate:
    m, p = cfg.model, cfg.parallel
    with torch.device("meta"):
        model = TandemModel(m, cfg.mtp)
    total = expert = mtp = ple_table = 0
    per_layer: Dict[int, Dict[str, int]] = {}
    pieces_by_kind: Dict[str, Dict[str, int]] = {}
    for name, param in model.named_parameters():  # named_parameters de-duplicates tied weights
        n, kind = param.numel(), _kind(name)
        total += n
        expert += n if kind == "experts" else 0
        ple_table += n if kind == "ple_table" else 0
        if name.startswith("mtp."):
            mtp += n
        top = name.split(".")[0]
        if top == "layers":
            layer = per_layer.setdefault(int(name.split(".")[1]), {"dense": 0, "experts": 0, "ple_table": 0})
            layer[kind] += n
        else:
            piece = pieces_by_kind.setdefault(top, {"dense": 0, "experts": 0, "ple_table": 0})
            piece[kind] += n
    routed_share = m.top_k / m.num_experts if m.num_experts else 1.0
    # a token reads (n-gram heads) rows of a PLE table: the tables count as inactive, like unrouted experts
    active = total - expert - ple_table + int(expert * routed_share)
    if m.tie_embeddings and p.pp > 1:  # each holding rank keeps the head's own copy
        pieces_by_kind["lm_head"] = dict(pieces_by_kind["embed_tokens"])
    pieces_by_kind.setdefault("lm_head", {"dense": 0, "experts": 0, "ple_table": 0})

    dp = p.dp or (max(world_size // (p.tp * p.pp * p.ep), 1) if world_size else 1)
    batch = dp * p.ep
    # each pp rank: the trunk layers of its stages plus the pieces they use (embedding, final norm, head,
    # MTP module: pipeline_plan.PipelinePlan.stage_pieces; copies on several ranks each count)
    plan = None
    if p.pp > 1:
        from .parallel.pipeline_plan import PipelinePlan

        plan = PipelinePlan(cfg)
        rank_stages = [plan.stages_of(r) for r in range(p.pp)]
        layout = [sum(len(plan.split[s]) for s in mine) for mine in rank_stages]
        rank_pieces = [{piece for s in mine for piece in plan.stage_pieces(s)} for mine in rank_stages]
        rank_depths = [sum(1 for s in mine for d in plan.stages[s].depths if d > 0) for mine in rank_stages]
        rank_layers = [[i for s in mine for i in plan.split[s]] for mine in rank_stages]
        whole_pieces = plan.shared_within_rank() if p.dp_mode == "fsdp" else []
    else:
        layout, rank_pieces, rank_depths = [m.num_layers], [set(pieces_by_kind)], [cfg.mtp.num_steps]
        rank_layers, whole_pieces = [list(range(m.num_layers))], []

    # what one rank owns of each kind: experts over ep x tp, FSDP over dp; the PLE table by rows over the
    # stage's dp x ep x tp ranks; the rest over tp and FSDP over the batch ranks
    split = {"experts": p.ep * p.tp * dp, "ple_table": p.tp * batch, "dense": p.tp * batch}

    def owned(counts: Dict[str, int]) -> float:
        return sum(counts[k] / split[k] for k in counts)

    def rank_owned(r: int):
        """(owned parameters, of which MTP, of which PLE table) of pp rank r."""
        own = sum(owned(per_layer[i]) for i in rank_layers[r])
        ple = sum(per_layer[i]["ple_table"] for i in rank_layers[r]) / split["ple_table"]
        mtp_own = 0.0
        for piece in rank_pieces[r]:
            counts = pieces_by_kind.get(piece, {"dense": 0, "experts": 0, "ple_table": 0})
            got = owned(counts)
            if piece in whole_pieces:  # two stages of this rank share it: kept whole over dp x ep
                got = sum(counts.values()) / p.tp
            own += got
            mtp_own += got if piece == "mtp" else 0.0
        return own, mtp_own, ple

    def rank_states(r: int) -> tuple:
        own, mtp_own, ple = rank_owned(r)
        if cfg.train.freeze_trunk:
            # frozen trunk: its parameters alone, in train.frozen_dtype; only the MTP module (FSDP-sharded
            # like the rest) has fp32 master + gradient + AdamW moments
            return (frozen_bytes(cfg) * max(own - mtp_own, 0) + 16 * mtp_own) / GIB, frozen_bytes(cfg) * ple / GIB
        return 16 * own / GIB, 16 * ple / GIB

    per_rank_states = [rank_states(r) for r in range(p.pp)]
    states = max(x[0] for x in per_rank_states)
    ple_states = max(x[1] for x in per_rank_states)

    act_bytes = 2 if cfg.device != "cpu" else 4
    per_layer_act = 34 * cfg.data.seq_len * cfg.train.micro_batch_size * m.hidden_size / p.tp * act_bytes / 2
    if m.hc_count > 1:  # each of a block's two hyper-connections keeps ~4 stream-wide tensors
        per_layer_act += 16 * m.hc_count * cfg.data.seq_len * cfg.train.micro_batch_size * m.hidden_size / p.tp * act_bytes / 2
    in_flight = p.pp if p.pp > 1 else 1
    # a frozen trunk runs under no_grad: it keeps no activations for backward, about one layer's live
    trunk_layers = [1 if cfg.train.freeze_trunk else n for n in layout]
    first = per_layer_act * trunk_layers[0] * in_flight
    chunk = min(cfg.mtp.loss_chunk_tokens or 1 << 30, cfg.data.seq_len * cfg.train.micro_batch_size)
    # a rank holding loss depths: its layers and MTP depths (one micro-batch in flight) and a logits chunk
    heads = [r for r, pieces in enumerate(rank_pieces) if "lm_head" in pieces]
    last = max(per_layer_act * (trunk_layers[r] + rank_depths[r]) + chunk * m.vocab_size / p.tp * 4 for r in heads)
    activations = max(first, last) / GIB

    gathered = ple_lookup = ple_sent = 0.0
    for r in range(p.pp):
        for i in rank_layers[r]:
            if per_layer[i]["ple_table"]:
                need, sent = ple_lookup_bytes(cfg)
                ple_lookup, ple_sent = max(ple_lookup, need / GIB), max(ple_sent, sent)
    if batch > 1 and p.dp_mode == "fsdp" and per_layer:
        width = frozen_bytes(cfg) if cfg.train.freeze_trunk else compute_bytes(cfg)
        mtp_width = compute_bytes(cfg)

        def layer_bytes(i: int) -> float:
            c = per_layer[i]
            return width * (c["dense"] / p.tp + c["experts"] / (p.tp * p.ep))  # a PLE table is never gathered

        for r in range(p.pp):
            sizes = sorted((layer_bytes(i) for i in rank_layers[r]), reverse=True)[:2]
            roots = sum((mtp_width if x == "mtp" else width) * sum(pieces_by_kind.get(x, {}).values())
                        for x in rank_pieces[r]) / p.tp
            gathered = max(gathered, (sum(sizes) + roots) / GIB)
    grad_buffers = 0.0
    if batch > 1 and p.dp_mode == "fsdp":
        grad_buffers = max(root_grad_bytes(cfg, pieces_by_kind, rank_pieces[r], whole_pieces, activations * GIB)
                           for r in range(p.pp)) / GIB
    single_sync = 0.0
    if batch > 1 and per_layer:
        from .parallel.validate import pipeline_microbatches

        if pipeline_microbatches(cfg) > 1:
            single_sync = max(single_sync_bytes(cfg, per_layer, pieces_by_kind, rank_layers[r], rank_pieces[r],
                                                whole_pieces, dp, activations * GIB) for r in range(p.pp)) / GIB
    accumulation = 0.0 if p.reshard_after_microbatch else single_sync
    shards = [f"dp {dp}"] + ([f"ep {p.ep}"] if p.ep > 1 else []) + ([f"tp {p.tp}"] if p.tp > 1 else [])
    return Estimate(total, expert, active, mtp, states, activations, gathered, grad_buffers, accumulation, single_sync,
                    ple_table_params=ple_table, ple_states_gib_per_rank=ple_states,
                    ple_lookup_gib_per_rank=ple_lookup, ple_exchange_bytes=ple_sent,
                    ple_shard=f"1/{split['ple_table']} = " + " x ".join(shards),
                    train_flops_per_token=training_flops_per_token(m, cfg.mtp, cfg.data.seq_len),
                    flops_by_kind=flops_by_kind(m, cfg.mtp, cfg.data.seq_len))


def root_grad_bytes(cfg: TandemConfig, pieces_by_kind, pieces, whole_pieces, activation_bytes: float) -> float:
    """FSDP's gradient buffers of a pp rank's root group (the pieces it holds, without their routed
    experts, which are units of their own, and without pieces kept whole): each micro-batch's unsharded
    gradients in the compute dtype through its backward (with one sync per step too: they are added
    into the fp32 accumulators `single_sync_bytes` counts only at the group's post-backward), and the
    reduce-scatter's input at its end where it exceeds the activations (fp32 accumulators with one sync
    per step whatever train.grad_reduce_dtype, data.py casting them into a bf16 copy for the wire).
    Measured (bench/fsdp_accumulation_memory.py) the input never stood in full beside the activations,
    not even on a pipeline stage with other micro-batches in flight."""
    p = cfg.parallel
    trained = [x for x in pieces if x not in whole_pieces and (x == "mtp" or not cfg.train.freeze_trunk)]
    root = sum(pieces_by_kind.get(x, {}).get("dense", 0) for x in trained) / p.tp
    width = compute_bytes(cfg)
    bf16_reduce = width == 2 and cfg.train.grad_reduce_dtype == "bf16"
    reduce = (2 if bf16_reduce else 4) if p.reshard_after_microbatch else (6 if bf16_reduce else 4)
    return width * root + max(0.0, reduce * root - activation_bytes)


def single_sync_bytes(cfg: TandemConfig, per_layer: Dict[int, Dict[str, int]], pieces_by_kind,
                      layers, pieces, whole_pieces, dp: int, activation_bytes: float) -> float:
    """Bytes a pp rank (its `layers` and `pieces`) holds beyond the default mode's figures when gradients are synced once per step
    (parallel.reshard_after_microbatch=false; see the module docstring): 4 bytes x (unsharded - owned)
    for every trained FSDP-managed parameter (the unsharded fp32 gradient replacing the sharded one;
    none under dp_mode=allreduce, whose gradients are whole anyway) and the gathered copies of its
    layers beyond the two largest (already in the gathered figure). The PLE tables and pieces kept whole
    (shared by two stages of the rank) are outside FSDP: their gradients are the same in both modes."""
    p = cfg.parallel
    batch = dp * p.ep
    frozen = cfg.train.freeze_trunk
    width = frozen_bytes(cfg) if frozen else compute_bytes(cfg)

    def unsharded(c: Dict[str, int]) -> float:
        return c["dense"] / p.tp + c["experts"] / (p.tp * p.ep)

    def owned(c: Dict[str, int]) -> float:
        return c["dense"] / (p.tp * batch) + c["experts"] / (p.tp * p.ep * dp)

    trained = []  # parameter counts by kind, FSDP-managed and trained, on this rank
    if not frozen:
        trained += [per_layer[i] for i in layers]
    trained += [pieces_by_kind.get(x, {"dense": 0, "experts": 0, "ple_table": 0}) for x in pieces
                if x not in whole_pieces and (x == "mtp" or not frozen)]
    grads = 0.0 if p.dp_mode == "allreduce" else 4 * sum(unsharded(c) - owned(c) for c in trained)
    sizes = sorted((unsharded(per_layer[i]) for i in layers), reverse=True)
    held = width * sum(sizes[2:])
    if p.pp <= 1:
        held = max(0.0, held - activation_bytes)
    return grads + held
