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
* PLE: the n-gram table is row-sharded over its stage's whole dp x ep x tp group (`ShardedNGramTable`,
  `shard_ple_tables`: Megatron's vocab-parallel embedding over a larger group), kept out of FSDP: a
  table is never gathered, only the rows a batch touches travel. Each tp rank hashes the whole token
  sequence (every rank has it), keeps its 1/tp slice of the positions' ids, sends each id to the rank
  owning its row (variable all-to-all over the group, counts exchanged first) and gets the rows back
  (the reverse all-to-all, in the compute dtype); the tp ranks then all-gather their slices. Backward
  is the same collectives' autograd: the rows' gradients go back to their owners, which sum every
  batch rank's contribution (added into `.grad` row by row, never a dense gradient of the shard), so
  the table's gradient is complete (never reduced over dp again) and
  each of the G = dp x ep x tp ranks holds 1/G of table, gradient and AdamW moments. Its projections,
  norms and conv stay replicated (small next to the table). Under SP the dilated conv reads up to
  (kernel - 1) * ngram_size previous positions, so the layer runs on the gathered sequence and
  returns this rank's shard; its replicated parameters then see only this shard's output gradient
  (partial over tp, summed like the other SP-partial parameters), and the tp gather of the looked-up
  rows sums their partial gradients (reduce-scatter) before they reach the owners; without SP the
  gradients are whole on every tp rank and each keeps its slice.
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

from .comm import (_all_gather_dim, _reduce_scatter_dim, all_to_all, copy_to_group, gather_along,
                   reduce_from_group, scatter_reduce_along)
from .sharded_params import local, shard_parameter


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

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None, documents=None) -> torch.Tensor:
        return self._exit(GatedDeltaNet.forward(self, self._enter(x_bsh), positions_bs, cache, documents=documents))


class TensorParallelIndexedAttention(_Region, IndexedAttention):
    def reduce_heads(self, head_sums: torch.Tensor) -> torch.Tensor:
        out = head_sums.detach().clone()  # no gradient: the indexer's target and the recall
        dist.all_reduce(out, group=self.tp_group)
        return out

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None, selection=None,
                return_selection: bool = False, documents=None):
        # every tp rank selects the same blocks (the indexer is replicated), so a selection needs no exchange
        out = IndexedAttention.forward(self, self._enter(x_bsh), positions_bs, cache, selection, True,
                                       documents=documents)
        y = self._exit(out[0])
        return (y, out[1]) if return_selection else y


class _GatherSlices(torch.autograd.Function):
    """All-gather the tp ranks' slices along `dim`. Backward: `partial` (the caller keeps one sequence
    shard of what it computes: SP) reduce-scatters the gradient, else (whole, identical gradients on
    every tp rank) keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, dim, partial):
        ctx.group, ctx.dim, ctx.partial, ctx.n = group, dim, partial, x.shape[dim]
        ctx.rank = dist.get_rank(group)
        return _all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return _reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None, None
        return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n).contiguous(), None, None, None


class _RowsIntoGrad(torch.autograd.Function):
    """F.embedding(rows, w_local) whose backward adds the rows' gradients straight into the parameter's
    (DTensor) `.grad` (index_add_) instead of returning a dense gradient of the whole local shard for
    autograd to add: a micro-batch's backward then costs its touched rows, not another copy of the
    rank's share of the table."""

    @staticmethod
    def forward(ctx, w_local, rows, param):
        ctx.save_for_backward(rows)
        ctx.param = param
        return F.embedding(rows, w_local)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        p = ctx.param
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = local(p.grad)
        g.index_add_(0, rows, grad.to(g.dtype))
        return None, None, None


class ShardedNGramTable(nn.Embedding):
    """PLE's n-gram table with its rows sharded over the stage's dp x ep x tp ranks (`weight` a Shard(0)
    DTensor over the flattened group mesh; see the module docstring). Per lookup of N ids per rank
    (N = B x S x ngram_heads; each tp rank asks for its 1/tp slice of the positions): one all-to-all
    of G counts, one of the ids (4 bytes each) and one of the rows back (N/tp x row x dtype bytes),
    the tp all-gather of the rows (N x row x dtype bytes received); backward the rows' gradients take
    the same ways back."""

    group = None
    """The process group of the weight's mesh (the stage's dp x ep x tp ranks)."""
    row_starts = None
    """[G + 1] first global row of each group rank's shard (and the row count)."""
    row_start = 0
    tp_group = None
    tp_size = 1
    tp_rank = 0
    sequence_parallel = False
    """The caller keeps one sequence shard of its output (the gradients are partial over tp)."""
    exchange_dtype = None
    """Rows travel (and the output is) in this dtype: the compute dtype under mixed precision, as FSDP's
    gathered parameters would be; None: the table's."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        S = ids.shape[1]
        if self.tp_size > 1:  # this tp rank's slice of the positions (padded with row 0 to a multiple)
            per = -(-S // self.tp_size)
            if per * self.tp_size > S:
                ids = F.pad(ids, (0, 0, 0, per * self.tp_size - S))
            ids = ids[:, self.tp_rank * per:(self.tp_rank + 1) * per]
        rows = self._lookup(ids)
        if self.tp_size > 1:
            rows = _GatherSlices.apply(rows, self.tp_group, 1, self.sequence_parallel)[:, :S]
        return rows

    def _starts_on(self, device) -> torch.Tensor:
        cached = getattr(self, "_starts_cache", None)
        if cached is None or cached.device != device:
            cached = self._starts_cache = self.row_starts.to(device)
        return cached

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        w = local(self.weight)
        flat = ids.reshape(-1)
        starts = self._starts_on(flat.device)
        owner = torch.searchsorted(starts[1:-1], flat, right=True)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=starts.numel() - 1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()  # the lookup's one host round trip
        id_dtype = torch.int32 if self.weight.shape[0] < 2**31 else torch.long
        asked = flat[order].to(id_dtype)
        wanted = asked.new_empty(sum(recv))
        dist.all_to_all_single(wanted, asked, recv, send, group=self.group)
        rows = wanted.long() - self.row_start
        found = _RowsIntoGrad.apply(w, rows, self.weight) if w.requires_grad else F.embedding(rows, w)
        if self.exchange_dtype is not None:
            found = found.to(self.exchange_dtype)
        back = all_to_all(found, recv, send, self.group)  # this rank's ids' rows, sorted by owner
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return back.index_select(0, inverse).view(*ids.shape, w.shape[1])


class TensorParallelPLE(PLELayer):
    """PLE with a row-sharded table; under SP it runs on the gathered sequence and returns this rank's
    shard (the conv's window reaches into the previous ranks' positions)."""

    tp_group = None
    tp_rank = 0
    sequence_parallel = False

    def forward(self, x_bsX, input_ids_bs, positions_bs=None, cache=None, documents=None):
        if not self.sequence_parallel:
            return PLELayer.forward(self, x_bsX, input_ids_bs, positions_bs, cache, documents)
        s = x_bsX.shape[1]
        out = PLELayer.forward(self, gather_along(x_bsX, self.tp_group, 1), input_ids_bs, positions_bs, cache,
                               documents)
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


def shard_ple_tables(model: nn.Module, group_mesh, exchange_dtype=None) -> List[str]:
    """Row-shard every PLE table of this rank's layers over `group_mesh` (1-D: the stage's flattened
    dp x ep x tp ranks), before TP (`parallelize_ple` adds the tp slicing) and FSDP (which must leave the
    returned parameters alone). Returns the tables' parameter names."""
    names = []
    group, size, rank = group_mesh.get_group(), group_mesh.size(), group_mesh.get_local_rank()
    if rank != dist.get_rank(group):
        raise RuntimeError("the PLE table's mesh coordinate and group rank disagree")
    for i, block in model.layers.items():
        ple = getattr(block, "ple", None)
        if ple is None:
            continue
        table = ple.ple_embedding.ngram_embedding
        rows = table.weight.shape[0]
        shard_parameter(table, "weight", group_mesh, [Shard(0)])
        table.__class__ = ShardedNGramTable
        offsets = [Shard(0)._local_shard_size_and_offset(rows, size, r)[1] for r in range(size)]
        table.row_starts = torch.tensor([min(o, rows) for o in offsets] + [rows], dtype=torch.long)
        table.row_start = _row_start(table.weight)
        if table.row_start != int(table.row_starts[rank]):
            raise RuntimeError("unexpected DTensor row split of the PLE table")
        table.group, table.exchange_dtype = group, exchange_dtype
        names.append(f"layers.{i}.ple.ple_embedding.ngram_embedding.weight")
    return names


def parallelize_ple(ple: PLELayer, tp_mesh, sequence_parallel: bool) -> List[nn.Module]:
    """PLE under tp: the layer runs on the gathered sequence under SP, and a table sharded by
    `shard_ple_tables` looks up one slice of the positions per tp rank. Returns the modules whose
    `sequence_parallel` decoding flips."""
    table = ple.ple_embedding.ngram_embedding
    if not isinstance(table, ShardedNGramTable):
        raise RuntimeError("shard_ple_tables must shard the PLE tables before tensor parallelism")
    ple.__class__ = TensorParallelPLE
    ple.tp_group, ple.tp_rank = tp_mesh.get_group(), tp_mesh.get_local_rank()
    table.tp_group, table.tp_size, table.tp_rank = ple.tp_group, tp_mesh.size(), ple.tp_rank
    for m in (table, ple):
        m.sequence_parallel = sequence_parallel
    return [table, ple]
