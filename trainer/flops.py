"""FLOPs per trained token of a config, from the cost model's forward FLOPs (cost.py): what MFU
counts (`training_flops_per_token`), what a step executes (`hardware_flops_per_token`), and the
per-layer and per-depth training costs that `parallel.pp_balance` places by
(parallel/pipeline_plan.py).

Model FLOPs: 3x the forward (forward + backward), each head over its depth's share of valid targets
(S - d of S). Hardware FLOPs add what the step recomputes or computes beside the model: each head 4x
under `mtp.loss_head_backward=recompute` (its logits again in backward; 3x under `fused`), the QSA
indexer KL's dense no-grad target (`qsa_indexer_target_flops`) and under
`train.activation_checkpointing=full` one more forward of every block (`selective` keeps the matmul
and attention outputs: what it recomputes is not counted).
"""

from __future__ import annotations

from typing import Dict

from tandem.models import ModelConfig, MTPConfig

from .cost import (
    block_norms,
    final_norm,
    head,
    mixer,
    mlp,
    mtp_block,
    mtp_kind,
    mtp_layer,
    ple,
    trunk_layer,
)


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


def mtp_layer_forward_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> float:
    return mtp_layer(cfg, mtp, seq_len).flops


def mtp_layer_training_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> float:
    extra = qsa_indexer_target_flops(cfg, seq_len) if mtp_kind(cfg) == "indexed_attention" else 0.0
    return 3 * mtp_layer_forward_flops(cfg, mtp, seq_len) + extra


def final_norm_forward_flops(cfg: ModelConfig) -> float:
    return final_norm(cfg).flops


def head_forward_flops(cfg: ModelConfig) -> float:
    return head(cfg).flops


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
    layers, head_flops = forward_flops_per_token(cfg, mtp, seq_len)
    return 3 * (layers + head_flops * _valid_fraction(mtp, seq_len))


def hardware_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int,
                             activation_checkpointing: str = "none") -> float:
    """FLOPs per trained token the step executes: the model FLOPs plus each head's recomputed logits
    (4x its forward under mtp.loss_head_backward=recompute), the QSA indexer KL's no-grad dense
    target, and under full activation checkpointing a second forward of every trunk and MTP block
    (the target included): HFU's."""
    layers, head_flops = forward_flops_per_token(cfg, mtp, seq_len)
    trunk_extra = sum(trunk_layer_training_flops(cfg, i, seq_len) - 3
                      * trunk_layer_forward_flops(cfg, i, seq_len)
                      for i in range(cfg.num_layers))
    mtp_extra = mtp.num_steps * (
        mtp_layer_training_flops(cfg, mtp, seq_len) - 3 * mtp_layer_forward_flops(cfg, mtp, seq_len)
    )
    head_passes = 4 if mtp.loss_head_backward == "recompute" else 3
    out = 3 * layers + head_passes * head_flops * _valid_fraction(mtp,
                                                                  seq_len) + trunk_extra + mtp_extra
    if activation_checkpointing == "full":
        out += (sum(trunk_layer_forward_flops(cfg, i,
                                              seq_len) for i in range(cfg.num_layers)) + trunk_extra
                + mtp.num_steps * mtp_block(cfg, mtp, seq_len).flops + mtp_extra)
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
