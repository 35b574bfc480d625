"""The byte counts behind trainer/estimate.py's memory terms: dtype widths (`compute_bytes`,
`frozen_bytes`), the PLE lookup's buffers, the head's chunk and fused-gradient buffers, and FSDP's
gradient buffers (`root_grad_bytes`, `piece_unit_grad_bytes`, `single_sync_bytes`). Each is a
formula of the config and the counts it is handed; estimate.py's module docstring says what each
term models. Kept apart from the assembly of the estimate (the model counted, its layout over
ranks) so each file holds one of the two.
"""

from __future__ import annotations

from typing import Dict

import torch

from tandem.models.loss import chunk_buffer_bytes

from .config import TandemConfig
from .parallel.validate import microbatch_sequences


def frozen_bytes(cfg: TandemConfig) -> int:
    """Bytes per parameter of a frozen trunk (train.frozen_dtype; `auto` = the compute dtype: bf16
    on accelerators under train.dtype=auto, bf16 under train.dtype=bf16)."""
    choice = cfg.train.frozen_dtype
    if choice == "auto":
        return compute_bytes(cfg)
    return 2 if choice == "bf16" else 4


def compute_bytes(cfg: TandemConfig) -> int:
    """Bytes of a parameter FSDP gathers: the compute dtype under mixed precision (bf16 under
    train.dtype=bf16, and under auto on accelerators), fp32 otherwise."""
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and cfg.device in ("cuda",
                                                                                      "npu"))
    return 2 if bf16 else 4


def ple_lookup_bytes(cfg: TandemConfig) -> tuple:
    """(transient bytes, bytes sent) of one rank's lookup in a PLE table, for one micro-batch (see
    trainer/estimate.py's docstring and tensor_hybrid.ShardedNGramTable). Each tp rank asks for the
    ids of 1/tp of the positions; rows travel in the compute dtype."""
    m, p = cfg.model, cfg.parallel
    # a cp rank looks up its own rows
    tokens = cfg.data.seq_len * microbatch_sequences(cfg) // p.cp
    heads = (m.ngram_size - 1) * m.heads_per_ngram
    e = m.resolved_ple_embed_dim
    width = compute_bytes(cfg) if p.dp_mode == "fsdp" else 4
    asked = tokens * heads / p.tp  # ids this rank looks up (and, on average, serves)
    # hashing; owner, order, inverse; sent, received
    ids = tokens * heads * 8 * 4 + asked * (8 * 3 + 4 + 4 + 8)
    # served fp32 + cast, back, tp gather
    rows = asked * (e // heads) * (4 + 2 * width) + tokens * e * width
    sent = 2 * asked * (e // heads) * width + asked * 4 + 2 * tokens * e * width * (p.tp - 1) / p.tp
    return ids + rows, sent


def head_chunk_bytes(cfg: TandemConfig, chunk: int) -> float:
    """The buffers of a pass through the head (models/loss.py `chunk_buffer_bytes`): one chunk's
    logits [chunk x vocab/tp] in the compute dtype and, below fp32, the fp32 block its softmax runs
    in, which is the whole chunk on an accelerator and at most `CPU_SOFTMAX_BLOCK_BYTES` on a
    CPU."""
    dtype = torch.bfloat16 if compute_bytes(cfg) == 2 else torch.float32
    return chunk_buffer_bytes(chunk, cfg.model.vocab_size // cfg.parallel.tp, dtype, cfg.device)


def fused_head_bytes(cfg: TandemConfig, loss_depths, act_bytes: int) -> float:
    """What the fused head (mtp.loss_head_backward=fused) holds from the losses' forward to their
    backward on a rank computing the losses of `loss_depths` (0: the trunk's): one fp32
    [vocab/tp x hidden] weight gradient for all of them while the head trains (the trainer tells the
    head each depth's incoming gradient, models/loss.py), and per loss a [tokens x hidden] input
    gradient. Every loss through `loss_sums` takes it: the trunk's and, under the `ce` objective
    without soft distillation, each MTP depth's."""
    m = cfg.model
    if cfg.mtp.loss_head_backward != "fused":
        return 0.0
    mtp_fused = cfg.mtp.loss.objective == "ce" and cfg.train.distill != "soft"
    losses = sum(1 for d in loss_depths if d == 0 or mtp_fused)
    weight = (
        0
        if cfg.train.freeze_trunk or not losses
        else m.vocab_size * m.hidden_size * 4 / cfg.parallel.tp
    )
    tokens = cfg.data.seq_len * microbatch_sequences(cfg) // cfg.parallel.cp
    return weight + losses * tokens * m.hidden_size * act_bytes


def per_tp_rank(c: Dict[str, int], p) -> float:
    """Parameters of counts `c` (by kind: estimate._kind) that one tp x ep rank holds unsharded:
    dense ones split over tp, experts over tp x ep, the tp-replicated (MLA's latent projections)
    whole."""
    return (c.get("dense", 0) / p.tp + c.get("replicated", 0)
            + c.get("experts", 0) / (p.tp * p.ep))


def piece_unit_grad_bytes(cfg: TandemConfig, pieces_by_kind, pieces, unit_pieces) -> float:
    """What a pp rank's pieces that are FSDP units of their own (`unit_pieces`, shared by two of a
    rank's stages) hold for their one reduce-scatter per step: the unsharded gradient of every
    trained parameter (its tp / ep shard), accumulated in fp32 from the step's first backward to the
    rank's last stage using the piece, plus, computing in bf16, one backward's bf16 gradient before
    it is folded in (and the bf16 copy sent under train.grad_reduce_dtype=bf16 at the reduction)."""
    p = cfg.parallel
    trained = [pieces_by_kind.get(x, {}) for x in pieces
               if x in unit_pieces and (x == "mtp" or not cfg.train.freeze_trunk)]
    unsharded = sum(per_tp_rank(c, p) for c in trained)
    width = compute_bytes(cfg)
    extra = 0 if width == 4 else width + (2 if cfg.train.grad_reduce_dtype == "bf16" else 0)
    return (4 + extra) * unsharded


def root_grad_bytes(cfg: TandemConfig, pieces_by_kind, pieces, unit_pieces,
                    activation_bytes: float) -> float:
    """FSDP's gradient buffers of a pp rank's root group (the pieces it holds, without their routed
    experts, which are units of their own, and without the pieces that are units of their own:
    `piece_unit_grad_bytes`): each micro-batch's unsharded gradients in the compute dtype through
    its backward (with one sync per step too: they are added into the fp32 accumulators
    `single_sync_bytes` counts only at the group's post-backward), and the reduce-scatter's input at
    its end where it exceeds the activations (fp32 accumulators with one sync per step whatever
    train.grad_reduce_dtype, data.py casting them into a bf16 copy for the wire). Measured
    (bench/fsdp_accumulation_memory.py) the input never stood in full beside the activations, not
    even on a pipeline stage with other micro-batches in flight."""
    p = cfg.parallel
    trained = [x for x in pieces if x not in unit_pieces
               and (x == "mtp" or not cfg.train.freeze_trunk)]
    root = sum(per_tp_rank({k: v for k, v in pieces_by_kind.get(x, {}).items() if k != "experts"},
                           p) for x in trained)
    width = compute_bytes(cfg)
    bf16_reduce = width == 2 and cfg.train.grad_reduce_dtype == "bf16"
    reduce = (2 if bf16_reduce else 4) if p.reshard_after_microbatch else (6 if bf16_reduce else 4)
    return width * root + max(0.0, reduce * root - activation_bytes)


def single_sync_bytes(cfg: TandemConfig, per_layer: Dict[int, Dict[str, int]], pieces_by_kind,
                      layers, pieces, unit_pieces, dp: int, activation_bytes: float) -> float:
    """Bytes a pp rank (its `layers` and `pieces`) holds beyond the default mode's figures when
    gradients are synced once per step (parallel.reshard_after_microbatch=false; see
    trainer/estimate.py's docstring): 4 bytes x (unsharded - owned) for every trained FSDP-managed
    parameter (the unsharded fp32 gradient replacing the sharded one; none under dp_mode=allreduce,
    whose gradients are whole anyway) and the gathered copies of its layers beyond the two largest
    (already in the gathered figure). The PLE tables (outside FSDP) and the pieces that are FSDP
    units of their own (shared by two stages of the rank: one reduce-scatter per step in both modes,
    `piece_unit_grad_bytes`) hold the same in both modes."""
    p = cfg.parallel
    batch = dp * p.ep
    frozen = cfg.train.freeze_trunk
    width = frozen_bytes(cfg) if frozen else compute_bytes(cfg)

    def unsharded(c: Dict[str, int]) -> float:
        return per_tp_rank(c, p)

    def owned(c: Dict[str, int]) -> float:
        return (c["dense"] / (p.tp * batch) + c.get("replicated", 0) / batch
                + c["experts"] / (p.tp * p.ep * dp))

    trained = []  # parameter counts by kind, FSDP-managed and trained, on this rank
    if not frozen:
        trained += [per_layer[i] for i in layers]
    trained += [pieces_by_kind.get(x, {"dense": 0, "experts": 0}) for x in pieces
                if x not in unit_pieces and (x == "mtp" or not frozen)]
    grads = 0.0 if p.dp_mode == "allreduce" else 4 * sum(unsharded(c) - owned(c) for c in trained)
    sizes = sorted((unsharded(per_layer[i]) for i in layers), reverse=True)
    held = width * sum(sizes[2:])
    if p.pp <= 1:
        held = max(0.0, held - activation_bytes)
    return grads + held
