"""The cost model: each layer kind's parameters and forward FLOPs per token, from one description of
its weights.

A kind is written once as the weights it applies to every token (`matmul`: a [n_in x n_out] weight,
2 FLOPs per multiply-add, `uses` times per token), the parameters it holds without counted products
(`vector`: norm scales, biases, decay terms) and the work that depends on the window rather than on
a weight (`work`: attention scores over S tokens, the delta rule). Parameters and FLOPs are two sums
over the same pieces, so a shape fixed for one is fixed for the other; tests hold the parameters
against the modules on the meta device and the FLOPs against torch's FlopCounterMode.

Norms, activations and elementwise products cost no FLOPs here. Users: run.py (MFU and HFU),
parallel/pipeline_plan.py (the pipeline balance), estimate.py (`tandem train --check`), the tests.

**FLOPs per trained token** (the second half): what MFU counts (`training_flops_per_token`), what
a step executes (`hardware_flops_per_token`), and the per-layer and per-depth training costs that
`parallel.pp_balance` places by.

Model FLOPs: 3x the forward (forward + backward), each head over its depth's share of valid targets
(S - d of S). Hardware FLOPs add what the step recomputes or computes beside the model: each head 4x
under `mtp.loss_head_backward=recompute` (its logits again in backward; 3x under `fused`), the QSA
indexer KL's dense no-grad target (`qsa_indexer_target_flops`) and under
`train.activation_checkpointing=full` one more forward of every block (`selective` keeps the matmul
and attention outputs: what it recomputes is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from tandem.models import ModelConfig, MTPConfig
from tandem.models.ple import ngram_tables

GDN_CHUNK = 64
"""Gated DeltaNet's chunk length (models/gated_deltanet.py CHUNK; fla uses the same)."""


@dataclass(frozen=True)
class Cost:
    params: int = 0
    """Parameters, routed experts apart."""
    experts: int = 0
    """Routed-expert parameters (a token runs top_k of them: their FLOPs are in `flops`)."""
    flops: float = 0
    """Forward FLOPs per token."""

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.params + other.params, self.experts + other.experts,
                    self.flops + other.flops)


def matmul(n_in: int, n_out: int, uses: int = 1) -> Cost:
    """A [n_in x n_out] weight applied `uses` times per token (a depthwise conv: channels x
    taps)."""
    return Cost(params=n_in * n_out, flops=2 * n_in * n_out * uses)


def vector(n: int) -> Cost:
    """Parameters whose products are not counted (norm scales, biases, per-head terms)."""
    return Cost(params=n)


def work(flops: float) -> Cost:
    """FLOPs per token that no parameter carries (attention scores, the delta rule)."""
    return Cost(flops=flops)


# --- token mixers ---------------------------------------------------------------------------------
def attention(cfg: ModelConfig, seq_len: int) -> Cost:
    """Full attention: q, k, v and o projections (+ bias, q/k norms) and the causal QK^T and AV over
    S/2 keys on average; MLA's own projections when model.kv_lora_rank > 0."""
    if cfg.kv_lora_rank:
        return latent_attention(cfg, seq_len)
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    bias = q + 2 * kv if cfg.attention_bias else 0
    return (matmul(h, q + 2 * kv) + matmul(q, h) + vector(bias + (2 * hd if cfg.qk_norm else 0))
            + work(2 * 2 * q * (seq_len / 2)))


def latent_attention(cfg: ModelConfig, seq_len: int) -> Cost:
    """MLA: the queries (one projection, or through the q_lora_rank latent and its norm), the
    latent and the shared rotary key, the latent's expansion into each head's key and value, o, and
    QK^T over nope + rope channels and AV over v_head_dim, across S/2 keys on average."""
    h, heads, latent = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (matmul(h, cfg.q_lora_rank) + vector(cfg.q_lora_rank)
         + matmul(cfg.q_lora_rank, heads * qk)) if cfg.q_lora_rank else matmul(h, heads * qk)
    kv = (matmul(h, latent + cfg.qk_rope_head_dim) + vector(latent)
          + matmul(latent, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)))
    return q + kv + matmul(heads * cfg.v_head_dim, h) + work(mean_window_work(cfg, "attention",
                                                                              seq_len))


def attention_widths(cfg: ModelConfig) -> Tuple[int, int]:
    """(query/key, value) channels over all query heads: what QK^T and AV multiply per key; MLA's
    are nope + rope and v_head_dim per head."""
    if cfg.kv_lora_rank:
        return (cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                cfg.num_heads * cfg.v_head_dim)
    q = cfg.num_heads * cfg.resolved_head_dim
    return q, q


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


def qsa_indexer(cfg: ModelConfig, seq_len: int) -> Cost:
    """QSA's indexer: its I query heads and one key head (+ their norms) and its block scores."""
    i, di = cfg.indexer_heads, cfg.indexer_head_dim
    return (matmul(cfg.hidden_size, (i + 1) * di) + vector(2 * di)
            + work(2 * i * di * qsa_mean_blocks(cfg, seq_len)))


def qsa(cfg: ModelConfig, seq_len: int) -> Cost:
    """QSA: projections (query + gate, k, v, o; q/k norms), the indexer and attention over the
    selected tokens only."""
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    proj = matmul(h, 2 * q) + matmul(h, 2 * kv) + matmul(q, h) + vector(2 * hd)
    return proj + qsa_indexer(cfg, seq_len) + work(2 * 2 * q * qsa_mean_keys(cfg, seq_len))


def gated_deltanet(cfg: ModelConfig) -> Cost:
    """Gated DeltaNet: qkv, z, b and a projections, the causal depthwise conv, out_proj (+ dt_bias,
    A_log, the gated norm) and the chunked delta rule per value head at chunk C: intra-chunk K K^T,
    q K^T, the two WY products and A V, the carried state's three products and the triangular
    inverse as fla computes it, 2C^2/3 (the pure-PyTorch CPU path inverts otherwise, not
    counted)."""
    h, nv, dk, dv = (
        cfg.hidden_size,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    kd, vd = cfg.linear_num_key_heads * dk, nv * dv
    conv = 2 * kd + vd
    c = GDN_CHUNK
    return (matmul(h, conv) + matmul(h, vd) + matmul(h, 2 * nv) + matmul(vd, h)
            + matmul(conv, cfg.linear_conv_kernel) + vector(2 * nv + dv)
            + work(nv * (6 * c * dk + 4 * c * dv + 6 * dk * dv + 2 * c * c / 3)))


def mixer(cfg: ModelConfig, kind: str, seq_len: int) -> Cost:
    """A token mixer by kind: `attention`, `indexed_attention` (QSA) or `linear_attention` (GDN)."""
    if kind == "indexed_attention":
        return qsa(cfg, seq_len)
    if kind == "linear_attention":
        return gated_deltanet(cfg)
    return attention(cfg, seq_len)


# --- channel mixers, residual streams, PLE --------------------------------------------------------
def mlp(cfg: ModelConfig, moe: bool) -> Cost:
    """A dense SwiGLU MLP, or an MoE: router, top_k of the routed experts, the shared expert and its
    gate."""
    h = cfg.hidden_size
    if not moe:
        return matmul(h, 3 * cfg.intermediate_size)
    routed = 3 * h * cfg.moe_intermediate_size
    out = matmul(h, cfg.num_experts) + Cost(experts=cfg.num_experts * routed,
                                            flops=cfg.top_k * 2 * routed)
    if cfg.num_shared_experts > 0:
        out = out + matmul(h, 3 * cfg.resolved_shared_expert_size)
        if cfg.shared_expert_gate:
            out = out + matmul(h, 1)
    return out


def hyper_connection(cfg: ModelConfig, combine: bool = True) -> Cost:
    """One HyperConnection over X = hc_count x H channels: the grouped norm, the rank-R mixer down
    and up and, unless it is a final mixer, the injection weights."""
    x = cfg.hc_count * cfg.hidden_size
    out = vector(x) + matmul(x, cfg.hc_lowrank) + matmul(cfg.hc_lowrank, x)
    return out + matmul(x, cfg.hc_count) if combine else out


def block_norms(cfg: ModelConfig) -> Cost:
    """A block's two pre-norms, or its two hyper-connections."""
    if cfg.hc_count <= 1:
        return vector(2 * cfg.hidden_size)
    return hyper_connection(cfg) + hyper_connection(cfg)


def final_norm(cfg: ModelConfig) -> Cost:
    """The head's input norm: an RMSNorm, or the final stream mixer with hyper-connections."""
    if cfg.hc_count <= 1:
        return vector(cfg.hidden_size)
    return hyper_connection(cfg, combine=False)


def ple(cfg: ModelConfig) -> Cost:
    """PLE without its n-gram table (a gather): key and value projections of the n-gram embedding,
    three norms and the dilated depthwise conv."""
    x, h, e = cfg.hc_count * cfg.hidden_size, cfg.hidden_size, cfg.resolved_ple_embed_dim
    return matmul(e, x) + matmul(e, h) + vector(3 * x) + matmul(x, cfg.ple_conv_kernel)


def ple_table(cfg: ModelConfig, ple_index: int) -> int:
    """Parameters of PLE layer `ple_index`'s n-gram table (rows: distinct primes above the base,
    padded)."""
    rows = ngram_tables(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ngram_vocab_base,
                        cfg.ngram_vocab_multiple, cfg.ngram_seed, ple_index)[3]
    return rows * (cfg.resolved_ple_embed_dim // ((cfg.ngram_size - 1) * cfg.heads_per_ngram))


def head(cfg: ModelConfig) -> Cost:
    """A vocabulary head."""
    return matmul(cfg.hidden_size, cfg.vocab_size)


# --- layers ---------------------------------------------------------------------------------------
def trunk_layer_parts(cfg: ModelConfig, index: int, seq_len: int) -> Dict[str, Cost]:
    """Trunk layer `index` by part: `mixer`, `mlp` (dense MLP or MoE), `norms`, `ple` (without its
    table)."""
    parts = {"mixer": mixer(cfg, cfg.layer_type(index), seq_len),
             "mlp": mlp(cfg, cfg.is_moe_layer(index)), "norms": block_norms(cfg)}
    parts["ple"] = ple(cfg) if index in cfg.ple_layers else Cost()
    return parts


def trunk_layer(cfg: ModelConfig, index: int, seq_len: int) -> Cost:
    parts = trunk_layer_parts(cfg, index, seq_len)
    return parts["mixer"] + parts["mlp"] + parts["norms"] + parts["ple"]


def mtp_kind(cfg: ModelConfig) -> str:
    """The MTP blocks' token mixer: QSA when the trunk has it, else full attention (never PLE)."""
    return "indexed_attention" if cfg.uses_qsa else "attention"


def mtp_reuses_selection(cfg: ModelConfig, mtp: MTPConfig, depth: int) -> bool:
    """Whether MTP depth `depth` (1..K) reuses depth 1's QSA selection (mtp.qsa_reuse_indices,
    depths 2..K): it runs no indexer, so it pays neither its projections, its block scores nor its
    KL target."""
    return depth > 1 and mtp.qsa_reuse_indices and mtp_kind(cfg) == "indexed_attention"


def mtp_combine(cfg: ModelConfig, mtp: MTPConfig) -> Cost:
    """The looped style's input combination: the qwen4_exp drafter's two norms, fc_embedding once
    and the shared fc_hidden on every stream; concat_proj's two norms and eh_proj over cat(emb,
    h)."""
    h = cfg.hidden_size
    if mtp.style != "looped":
        return Cost()
    if mtp.resolved_combine(cfg) == "qwen4_exp":
        return vector(h + cfg.hc_count * h) + matmul(h, h) + matmul(h, h, uses=cfg.hc_count)
    return vector(2 * h) + matmul(2 * h, h)


def mtp_block(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> Cost:
    """An MTP step's transformer block: the trunk's attention kind, no PLE."""
    return mixer(cfg, mtp_kind(cfg),
                 seq_len) + mlp(cfg, mtp.moe and cfg.num_experts > 0) + block_norms(cfg)


def mtp_layer(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> Cost:
    """One physical MTP layer: its block, input combination and final norm (the head is `head`)."""
    return mtp_block(cfg, mtp, seq_len) + mtp_combine(cfg, mtp) + final_norm(cfg)


# --- parameters by part (what --check and the tests read) -----------------------------------------
def layer_params(cfg: ModelConfig, index: int) -> Dict[str, int]:
    """Trunk layer `index`'s parameters by kind: `mixer`, `mlp` (dense MLP, or the MoE's router,
    shared expert and its gate), `experts` (routed), `norms` (norms or hyper-connections), `ple`,
    `ple_table`."""
    parts = trunk_layer_parts(cfg, index, cfg.max_seq_len)
    table = ple_table(cfg, cfg.ple_layers.index(index)) if index in cfg.ple_layers else 0
    return {"mixer": parts["mixer"].params, "mlp": parts["mlp"].params,
            "experts": parts["mlp"].experts,
            "norms": parts["norms"].params, "ple": parts["ple"].params, "ple_table": table}


def mtp_layer_params(cfg: ModelConfig, mtp: MTPConfig) -> int:
    """One physical MTP layer's parameters, its routed experts included."""
    layer = mtp_layer(cfg, mtp, cfg.max_seq_len)
    return layer.params + layer.experts


# --- per-position window work (context parallelism's per-rank FLOPs: trainer/context_cost.py) -----
def window_work(cfg: ModelConfig, kind: str, visible):
    """Forward FLOPs of one query that see `visible` tokens (u = position + 1; a numpy array or a
    float): full attention's QK^T and AV over u keys; QSA's indexer scoring of its floor(u / r)
    complete blocks (the S^2 / r term) and its attention over `qsa_mean_keys`'s per-query count (all
    u keys until budget + r, then the budget plus the tail block); nothing for Gated DeltaNet, whose
    work per token is fixed. Its mean over u = 1..S is what `mixer` adds to the projections
    (`mean_window_work`)."""
    q = cfg.num_heads * cfg.resolved_head_dim
    u = np.asarray(visible, dtype=np.float64)
    if kind == "attention":
        return 2 * sum(attention_widths(cfg)) * u
    if kind == "indexed_attention":
        r, budget = cfg.indexer_compress_ratio, cfg.indexer_budget
        keys = np.where(u < budget + r, u, budget + np.mod(u, r))
        return qsa_score_work(cfg, u) + 2 * 2 * q * keys
    return np.zeros_like(u)


def qsa_score_work(cfg: ModelConfig, visible):
    """The QSA indexer's block scores for one query that sees `visible` tokens: floor(u / r)
    complete blocks (`window_work`'s S^2 / r term)."""
    u = np.asarray(visible, dtype=np.float64)
    return 2 * cfg.indexer_heads * cfg.indexer_head_dim * np.floor(u / cfg.indexer_compress_ratio)


def mean_window_work(cfg: ModelConfig, kind: str, seq_len: int) -> float:
    """The window work per token `mixer` counts at `seq_len` (attention's S/2 keys, QSA's
    `qsa_mean_blocks` and `qsa_mean_keys`): subtracted from a layer's FLOPs, what every token pays
    alike."""
    q = cfg.num_heads * cfg.resolved_head_dim
    if kind == "attention":
        return 2 * sum(attention_widths(cfg)) * (seq_len / 2)
    if kind == "indexed_attention":
        return (2 * cfg.indexer_heads * cfg.indexer_head_dim * qsa_mean_blocks(cfg, seq_len)
                + 2 * 2 * q * qsa_mean_keys(cfg, seq_len))
    return 0.0


# --------------------------------------------------------------------------------------------------
# FLOPs per trained token


def qsa_indexer_target_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Per token, the indexer KL's target: every head's dense QK^T over the window, no grad
    (training only, with model.indexer_loss_coef > 0; a cost of the step, not a model FLOP)."""
    return 2 * cfg.num_heads * cfg.resolved_head_dim * seq_len if cfg.indexer_loss_coef > 0 else 0.0


def trunk_layer_forward_flops(cfg: ModelConfig, index: int, seq_len: int) -> float:
    return trunk_layer(cfg, index, seq_len).flops


def trunk_layer_training_flops(cfg: ModelConfig, index: int, seq_len: int) -> float:
    """Training FLOPs per token of trunk layer `index`: 3x its forward, plus the QSA indexer KL's
    no-grad target (what a pipeline stage spends; MFU counts the 3x forward only)."""
    extra = (
        qsa_indexer_target_flops(cfg, seq_len)
        if cfg.layer_type(index) == "indexed_attention"
        else 0.0
    )
    return 3 * trunk_layer_forward_flops(cfg, index, seq_len) + extra


def mtp_layer_forward_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int,
                            depth: int = 1) -> float:
    """MTP depth `depth`'s forward FLOPs per token: its layer's, less the indexer where the depth
    reuses depth 1's selection."""
    skipped = qsa_indexer(cfg, seq_len).flops if mtp_reuses_selection(cfg, mtp, depth) else 0.0
    return mtp_layer(cfg, mtp, seq_len).flops - skipped


def mtp_layer_training_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int,
                             depth: int = 1) -> float:
    selects = mtp_kind(cfg) == "indexed_attention" and not mtp_reuses_selection(cfg, mtp, depth)
    extra = qsa_indexer_target_flops(cfg, seq_len) if selects else 0.0
    return 3 * mtp_layer_forward_flops(cfg, mtp, seq_len, depth) + extra


def final_norm_forward_flops(cfg: ModelConfig) -> float:
    return final_norm(cfg).flops


def head_forward_flops(cfg: ModelConfig) -> float:
    return head(cfg).flops


def forward_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> tuple[float, float]:
    """(forward FLOPs per token of all transformer layers incl. MTP and the trunk's final norm,
    forward FLOPs of one head)."""
    layers = sum(trunk_layer_forward_flops(cfg, i, seq_len) for i in range(cfg.num_layers))
    layers += final_norm_forward_flops(cfg)
    layers += sum(mtp_layer_forward_flops(cfg, mtp, seq_len, d)
                  for d in range(1, mtp.num_steps + 1))
    return layers, head_forward_flops(cfg)


def _valid_fraction(mtp: MTPConfig, seq_len: int) -> float:
    """Targets per window token summed over the depths: depth d has S - d targets per window."""
    return sum((seq_len - d) / seq_len for d in range(1 + mtp.num_steps))


def training_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int,
                             freeze_trunk: bool = False) -> float:
    """Model FLOPs per trained token, forward + backward (3x the forward, heads included, no
    recomputation): MFU's. A frozen trunk (train.freeze_trunk) runs forward only: its layers,
    final norm and head 1x, and the MTP depths' heads, sharing its frozen weight, 2x."""
    layers, head_flops = forward_flops_per_token(cfg, mtp, seq_len)
    out = 3 * (layers + head_flops * _valid_fraction(mtp, seq_len))
    if freeze_trunk:
        out -= 2 * _trunk_forward(cfg, seq_len) + head_flops * (2 + _mtp_fraction(mtp, seq_len))
    return out


def _trunk_forward(cfg: ModelConfig, seq_len: int) -> float:
    return (sum(trunk_layer_forward_flops(cfg, i, seq_len) for i in range(cfg.num_layers))
            + final_norm_forward_flops(cfg))


def _mtp_fraction(mtp: MTPConfig, seq_len: int) -> float:
    """The MTP depths' share of `_valid_fraction`."""
    return _valid_fraction(mtp, seq_len) - 1.0


def teacher_head_passes(distill: str, objective: str, mtp: MTPConfig) -> float:
    """Head forwards per token a teacher adds (the trunk's head read by the MTP losses): argmax
    distillation one pass over the rows; soft targets (train.distill=soft, the acceptance
    objective) three per MTP depth: the teacher's logits beside the student's, and both again in
    backward, over all the window's rows (models/loss.py runs the head on every row)."""
    if distill == "soft" or objective == "acceptance":
        return 3.0 * mtp.num_steps
    return 1.0 if distill == "argmax" else 0.0


def head_passes(mtp: MTPConfig) -> int:
    """A head's training FLOPs in forwards: forward, input and weight gradients (3), plus its
    logits again in backward under mtp.loss_head_backward=recompute (4)."""
    return 4 if mtp.loss_head_backward == "recompute" else 3


def hardware_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int,
                             activation_checkpointing: str = "none", freeze_trunk: bool = False,
                             teacher_passes: float = 0.0) -> float:
    """FLOPs per trained token the step executes: the model FLOPs plus each head's recomputed logits
    (4x its forward under mtp.loss_head_backward=recompute), the QSA indexer KL's no-grad dense
    target (where a layer or MTP depth selects), under full activation checkpointing a second
    forward of every trunk and MTP block (the target included), and `teacher_passes` head
    forwards (`teacher_head_passes`): HFU's. A frozen trunk runs forward only, without its
    indexers' targets or recomputation (`training_flops_per_token`)."""
    out = _hardware_flops(cfg, mtp, seq_len, activation_checkpointing) + teacher_passes * \
        head_forward_flops(cfg)
    if freeze_trunk:
        trunk, trunk_extra = _trunk_forward(cfg, seq_len), _trunk_extra(cfg, seq_len)
        recomputed = (trunk - final_norm_forward_flops(cfg) + trunk_extra
                      if activation_checkpointing == "full" else 0.0)
        out -= (2 * trunk + trunk_extra + recomputed
                + head_forward_flops(cfg) * (head_passes(mtp) - 1 + _mtp_fraction(mtp, seq_len)))
    return out


def _trunk_extra(cfg: ModelConfig, seq_len: int) -> float:
    """What trunk layers execute in training beyond 3x their forward (the QSA indexer KL's
    target)."""
    return sum(trunk_layer_training_flops(cfg, i, seq_len) - 3
               * trunk_layer_forward_flops(cfg, i, seq_len) for i in range(cfg.num_layers))


def _hardware_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int,
                    activation_checkpointing: str) -> float:
    layers, head_flops = forward_flops_per_token(cfg, mtp, seq_len)
    trunk_extra = _trunk_extra(cfg, seq_len)
    depths = range(1, mtp.num_steps + 1)
    mtp_extra = sum(mtp_layer_training_flops(cfg, mtp, seq_len, d)
                    - 3 * mtp_layer_forward_flops(cfg, mtp, seq_len, d) for d in depths)
    out = (3 * layers + head_passes(mtp) * head_flops * _valid_fraction(mtp, seq_len)
           + trunk_extra + mtp_extra)
    if activation_checkpointing == "full":
        # the MTP blocks' recomputation, each without the indexer where its depth reuses a selection
        skipped = qsa_indexer(cfg, seq_len).flops
        mtp_blocks = sum(mtp_block(cfg, mtp, seq_len).flops
                         - (skipped if mtp_reuses_selection(cfg, mtp, d) else 0.0) for d in depths)
        out += (sum(trunk_layer_forward_flops(cfg, i,
                                              seq_len) for i in range(cfg.num_layers)) + trunk_extra
                + mtp_blocks + mtp_extra)
    return out


def flops_by_kind(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> Dict[str, float]:
    """Forward FLOPs per token of each trunk layer kind present (one layer each, without its MLP),
    and of one MLP / MoE, for the --check breakdown."""
    out = {}
    for i in range(cfg.num_layers):
        kind = cfg.layer_type(i)
        name = {"attention": "attn", "indexed_attention": "qsa", "linear_attention": "gdn"}[kind]
        out.setdefault(name, mixer(cfg, kind, seq_len).flops)
    if cfg.hc_count > 1:
        out["hc"] = block_norms(cfg).flops
    if cfg.ple_layers:
        out["ple"] = ple(cfg).flops
    out["moe" if cfg.num_experts else "mlp"] = mlp(cfg, cfg.num_experts > 0).flops
    return out
