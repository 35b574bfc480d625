"""Size a recipe before launching it: exact parameter counts and a per-rank memory estimate.

Parameters are counted exactly from the model built on the meta device (no memory). Memory per rank
for the recipe's layout is an estimate:
- model states: fp32 parameter + fp32 gradient + two fp32 AdamW moments = 16 bytes per parameter this
  rank owns (with train.freeze_trunk only the MTP module's; the frozen trunk costs 2 or 4 bytes per
  parameter, train.frozen_dtype, and keeps no activations): non-expert parameters split over tp and pipeline stages (the largest stage counts) and
  sharded by FSDP over the data-parallel replicas (dp * ep); expert parameters split over ep, tp and
  stages and sharded by FSDP over dp;
- activations (bf16 on accelerators): about 34 * s * b * h / tp bytes per transformer layer per
  micro-batch in flight (Korthikanti et al. 2022, SDPA/flash attention, no s^2 term), with up to
  `pp` micro-batches in flight on the first stage under 1F1B; the last stage adds the K MTP depths
  and one chunk of logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models import MTPConfig, ModelConfig, TandemModel

from .config import TandemConfig

GIB = 2**30


def _attention_forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 2 * q * (seq_len / 2)  # projections + causal QK^T and AV


def _mlp_forward_flops(cfg: ModelConfig, moe: bool) -> float:
    h = cfg.hidden_size
    if not moe:
        return 3 * 2 * h * cfg.intermediate_size
    routed = cfg.top_k * 3 * 2 * h * cfg.moe_intermediate_size
    shared = cfg.num_shared_experts * 3 * 2 * h * cfg.moe_intermediate_size
    return 2 * h * cfg.num_experts + routed + shared


def layer_forward_flops(cfg: ModelConfig, moe: bool, seq_len: int) -> float:
    """Forward FLOPs per token of one trunk layer (dense or MoE)."""
    return _attention_forward_flops(cfg, seq_len) + _mlp_forward_flops(cfg, moe)


def mtp_layer_forward_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one MTP step's layer (the looped style's input projection included)."""
    combine = 2 * 2 * cfg.hidden_size * cfg.hidden_size if mtp.style == "looped" else 0
    return layer_forward_flops(cfg, mtp.moe and cfg.num_experts > 0, seq_len) + combine


def head_forward_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one vocabulary head."""
    return 2 * cfg.hidden_size * cfg.vocab_size


def forward_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> tuple[float, float]:
    """(forward FLOPs per token of all transformer layers incl. MTP, forward FLOPs of one head)."""
    layers = sum(layer_forward_flops(cfg, cfg.is_moe_layer(i), seq_len) for i in range(cfg.num_layers))
    layers += mtp.num_steps * mtp_layer_forward_flops(cfg, mtp, seq_len)
    return layers, head_forward_flops(cfg)


def training_flops_per_token(cfg: ModelConfig, mtp: MTPConfig, seq_len: int) -> float:
    """Forward + backward matmul/attention FLOPs per trained token (the head recomputed in backward)."""
    layers, head = forward_flops_per_token(cfg, mtp, seq_len)
    depths = 1 + mtp.num_steps
    valid = sum((seq_len - d) / seq_len for d in range(depths))  # depth d has S-d targets per window
    return 3 * layers + 4 * head * valid


@dataclass
class Estimate:
    total_params: int
    """Every parameter of trunk + MTP (tied embeddings counted once)."""
    expert_params: int
    """Routed-expert parameters (sharded over ep)."""
    active_params_per_token: int
    """Parameters a token touches in a forward (top-k routed experts only), embedding included."""
    mtp_params: int
    """Parameters of the MTP module."""
    states_gib_per_rank: float
    """Parameters, gradients and AdamW moments held by one rank."""
    activations_gib_per_rank: float
    """Peak activations of one rank's pipeline stage."""
    gathered_gib_per_rank: float = 0.0
    """FSDP's unsharded copies: the largest layer gathered (its tp/ep shard) and the next one prefetched,
    and the root group (embedding, head, MTP module), kept gathered through the step."""

    @property
    def total_gib_per_rank(self) -> float:
        return self.states_gib_per_rank + self.activations_gib_per_rank + self.gathered_gib_per_rank

    def summary(self) -> str:
        return (f"params total={self.total_params / 1e9:.3f}B active/token={self.active_params_per_token / 1e9:.3f}B "
                f"experts={self.expert_params / 1e9:.3f}B mtp={self.mtp_params / 1e6:.1f}M; per-rank memory "
                f"states={self.states_gib_per_rank:.1f} GiB activations={self.activations_gib_per_rank:.1f} GiB "
                f"gathered={self.gathered_gib_per_rank:.1f} GiB "
                f"total={self.total_gib_per_rank:.1f} GiB")


def frozen_bytes(cfg: TandemConfig) -> int:
    """Bytes per parameter of a frozen trunk (train.frozen_dtype; `auto` = the compute dtype: bf16 on
    accelerators under train.dtype=auto, bf16 under train.dtype=bf16)."""
    choice = cfg.train.frozen_dtype
    if choice == "auto":
        bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and cfg.device in ("cuda", "npu"))
        return 2 if bf16 else 4
    return 2 if choice == "bf16" else 4


def estimate(cfg: TandemConfig, world_size: int | None = None) -> Estimate:
    m, p = cfg.model, cfg.parallel
    with torch.device("meta"):
        model = TandemModel(m, cfg.mtp)
    total = expert = mtp = 0
    per_layer = {}
    for name, param in model.named_parameters():  # named_parameters de-duplicates tied weights
        n = param.numel()
        total += n
        if ".experts." in name:
            expert += n
        if name.startswith("mtp."):
            mtp += n
        if name.startswith("layers."):
            idx = int(name.split(".")[1])
            per_layer[idx] = per_layer.get(idx, 0) + n
    routed_share = m.top_k / m.num_experts if m.num_experts else 1.0
    active = total - expert + int(expert * routed_share)

    dp = p.dp or (max(world_size // (p.tp * p.pp * p.ep), 1) if world_size else 1)
    # the largest pp rank: the trunk layers of its stages plus the pieces they use (embedding, final
    # norm, head, MTP module: pipeline_plan.PipelinePlan.stage_pieces; copies on several ranks each count)
    embed = m.vocab_size * m.hidden_size
    piece_params = {"embed_tokens": embed, "norm": m.hidden_size, "mtp": mtp,
                    "lm_head": 0 if m.tie_embeddings and p.pp == 1 else embed}
    if p.pp > 1:
        from .parallel.pipeline_plan import PipelinePlan

        plan = PipelinePlan(cfg)
        rank_stages = [plan.stages_of(r) for r in range(p.pp)]
        layout = [sum(len(plan.split[s]) for s in mine) for mine in rank_stages]
        rank_pieces = [{piece for s in mine for piece in plan.stage_pieces(s)} for mine in rank_stages]
        rank_depths = [sum(1 for s in mine for d in plan.stages[s].depths if d > 0) for mine in rank_stages]
        rank_layers = [[i for s in mine for i in plan.split[s]] for mine in rank_stages]
    else:
        layout, rank_pieces, rank_depths = [m.num_layers], [set(piece_params)], [cfg.mtp.num_steps]
        rank_layers = [list(range(m.num_layers))]
    stages = [sum(per_layer[i] for i in layers) + sum(piece_params[x] for x in pieces)
              for layers, pieces in zip(rank_layers, rank_pieces)]
    stage_expert_share = expert / max(total, 1)
    biggest = max(stages)
    stage_expert = biggest * stage_expert_share
    owned = (biggest - stage_expert) / (p.tp * dp * p.ep) + stage_expert / (p.tp * p.ep * dp)
    if p.pp > 1 and p.dp_mode == "fsdp":
        # pieces two stages of one rank share stay whole (not FSDP-sharded over dp*ep)
        pieces = rank_pieces[stages.index(biggest)]
        whole = sum(piece_params[x] for x in plan.shared_within_rank() if x in pieces) / p.tp
        owned += whole * (1 - 1 / (dp * p.ep))
    if cfg.train.freeze_trunk:
        # frozen trunk: its parameters alone, in train.frozen_dtype; only the MTP module (on the last
        # stage, FSDP-sharded like the rest) has fp32 master + gradient + AdamW moments
        mtp_owned = mtp / (p.tp * dp * p.ep)
        states = (frozen_bytes(cfg) * max(owned - mtp_owned, 0) + 16 * mtp_owned) / GIB
    else:
        states = 16 * owned / GIB

    act_bytes = 2 if cfg.device != "cpu" else 4
    per_layer_act = 34 * cfg.data.seq_len * cfg.train.micro_batch_size * m.hidden_size / p.tp * act_bytes / 2
    in_flight = p.pp if p.pp > 1 else 1
    # a frozen trunk runs under no_grad: it keeps no activations for backward, about one layer's live
    trunk_layers = [1 if cfg.train.freeze_trunk else n for n in layout]
    first = per_layer_act * trunk_layers[0] * in_flight
    chunk = min(cfg.mtp.loss_chunk_tokens or 1 << 30, cfg.data.seq_len * cfg.train.micro_batch_size)
    # a rank holding loss depths: its layers and MTP depths (one micro-batch in flight) and a logits chunk
    heads = [r for r, pieces in enumerate(rank_pieces) if "lm_head" in pieces]
    last = max(per_layer_act * (trunk_layers[r] + rank_depths[r]) + chunk * m.vocab_size / p.tp * 4 for r in heads)
    activations = max(first, last) / GIB
    gathered = 0.0
    if dp * p.ep > 1 and p.dp_mode == "fsdp" and per_layer:
        layer = max(per_layer.values())
        layer_expert = layer * stage_expert_share
        width = frozen_bytes(cfg) if cfg.train.freeze_trunk else 4
        gathered = 2 * width * ((layer - layer_expert) / p.tp + layer_expert / (p.tp * p.ep))
        # the roots' pieces (embedding, head, final norm, MTP module) stay gathered through forward and
        # backward: the rank holding the most of them
        gathered += max(width * sum(piece_params[x] for x in pieces if x != "mtp") + 4 * mtp * ("mtp" in pieces)
                        for pieces in rank_pieces) / p.tp
        gathered /= GIB
    return Estimate(total, expert, active, mtp, states, activations, gathered)
