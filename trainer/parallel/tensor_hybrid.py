"""Tensor and sequence parallelism for Qwen4-Exp's layers: Gated DeltaNet, QSA, PLE, hyper-connections.

tensor.py applies torch's DTensor styles to full attention and dense MLPs; the hybrid token mixers
are Megatron-style regions written with comm.py's autograd collectives instead, because they hold
parameters that are not nn.Linear (the depthwise conv, A_log, dt_bias) and a replicated part (the
QSA indexer) that must read the whole input as a plain tensor. A mixer's class is swapped for a
subclass whose forward is

    enter (all-gather the sequence under SP, else identity with an all-reduced input gradient)
    -> the unchanged single-process forward on this rank's heads (`_ShardedLinear` projections
       compute with their local shards)
    -> exit (reduce-scatter the partial output under SP, else all-reduce it).

* Gated DeltaNet: in_proj_qkv and the conv1d channels are stored by key-head group ([q_g | k_g | v_g],
  see models/gated_deltanet.py), so Shard(0) with linear_num_key_heads % tp == 0 gives each rank whole
  groups; in_proj_z/b/a, dt_bias and A_log shard by value heads (the same groups), out_proj is
  row-parallel, and the gated norm's weight (per head_v_dim) is replicated with its gradient partial
  over tp (summed by the GradientFinisher). The recurrence needs the whole sequence, hence the
  gather on entry under SP.
* QSA: q_proj (per head [query | gate]), k_proj and v_proj are column-parallel by heads, o_proj
  row-parallel, q_norm/k_norm replicated (partial gradients, like Qwen3's qk_norm). The indexer is
  replicated and reads the whole (gathered) input on every rank, so every rank scores the same
  blocks and selects the same positions. Its KL target and the recall sum over all heads:
  `reduce_heads` all-reduces the per-rank head sums over tp before they are normalised. The loss is
  then identical on every rank and each rank's indexer gradient is already the whole gradient (never
  summed over tp, SP or not); the replicas agree.
* PLE: the n-gram table is row-sharded over tp (`VocabParallelNGramTable`: masked local lookup, sum
  over tp), never held whole by one rank; ids are hashed from the whole token sequence, which every
  rank has. Its projections, norms and conv stay replicated (small next to the table). Under SP the
  dilated conv reads up to (kernel - 1) * ngram_size previous positions, so the layer runs on the
  gathered sequence and returns this rank's shard; its replicated parameters then see only this
  shard's output gradient (partial over tp, summed like the other SP-partial parameters), and the
  table lookup's output gradient is all-reduced before it reaches the rows.
* Hyper-connections and the qwen4_exp drafter's fc/norms are replicated: with whole activations
  their gradients are complete on every rank; under SP they compute on sequence shards and their
  gradients are partial over tp (`sp_partial_names` in tensor.py).

Decoding switches SP off (tensor.SequenceParallelSwitch flags these modules): regions then take and
return whole sequences, and each rank's decoder state holds its own heads (GDN rings, QSA KV buffers);
QSA's raw indexer keys are replicated.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tandem.models.gated_deltanet import GatedDeltaNet
from tandem.models.ple import PLELayer
from tandem.models.qsa import IndexedAttention

from .comm import copy_to_group, gather_along, reduce_from_group, scatter_reduce_along
from .tensor import local, shard_parameter


class _ShardedLinear(nn.Linear):
    """nn.Linear computing with its local shard: Shard(0) gives this rank's output features
    (column-parallel), Shard(1) a partial sum over tp (row-parallel). No bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, local(self.weight))


def _shard_linear(linear: nn.Linear, mesh, dim: int) -> None:
    if linear.bias is not None:
        raise ValueError("tensor_hybrid shards bias-free projections only")
    shard_parameter(linear, "weight", mesh, [Shard(dim)])
    linear.__class__ = _ShardedLinear


class _Region:
    """A token mixer computing its own heads over the whole sequence (see the module docstring)."""

    tp_group = None
    sequence_parallel = False

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_along(x, self.tp_group, 1) if self.sequence_parallel else copy_to_group(x, self.tp_group)

    def _exit(self, y: torch.Tensor) -> torch.Tensor:
        return scatter_reduce_along(y, self.tp_group, 1) if self.sequence_parallel else reduce_from_group(y, self.tp_group)


class TensorParallelGatedDeltaNet(_Region, GatedDeltaNet):
    def computed_params(self):
        return local(self.conv1d.weight), local(self.A_log), local(self.dt_bias)

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None) -> torch.Tensor:
        return self._exit(GatedDeltaNet.forward(self, self._enter(x_bsh), positions_bs, cache))


class TensorParallelIndexedAttention(_Region, IndexedAttention):
    def reduce_heads(self, head_sums: torch.Tensor) -> torch.Tensor:
        out = head_sums.detach().clone()  # no gradient: the indexer's target and the recall
        dist.all_reduce(out, group=self.tp_group)
        return out

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None) -> torch.Tensor:
        return self._exit(IndexedAttention.forward(self, self._enter(x_bsh), positions_bs, cache))


class VocabParallelNGramTable(nn.Embedding):
    """PLE's n-gram table with its rows sharded over tp (`weight` a Shard(0) DTensor): each rank looks
    up the ids that fall in its rows (others masked to zero) and the results are summed over tp.
    `sequence_parallel`: the output's gradient is partial over tp (the caller keeps one sequence shard
    of what it computes from it), so it is all-reduced in backward before reaching the rows."""

    tp_group = None
    row_start = 0
    sequence_parallel = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = local(self.weight)
        local_ids = ids - self.row_start
        inside = (local_ids >= 0) & (local_ids < w.shape[0])
        if w.shape[0] > 0:
            part = F.embedding(torch.where(inside, local_ids, 0), w)
        else:  # an uneven split left this rank no rows
            part = w.new_zeros(*ids.shape, w.shape[1]) + w.sum() * 0
        out = reduce_from_group(part.masked_fill(~inside.unsqueeze(-1), 0.0), self.tp_group)
        return copy_to_group(out, self.tp_group) if self.sequence_parallel else out


class TensorParallelPLE(PLELayer):
    """PLE with a row-sharded table; under SP it runs on the gathered sequence and returns this rank's
    shard (the conv's window reaches into the previous ranks' positions)."""

    tp_group = None
    tp_rank = 0
    sequence_parallel = False

    def forward(self, x_bsX, input_ids_bs, positions_bs=None, cache=None):
        if not self.sequence_parallel:
            return PLELayer.forward(self, x_bsX, input_ids_bs, positions_bs, cache)
        s = x_bsX.shape[1]
        out = PLELayer.forward(self, gather_along(x_bsX, self.tp_group, 1), input_ids_bs, positions_bs, cache)
        return out[:, self.tp_rank * s:(self.tp_rank + 1) * s]


def _row_start(weight: DTensor) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return int(offset[0]) if offset else 0


def parallelize_hybrid_mixer(mixer: nn.Module, tp_mesh, sequence_parallel: bool) -> bool:
    """Shard a Gated DeltaNet or QSA mixer over tp in place; False for other mixer kinds."""
    if isinstance(mixer, GatedDeltaNet):
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            _shard_linear(getattr(mixer, name), tp_mesh, 0)
        _shard_linear(mixer.out_proj, tp_mesh, 1)
        shard_parameter(mixer.conv1d, "weight", tp_mesh, [Shard(0)])
        shard_parameter(mixer, "A_log", tp_mesh, [Shard(0)])
        shard_parameter(mixer, "dt_bias", tp_mesh, [Shard(0)])
        mixer.__class__ = TensorParallelGatedDeltaNet
    elif isinstance(mixer, IndexedAttention):
        for name in ("q_proj", "k_proj", "v_proj"):
            _shard_linear(getattr(mixer, name), tp_mesh, 0)
        _shard_linear(mixer.o_proj, tp_mesh, 1)
        mixer.__class__ = TensorParallelIndexedAttention
    else:
        return False
    mixer.tp_group, mixer.sequence_parallel = tp_mesh.get_group(), sequence_parallel
    return True


def parallelize_ple(ple: PLELayer, tp_mesh, sequence_parallel: bool) -> List[nn.Module]:
    """Row-shard the PLE table over tp; returns the modules whose `sequence_parallel` decoding flips."""
    table = ple.ple_embedding.ngram_embedding
    shard_parameter(table, "weight", tp_mesh, [Shard(0)])
    table.__class__ = VocabParallelNGramTable
    table.tp_group, table.row_start = tp_mesh.get_group(), _row_start(table.weight)
    ple.__class__ = TensorParallelPLE
    ple.tp_group, ple.tp_rank = tp_mesh.get_group(), tp_mesh.get_local_rank()
    for m in (table, ple):
        m.sequence_parallel = sequence_parallel
    return [table, ple]
