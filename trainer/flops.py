"""Training FLOPs per token of a config, layer by layer: what MFU counts (`training_flops_per_token`),
what a step executes (`hardware_flops_per_token`), and the per-layer and per-depth costs that
`parallel.pp_balance` places by (parallel/pipeline_plan.py).

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
recomputation: each head 4x under `mtp.loss_head_backward=recompute` (its logits are recomputed in
backward; 3x under the default `fused`: its gradients come with the forward), the QSA indexer KL's dense
target, and under `train.activation_checkpointing=full` one more forward of every block (`selective`
keeps the matmul and attention outputs, so what it recomputes is not counted).
"""

from __future__ import annotations

from typing import Dict

from tandem.models import MTPConfig, ModelConfig

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
    (4x its forward under mtp.loss_head_backward=recompute), the QSA indexer KL's no-grad dense target, and under full activation
    checkpointing a second forward of every trunk and MTP block (the target included): HFU's."""
    layers, head = forward_flops_per_token(cfg, mtp, seq_len)
    trunk_extra = sum(trunk_layer_training_flops(cfg, i, seq_len) - 3 * trunk_layer_forward_flops(cfg, i, seq_len)
                      for i in range(cfg.num_layers))
    mtp_extra = mtp.num_steps * (mtp_layer_training_flops(cfg, mtp, seq_len) - 3 * mtp_layer_forward_flops(cfg, mtp, seq_len))
    head_passes = 4 if mtp.loss_head_backward == "recompute" else 3
    out = 3 * layers + head_passes * head * _valid_fraction(mtp, seq_len) + trunk_extra + mtp_extra
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
