"""Tensor and sequence parallelism for Qwen4-Exp's layers (Gated DeltaNet, QSA, PLE,
hyper-connections) and for MLA.

tensor.py applies torch's DTensor styles to full attention and dense MLPs; the hybrid token mixers
are Megatron-style regions written with comm.py's autograd collectives instead, because they hold
parameters that are not nn.Linear (the depthwise conv, A_log, dt_bias) and a replicated part (the
QSA indexer) that must read the whole input as a plain tensor. A mixer is replaced by a parallel
module built from it (`TensorParallelGatedDeltaNet(mixer, tp_mesh, switch)`: a subclass of the
layer's class that adopts its parameters, buffers and submodules under the same names, so
checkpoints and DCP resharding see the single-process names) whose forward is

    enter (all-gather the sequence under SP, else identity with an all-reduced input gradient)
    -> the unchanged single-process forward on this rank's heads (`ShardedLinear` projections
       compute with their local shards)
    -> exit (reduce-scatter the partial output under SP, else all-reduce it).

No layer's class is reassigned and no attribute is set on a model layer: what a parallel module
needs (its group, the sequence-parallel switch) are its constructor's arguments.

* Gated DeltaNet: in_proj_qkv and the conv1d channels are stored by key-head group ([q_g | k_g |
  v_g], see models/gated_deltanet.py), so Shard(0) with linear_num_key_heads % tp == 0 gives each
  rank whole groups; in_proj_z/b/a, dt_bias and A_log shard by value heads (the same groups),
  out_proj is row-parallel, and the gated norm's weight (per head_v_dim) is replicated with its
  gradient partial over tp (summed by the GradientFinisher). The recurrence needs the whole
  sequence, hence the gather on entry under SP.
* QSA: q_proj (per head [query | gate]), k_proj and v_proj are column-parallel by heads, o_proj
  row-parallel, q_norm/k_norm replicated (partial gradients, like Qwen3's qk_norm). The indexer is
  replicated and reads the whole (gathered) input on every rank, so every rank scores the same
  blocks and selects the same positions. Its KL target and the recall sum over all heads:
  `reduce_heads` all-reduces the per-rank head sums over tp before they are normalised. The loss is
  then identical on every rank and each rank's indexer gradient is already the whole gradient (never
  summed over tp, SP or not); the replicas agree.
* PLE: the n-gram table is row-sharded over its stage's whole dp x ep x tp group
  (`ShardedNGramTable`, `shard_ple_tables`: Megatron's vocab-parallel embedding over a larger
  group), kept out of FSDP: a table is never gathered, only the rows a batch touches travel. Each tp
  rank hashes the whole token sequence (every rank has it), keeps its 1/tp slice of the positions'
  ids, sends each id to the rank owning its row (variable all-to-all over the group, counts
  exchanged first) and gets the rows back (the reverse all-to-all, in the compute dtype); the tp
  ranks then all-gather their slices. Backward is the same collectives' autograd: the rows'
  gradients go back to their owners, which sum every batch rank's contribution (added into `.grad`
  row by row, never a dense gradient of the shard), so the table's gradient is complete (never
  reduced over dp again) and each of the G = dp x ep x tp ranks holds 1/G of table, gradient and
  AdamW moments. Its projections, norms and conv stay replicated (small next to the table). Under SP
  the dilated conv reads up to (kernel - 1) * ngram_size previous positions, so the layer runs on
  the gathered sequence and returns this rank's shard; its replicated parameters then see only this
  shard's output gradient (partial over tp, summed like the other SP-partial parameters), and the tp
  gather of the looked-up rows sums their partial gradients (reduce-scatter) before they reach the
  owners; without SP the gradients are whole on every tp rank and each keeps its slice.
* Hyper-connections and the qwen4_exp drafter's fc/norms are replicated: with whole activations
  their gradients are complete on every rank; under SP they compute on sequence shards and their
  gradients are partial over tp (`sp_partial_names` in tensor.py).

Decoding switches SP off (the modules read `state.WholeSequenceSwitch.on`): regions then take and
return whole sequences, and each rank's decoder state holds its own heads (GDN rings, QSA KV
buffers); QSA's raw indexer keys are replicated.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tandem.models.gated_deltanet import GatedDeltaNet
from tandem.models.latent_attention import LatentAttention
from tandem.models.ple import PLELayer
from tandem.models.qsa import IndexedAttention

from .comm import (
    all_gather_dim,
    all_to_all,
    copy_to_group,
    gather_along,
    reduce_from_group,
    reduce_scatter_dim,
    scatter_reduce_along,
)
from .sharded_params import (
    adopt,
    local,
    replace_child,
    shard_parameter,
    sharded_parameter,
)


class ShardedLinear(nn.Linear):
    """A bias-free nn.Linear computing with its local shard, built from one: weight Shard(0) gives
    this rank's output features (column-parallel), Shard(1) a partial sum over tp (row-parallel)."""

    def __init__(self, linear: nn.Linear, mesh, dim: int):
        if linear.bias is not None:
            raise ValueError("tensor_hybrid shards bias-free projections only")
        nn.Module.__init__(self)
        adopt(self, linear)
        self.weight = sharded_parameter(linear.weight, mesh, [Shard(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, local(self.weight))


def _sequence_parallel(switch) -> bool:
    return switch is not None and switch.on


class _Region:
    """A token mixer computing its own heads over the whole sequence (see the module docstring)."""

    def _init_region(self, tp_mesh, switch) -> None:
        self.tp_group = tp_mesh.get_group()
        self.switch = switch
        """state.WholeSequenceSwitch under sequence parallelism (its `on` says whether the input is
        a sequence shard), else None."""

    @property
    def sequence_parallel(self) -> bool:
        return _sequence_parallel(self.switch)

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_along(x, self.tp_group,
                            1) if self.sequence_parallel else copy_to_group(x, self.tp_group)

    def _exit(self, y: torch.Tensor) -> torch.Tensor:
        return (
            scatter_reduce_along(y, self.tp_group, 1)
            if self.sequence_parallel
            else reduce_from_group(y, self.tp_group)
        )


class TensorParallelGatedDeltaNet(_Region, GatedDeltaNet):
    """Gated DeltaNet on this rank's key-head groups (see the module docstring)."""

    def __init__(self, layer: GatedDeltaNet, tp_mesh, switch=None):
        nn.Module.__init__(self)
        adopt(self, layer)
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            setattr(self, name, ShardedLinear(getattr(layer, name), tp_mesh, 0))
        self.out_proj = ShardedLinear(layer.out_proj, tp_mesh, 1)
        shard_parameter(self.conv1d, "weight", tp_mesh, [Shard(0)])
        self.A_log = sharded_parameter(layer.A_log, tp_mesh, [Shard(0)])
        self.dt_bias = sharded_parameter(layer.dt_bias, tp_mesh, [Shard(0)])
        self._init_region(tp_mesh, switch)

    def computed_params(self):
        return local(self.conv1d.weight), local(self.A_log), local(self.dt_bias)

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None, documents=None,
                context=None) -> torch.Tensor:
        return self._exit(GatedDeltaNet.forward(self, self._enter(x_bsh), positions_bs, cache,
                                                documents=documents, context=context))


class TensorParallelIndexedAttention(_Region, IndexedAttention):
    """QSA on this rank's heads with a replicated indexer (see the module docstring)."""

    def __init__(self, layer: IndexedAttention, tp_mesh, switch=None):
        nn.Module.__init__(self)
        adopt(self, layer)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, ShardedLinear(getattr(layer, name), tp_mesh, 0))
        self.o_proj = ShardedLinear(layer.o_proj, tp_mesh, 1)
        self._init_region(tp_mesh, switch)

    def reduce_heads(self, head_sums: torch.Tensor) -> torch.Tensor:
        out = head_sums.detach().clone()  # no gradient: the indexer's target and the recall
        dist.all_reduce(out, group=self.tp_group)
        return out

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None, selection=None,
                return_selection: bool = False, documents=None, context=None, dense: bool = False,
                aux_grad_scale: float = 1.0, counted=None):
        # every tp rank selects the same blocks (the indexer is replicated), so a selection needs no
        # exchange
        out = IndexedAttention.forward(self, self._enter(x_bsh), positions_bs, cache, selection,
                                       True, documents=documents, context=context, dense=dense,
                                       aux_grad_scale=aux_grad_scale, counted=counted)
        y = self._exit(out[0])
        return (y, out[1]) if return_selection else y


class TensorParallelLatentAttention(_Region, LatentAttention):
    """MLA on this rank's heads: q_proj / q_b_proj and kv_b_proj column-parallel by heads, o_proj
    row-parallel; q_a_proj, kv_a_proj_with_mqa and their norms replicated, each rank computing the
    whole latent and shared rotary key, so their gradients are partial over tp (summed by the
    GradientFinisher)."""

    def __init__(self, layer: LatentAttention, tp_mesh, switch=None):
        nn.Module.__init__(self)
        adopt(self, layer)
        for name in ("q_b_proj" if layer.compressed_queries else "q_proj", "kv_b_proj"):
            setattr(self, name, ShardedLinear(getattr(layer, name), tp_mesh, 0))
        self.o_proj = ShardedLinear(layer.o_proj, tp_mesh, 1)
        self._init_region(tp_mesh, switch)

    def expansion_weight(self) -> torch.Tensor:
        return local(self.kv_b_proj.weight)

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None, documents=None,
                context=None) -> torch.Tensor:
        return self._exit(LatentAttention.forward(self, self._enter(x_bsh), positions_bs, cache,
                                                  documents=documents, context=context))


class _GatherSlices(torch.autograd.Function):
    """All-gather the tp ranks' slices along `dim`. Backward: `partial` (the caller keeps one
    sequence shard of what it computes: SP) reduce-scatters the gradient, else (whole, identical
    gradients on every tp rank) keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, dim, partial):
        ctx.group, ctx.dim, ctx.partial, ctx.n = group, dim, partial, x.shape[dim]
        ctx.rank = dist.get_rank(group)
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None, None
        return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n).contiguous(), None, None, None


class _RowsIntoGrad(torch.autograd.Function):
    """F.embedding(rows, w_local) whose backward adds the rows' gradients straight into the
    parameter's (DTensor) `.grad` (index_add_) instead of returning a dense gradient of the whole
    local shard for autograd to add: a micro-batch's backward then costs its touched rows, not
    another copy of the rank's share of the table."""

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
    """PLE's n-gram table with its rows sharded over the stage's dp x ep x tp ranks (`weight` a
    Shard(0) DTensor over the flattened group mesh; see the module docstring). Per lookup of N ids
    per rank (N = B x S x ngram_heads; each tp rank asks for its 1/tp slice of the positions): one
    all-to-all of G counts, one of the ids (4 bytes each) and one of the rows back (N/tp x row x
    dtype bytes), the tp all-gather of the rows (N x row x dtype bytes received); backward the rows'
    gradients take the same ways back. Built from the model's table (`shard_ple_tables`);
    `with_tensor_parallel` gives the table that also slices the positions over tp
    (`parallelize_ple`)."""

    def __init__(self, table: nn.Embedding, group_mesh, exchange_dtype=None, tp_mesh=None,
                 switch=None):
        nn.Module.__init__(self)
        adopt(self, table)
        rows, size = table.weight.shape[0], group_mesh.size()
        if not isinstance(table.weight, DTensor):
            self.weight = sharded_parameter(table.weight, group_mesh, [Shard(0)])
        self.group_mesh = group_mesh
        self.group = group_mesh.get_group()
        """The process group of the weight's mesh (the stage's dp x ep x tp ranks)."""
        offsets = [Shard(0)._local_shard_size_and_offset(rows, size, r)[1] for r in range(size)]
        self.row_starts = torch.tensor([min(o, rows) for o in offsets] + [rows], dtype=torch.long)
        """[G + 1] first global row of each group rank's shard (and the row count)."""
        self.row_start = _row_start(self.weight)
        if self.row_start != int(self.row_starts[group_mesh.get_local_rank()]):
            raise RuntimeError("unexpected DTensor row split of the PLE table")
        self.exchange_dtype = exchange_dtype
        """Rows travel (and the output is) in this dtype: the compute dtype under mixed precision,
        as FSDP's gathered parameters would be; None: the table's."""
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        self.tp_size = tp_mesh.size() if tp_mesh is not None else 1
        self.tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
        self.switch = switch
        """state.WholeSequenceSwitch under sequence parallelism: while `on`, the caller keeps one
        sequence shard of the output (the gradients are partial over tp); None without SP."""
        self._starts_cache = None

    def with_tensor_parallel(self, tp_mesh, switch=None) -> "ShardedNGramTable":
        """This table (same parameter) looking up one 1/tp slice of the positions per tp rank."""
        return ShardedNGramTable(self, self.group_mesh, self.exchange_dtype, tp_mesh, switch)

    @property
    def sequence_parallel(self) -> bool:
        return _sequence_parallel(self.switch)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        S = ids.shape[1]
        # this tp rank's slice of the positions (padded with row 0 to a multiple)
        if self.tp_size > 1:
            per = -(-S // self.tp_size)
            if per * self.tp_size > S:
                ids = F.pad(ids, (0, 0, 0, per * self.tp_size - S))
            ids = ids[:, self.tp_rank * per:(self.tp_rank + 1) * per]
        rows = self._lookup(ids)
        if self.tp_size > 1:
            rows = _GatherSlices.apply(rows, self.tp_group, 1, self.sequence_parallel)[:, :S]
        return rows

    def _starts_on(self, device) -> torch.Tensor:
        cached = self._starts_cache
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
        found = _RowsIntoGrad.apply(w, rows, self.weight) if w.requires_grad else F.embedding(rows,
                                                                                              w)
        if self.exchange_dtype is not None:
            found = found.to(self.exchange_dtype)
        back = all_to_all(found, recv, send, self.group)  # this rank's ids' rows, sorted by owner
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return back.index_select(0, inverse).view(*ids.shape, w.shape[1])


class TensorParallelPLE(PLELayer):
    """PLE with a row-sharded table; under SP it runs on the gathered sequence and returns this
    rank's shard (the conv's window reaches into the previous ranks' positions)."""

    def __init__(self, layer: PLELayer, tp_mesh, switch=None):
        nn.Module.__init__(self)
        adopt(self, layer)
        self.tp_group, self.tp_rank = tp_mesh.get_group(), tp_mesh.get_local_rank()
        self.switch = switch
        """state.WholeSequenceSwitch under sequence parallelism, else None."""

    @property
    def sequence_parallel(self) -> bool:
        return _sequence_parallel(self.switch)

    def forward(self, x_bsX, input_ids_bs, positions_bs=None, cache=None, documents=None,
                context=None):
        if not self.sequence_parallel:
            return PLELayer.forward(self, x_bsX, input_ids_bs, positions_bs, cache, documents,
                                    context)
        s = x_bsX.shape[1]
        out = PLELayer.forward(self, gather_along(x_bsX, self.tp_group, 1), input_ids_bs,
                               positions_bs, cache, documents, context)
        return out[:, self.tp_rank * s:(self.tp_rank + 1) * s]


def _row_start(weight: DTensor) -> int:
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh,
                                                      weight.placements)
    return int(offset[0]) if offset else 0


def parallelize_hybrid_mixer(block: nn.Module, tp_mesh, switch=None) -> bool:
    """Replace `block`'s Gated DeltaNet, QSA or MLA mixer by its tensor-parallel module; False for
    other mixer kinds. `switch`: state.WholeSequenceSwitch under sequence parallelism, else None."""
    mixer = block.mixer
    if isinstance(mixer, GatedDeltaNet):
        replace_child(block, mixer, TensorParallelGatedDeltaNet(mixer, tp_mesh, switch))
    elif isinstance(mixer, IndexedAttention):
        replace_child(block, mixer, TensorParallelIndexedAttention(mixer, tp_mesh, switch))
    elif isinstance(mixer, LatentAttention):
        replace_child(block, mixer, TensorParallelLatentAttention(mixer, tp_mesh, switch))
    else:
        return False
    return True


def shard_ple_tables(model: nn.Module, group_mesh, exchange_dtype=None) -> List[str]:
    """Row-shard every PLE table of this rank's layers over `group_mesh` (1-D: the stage's flattened
    dp x ep x tp ranks), before TP (`parallelize_ple` adds the tp slicing) and FSDP (which must
    leave the returned parameters alone). Returns the tables' parameter names."""
    names = []
    if group_mesh.get_local_rank() != dist.get_rank(group_mesh.get_group()):
        raise RuntimeError("the PLE table's mesh coordinate and group rank disagree")
    for i, block in model.layers.items():
        ple = getattr(block, "ple", None)
        if ple is None:
            continue
        table = ple.ple_embedding.ngram_embedding
        replace_child(ple.ple_embedding, table,
                      ShardedNGramTable(table, group_mesh, exchange_dtype))
        names.append(f"layers.{i}.ple.ple_embedding.ngram_embedding.weight")
    return names


def parallelize_ple(block: nn.Module, tp_mesh, switch=None) -> None:
    """Replace `block`'s PLE layer by its tensor-parallel module: it runs on the gathered sequence
    under SP (`switch`: state.WholeSequenceSwitch, else None), and its table, sharded by
    `shard_ple_tables`, looks up one slice of the positions per tp rank."""
    table = block.ple.ple_embedding.ngram_embedding
    if not isinstance(table, ShardedNGramTable):
        raise RuntimeError("shard_ple_tables must shard the PLE tables before tensor parallelism")
    replace_child(block.ple.ple_embedding, table, table.with_tensor_parallel(tp_mesh, switch))
    replace_child(block, block.ple, TensorParallelPLE(block.ple, tp_mesh, switch))
