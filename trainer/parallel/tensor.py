"""Tensor and expert parallelism, applied to a plain TandemModel from outside.

* Attention and dense MLPs use PyTorch's tensor-parallel styles (DTensor): q/k/v and gate/up are
  column-parallel, o/down row-parallel, and a `PrepareModuleInput` makes the block input a
  replicated DTensor so q, k and v (or gate and up) share one input-gradient all-reduce.
  `Attention` infers its local head counts from the sharded projection widths.
* The token embedding is vocab-parallel (`RowwiseParallel` on nn.Embedding).
* The output head becomes `VocabParallelHead`: logits stay sharded over the vocabulary and the
  chunked cross-entropy reduces max / sum-exp / target-logit over tp (never gathering full logits).
* MoE layers keep replicated routers; routed experts shard their intermediate dim over tp and the
  expert dim over ep (`ParallelExperts`: dropless all-to-all dispatch and combine, `exact` or
  host-sync-free `padded`); the shared expert runs while the token copies are in flight, and its
  partial output joins the routed partial output so the layer needs one all-reduce.
* Qwen4-Exp's layers (Gated DeltaNet, QSA, PLE, hyper-connections, the qwen4_exp drafter) are
  parallelised by tensor_hybrid.py (its docstring says how each one is split).

Sequence parallelism (`parallel.sequence_parallel`, Megatron's): between the TP regions the
activations are this rank's shard of the sequence, [B, S/tp, H]; norms, residual adds and the
MTP input combination run on it. The embedding reduce-scatters instead of all-reducing (a training
forward with looped MTP steps looks its window of S+K tokens up whole and each rank reads its shards
of it, `SequenceShards`); attention and dense MLPs all-gather the sequence on entry (backward:
reduce-scatter) and reduce-scatter it after the row-parallel projection (backward: all-gather). MoE
layers route their own tokens, then all-gather tokens, weights and expert ids over tp for the
tp-sharded experts and reduce-scatter the partial outputs. The head's input is gathered whole
(`model.sequence`, built as a `SequenceShards`) before the vocab-parallel loss. Replicated
parameters that saw only a shard of the sequence (norms, routers, the MTP projection) get their
gradients summed over tp by the GradientFinisher (`sp_partial_names`).

Sharded parameters are DTensors (over the tp mesh, the ep mesh or both) with the single-process
names, so DCP reshards checkpoints between layouts. Model code computes on local shards
(`to_local`, differentiable) with the autograd collectives of `comm.py`.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from tandem.models.attention import Attention
from tandem.models.latent_attention import TP_REPLICATED
from tandem.models.layers import SwiGLU
from tandem.models.loss import (
    VocabReduce,
    chunked_acceptance_loss_sum,
    head_cross_entropy_sums,
)
from tandem.models.model import SequenceLayout
from tandem.models.moe import MoE

from .comm import copy_to_group, gather_along, reduce_from_group
from .expert import parallelize_moe
from .sharded_params import local
from .state import WholeSequenceSwitch
from .tensor_hybrid import parallelize_hybrid_mixer, parallelize_ple


# --- vocab-parallel output head ------------------------------------------------------------------
class _TensorParallelVocab(VocabReduce):
    """Reductions over a vocabulary sharded across the tp group (max: not differentiated)."""

    def __init__(self, group):
        self.group = group

    def max(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_group(x, self.group)

    def sum_for_shards(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_group(reduce_from_group(x, self.group), self.group)


class VocabParallelHead(nn.Module):
    """The shared output head with its vocabulary sharded over tp (`weight` a Shard(0) DTensor).

    Same `.logits()` / `.loss_sums()` as `OutputHead`; both go through `forward` so FSDP hooks fire.
    The loss never materialises full logits: per chunk, the max and the (sum of exponentials, target
    logit) pair are all-reduced over tp (Megatron's vocab-parallel cross-entropy, in two
    collectives), with the same `mtp.loss_head_backward` modes as the one-device head
    (models/loss.py): `fused` computes each chunk's gradients in forward, the weight's into this
    rank's vocabulary shard only.
    """

    def __init__(self, weight: torch.Tensor, tp_mesh, switch: Optional[WholeSequenceSwitch] = None,
                 backward: str = "fused"):
        super().__init__()
        self.tp_mesh = tp_mesh
        # under SP (while `switch.on`) the input arrives through `gather_along`, whose backward
        # already sums over tp
        self.switch = switch
        self.backward = backward  # MTPConfig.loss_head_backward
        self.weight = nn.Parameter(distribute_tensor(weight.detach(), tp_mesh, [Shard(0)],
                                                     src_data_rank=None),
                                   requires_grad=weight.requires_grad)

    @property
    def sequence_parallel(self) -> bool:
        return self.switch is not None and self.switch.on

    def logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        return self(h_normed)

    def loss_sums(self, h_normed_dnh: torch.Tensor, targets_dn: torch.Tensor, chunk_tokens: int,
                  grad_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self(h_normed_dnh, targets_dn, chunk_tokens, grad_scales=grad_scales)

    def acceptance_loss_sum(self, h_normed_nh: torch.Tensor, teacher_nh: torch.Tensor,
                            targets_n: torch.Tensor,
                            chunk_tokens: int, ce_weight: float) -> torch.Tensor:
        return self(h_normed_nh, targets_n, chunk_tokens, teacher=teacher_nh, ce_weight=ce_weight)

    def forward(self, h: torch.Tensor, targets: Optional[torch.Tensor] = None,
                chunk_tokens: int = 0,
                teacher: Optional[torch.Tensor] = None, ce_weight: float = 0.0,
                grad_scales: Optional[torch.Tensor] = None):
        group = self.tp_mesh.get_group()
        w = local(self.weight)
        if targets is None:  # full logits (evaluation): gather the vocabulary shards
            part = F.linear(h, w)
            return DTensor.from_local(part, self.tp_mesh, [Shard(part.ndim - 1)]).full_tensor()
        vocab_start = self.tp_mesh.get_local_rank() * w.shape[0]
        if not self.sequence_parallel:
            h = copy_to_group(h, group)
        # the acceptance objective: its sums over the vocabulary all-reduce over tp
        if teacher is not None:
            if h.shape[0] == 0:
                return (h.sum() + w.sum()) * 0.0
            return chunked_acceptance_loss_sum(h, teacher, w, targets, chunk_tokens, ce_weight,
                                               _TensorParallelVocab(group), vocab_start)
        return head_cross_entropy_sums(h, w, targets, chunk_tokens, self.backward, grad_scales,
                                       _TensorParallelVocab(group), vocab_start)


# --- sequence parallelism on/off -----------------------------------------------------------------
class SequenceShards(SequenceLayout):
    """The model's `sequence` under sequence parallelism: hidden states between the blocks are this
    rank's shard of the sequence while the switch is on (`whole` all-gathers them for the head), and
    whole sequences are looked up once, each rank reading its shard of them. MTP step k embeds token
    t+k, the trunk's embedding output shifted by k; with the sequence split over tp a shifted shard
    needs k rows of the next rank's, so the window of S+K rows is looked up whole (one
    vocabulary-parallel all-reduce forward, and one backward summing the rows each rank's shards
    used) rather than once per step (a reduce-scatter forward and an all-gather backward each): one
    lookup and two collectives instead of K+1 and 2(K+1), and at K=3 half the bytes. With the switch
    off (decoding) it is the one-process layout."""

    def __init__(self, switch: WholeSequenceSwitch, group):
        super().__init__()
        self.switch, self.group = switch, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def whole(self, h_bsh: torch.Tensor) -> torch.Tensor:
        return gather_along(h_bsh, self.group, 1) if self.switch.on else h_bsh

    def embed_window(self, embed_tokens: nn.Module, ids_bl: torch.Tensor) -> torch.Tensor:
        if not self.switch.on:
            return embed_tokens(ids_bl)
        # the embedding all-reduces (its backward keeps the gradient)
        with self.switch.whole_sequences():
            emb = embed_tokens(ids_bl)
        return copy_to_group(emb, self.group)  # backward: each rank's rows summed over tp

    def rows(self, window_blh: torch.Tensor, first: int, rows: int) -> torch.Tensor:
        if not self.switch.on:
            return window_blh[:, first : first + rows]
        per = rows // self.size
        return window_blh[:, first + self.rank * per : first + (self.rank + 1) * per]


class _SwitchablePrepareInput(PrepareModuleInput):
    """PrepareModuleInput whose input is a sequence shard only while the switch is on."""

    def __init__(self, switch: WholeSequenceSwitch, **kwargs):
        super().__init__(**kwargs)
        self.switch, self.sp_layouts = switch, self.input_layouts

    def _prepare_input_fn(self, inputs, device_mesh):
        self.input_layouts = self.sp_layouts if self.switch.on else self.desired_input_layouts
        return super()._prepare_input_fn(inputs, device_mesh)


class _SwitchableRowwise(RowwiseParallel):
    """RowwiseParallel that reduce-scatters its output while the switch is on, all-reduces when
    off."""

    def __init__(self, switch: WholeSequenceSwitch, **kwargs):
        super().__init__(**kwargs)
        self.switch = switch

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        layouts = output_layouts if self.switch.on else (Replicate(),)
        return RowwiseParallel._prepare_output_fn(layouts, use_local_output, mod, outputs,
                                                  device_mesh)


# --- the whole model -----------------------------------------------------------------------------
def _block_plan(block, switch: Optional[WholeSequenceSwitch] = None) -> dict:
    # without SP the block input is whole on every rank; with SP it is the rank's sequence shard
    # (dim 1), gathered on entry to each TP region and reduce-scattered on exit
    if switch is None:
        prepare, rowwise, inp, out = PrepareModuleInput, RowwiseParallel, Replicate(), Replicate()
    else:
        prepare = lambda **kw: _SwitchablePrepareInput(switch, **kw)  # noqa: E731
        rowwise = lambda **kw: _SwitchableRowwise(switch, **kw)  # noqa: E731
        inp, out = Shard(1), Shard(1)
    plan = {}
    # QSA / Gated DeltaNet: tensor_hybrid.py
    if isinstance(getattr(block, "self_attn", None), Attention):
        plan.update({
            "self_attn": prepare(input_layouts=(inp, None, None),
                                 desired_input_layouts=(Replicate(), None, None),
                                 use_local_output=False),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": rowwise(output_layouts=out),
        })
    if isinstance(block.mlp, SwiGLU):
        plan.update({
            "mlp": prepare(input_layouts=(inp,), desired_input_layouts=(Replicate(),),
                           use_local_output=False),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": rowwise(output_layouts=out),
        })
    return plan


def apply_tensor_and_expert_parallel(model: nn.Module, tp_mesh, ep_mesh, expert_mesh,
                                     sequence_parallel: bool = False,
                                     switch: Optional[WholeSequenceSwitch] = None,
                                     ep_dispatch: str = "exact") -> List[str]:
    """TP over `tp_mesh` (None = off) and EP over `ep_mesh` (None = off), in place, on whatever
    parts of the model this rank holds (pipeline stages prune first). Returns the names of the
    replicated parameters whose gradients are partial over tp (per-head q/k norms; under sequence
    parallelism every replicated parameter that computed on one sequence shard). Under sequence
    parallelism `switch` (made here when not given) registers what it flips for decoding.
    `ep_dispatch`: how expert parallelism sends token copies (`parallel.ep_dispatch`)."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    sp = sequence_parallel and tp > 1
    if sp and switch is None:
        switch = WholeSequenceSwitch()
    blocks = [b for b in model.layers.values()]
    if getattr(model, "mtp", None) is not None:
        blocks += [layer.block for layer in model.mtp.layers]

    for block in blocks:
        if tp > 1:
            plan = _block_plan(block, switch if sp else None)
            if plan:
                parallelize_module(block, tp_mesh, plan)
            parallelize_hybrid_mixer(block, tp_mesh, switch if sp else None)
            if getattr(block, "ple", None) is not None:
                parallelize_ple(block, tp_mesh, switch if sp else None)
        if isinstance(block.mlp, MoE):
            block.mlp = parallelize_moe(block.mlp, tp_mesh if tp > 1 else None, ep_mesh,
                                        expert_mesh, switch if sp else None, ep_dispatch)
    if tp > 1:
        if getattr(model, "embed_tokens", None) is not None:
            style = (_SwitchableRowwise(switch, input_layouts=Replicate(),
                                        output_layouts=Shard(1)) if sp
                     else RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
            parallelize_module(model.embed_tokens, tp_mesh, style)
        if getattr(model, "lm_head", None) is not None:
            model.lm_head = VocabParallelHead(model.lm_head.weight, tp_mesh, switch if sp else None,
                                              model.lm_head.backward)
    if not sp:
        # Replicated weights applied to one rank's heads only (per-head q/k norms, Gated DeltaNet's
        # gated norm, MLA's latent projections and norms) or scaling its partial output (the shared
        # expert's gate): gradients partial over tp.
        partial = (".q_norm.", ".k_norm.", ".linear_attn.norm.", ".shared_expert_gate.",
                   *(f".{name}." for name in TP_REPLICATED))
        return [name for name,
                _ in model.named_parameters() if any(k in name for k in partial)] if tp > 1 else []
    model.sequence = SequenceShards(switch, tp_mesh.get_group())
    # every replicated parameter saw one sequence shard, except the QSA indexers: they read the
    # gathered sequence and take their own (identical) loss on every rank, so their gradients are
    # already whole
    return [name for name,
            p in model.named_parameters() if not isinstance(p, DTensor) and ".indexer." not in name]
