"""Expert parallelism (and the experts' tensor-parallel split): routed experts sharded over (ep,
tp), tokens dispatched to their experts' ranks by all-to-all and back, dropless
(`parallel.ep_dispatch`: exact counts, or fixed-capacity padded blocks with the counts on the
device); under tp the MoE layer's partial outputs are reduced (reduce-scattered under sequence
parallelism)."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from tandem.models.experts import GroupedExperts, expert_swiglu
from tandem.models.moe import AuxLossGrad, MoE, inverse_permutation

from .comm import copy_to_group, gather_along, reduce_from_group, scatter_reduce_along
from .sharded_params import (
    adopt,
    local,
    replace_child,
    shard_parameter,
    sharded_parameter,
)
from .state import WholeSequenceSwitch


# --- experts -------------------------------------------------------------------------------------
class _InFlight(NamedTuple):
    """A dispatch between `ParallelExperts.dispatch` and `forward`."""

    x: torch.Tensor
    """The received token copies (an all-to-all's output, waited for when first read)."""
    recv_ct: torch.Tensor
    """[ep source, local expert] copies received (device)."""
    pos: Optional[torch.Tensor]
    """`padded`: row of the send buffer each sorted copy went to (its result comes back there); None
    under `exact`."""
    back_splits: Optional[Tuple[List[int], List[int]]]
    """`exact`: (output, input) split sizes of the all-to-all back; None under `padded`."""


class ParallelExperts(GroupedExperts):
    """GroupedExperts whose expert dim is sharded over ep and intermediate dim over tp, built from
    the model's layer (its parameters, under the same names, become DTensors over `expert_mesh`).

    Token copies arrive sorted by (global) expert with per-expert counts (a device tensor); they are
    sent to the ep rank holding their expert (counts exchanged first, then an all-to-all of the
    copies: dropless), regrouped expert-major on the device, computed on the local shards, and sent
    back in the original order. The count exchange starts in `prepare`, before the caller gathers
    the token copies; the copies' all-to-all starts in `dispatch`, and the caller computes the
    shared expert before `forward` reads what arrived. Under tp the output is a partial sum (the
    caller reduces it once per layer).

    Two dispatches (`parallel.ep_dispatch`), equal in outputs and gradients:
    * `exact`: each destination gets exactly its copies, a variable-size all-to-all whose split
      sizes the host reads back: the layer's one device-to-host sync (traced as symbolic sizes under
      `train.compile`).
    * `padded` (training forwards): each destination gets a block of `capacity` rows, the most
      copies one destination can receive from this rank (each token's top-k experts are distinct, so
      at most min(top_k, experts per rank) of its copies share a rank), which makes the block size a
      static shape; rows past the counts are padding. The receiver finds each row's expert from the
      exchanged counts with device-side index maths, computes the valid rows only (the grouped
      matmul's offsets end at the valid rows; the padding rows' outputs are never read), and the
      results go back the same way. No host sync.

    The exchanges are functional collectives (an op with an output, not an in-place write), so
    selective activation checkpointing keeps their outputs and a recomputation in backward neither
    re-sends tokens nor waits on the other ranks (activation_checkpoint.py).
    """

    def __init__(self, experts: GroupedExperts, num_experts: int, top_k: int, ep_mesh=None,
                 expert_mesh=None,
                 tp: int = 1, ep_dispatch: str = "exact"):
        nn.Module.__init__(self)
        adopt(self, experts)
        self.ep_size = ep_mesh.size() if ep_mesh is not None else 1
        self.ep_group = ep_mesh.get_group() if self.ep_size > 1 else None
        self.num_experts, self.top_k = num_experts, top_k
        self.ep_dispatch = ep_dispatch  # parallel.ep_dispatch
        if expert_mesh is not None:
            ep = [Shard(0)] if self.ep_size > 1 else []
            inter, hidden = ([Shard(1)], [Shard(2)]) if tp > 1 else ([], [])
            self.gate_proj = sharded_parameter(experts.gate_proj, expert_mesh, ep + inter)
            self.up_proj = sharded_parameter(experts.up_proj, expert_mesh, ep + inter)
            self.down_proj = sharded_parameter(experts.down_proj, expert_mesh, ep + hidden)
        self._exchange = None
        self._in_flight: Optional[_InFlight] = None

    def prepare(self, counts: torch.Tensor) -> None:
        if self.ep_size > 1:
            send_ct = counts.view(self.ep_size, -1)
            # asynchronous: the result waits for the exchange when first read
            self._exchange = (send_ct, funcol.all_to_all_single(send_ct, None, None, self.ep_group))

    def dispatch(self, x_sorted_nh: torch.Tensor, counts: torch.Tensor) -> None:
        if self.ep_size == 1:
            return
        if self._exchange is None:  # a caller that skipped `prepare`
            self.prepare(counts)
        (send_ct, recv_ct), self._exchange = self._exchange, None
        group = self.ep_group
        # decoding may hand ep ranks different token counts (one capacity each): only `exact` fits
        if self.ep_dispatch == "padded" and torch.is_grad_enabled():
            ep, n_local = send_ct.shape
            capacity = x_sorted_nh.shape[0] // self.top_k * min(self.top_k, n_local)
            # sorted copy i goes to destination d (its expert's rank), row i - (d's first copy) of
            # block d
            dest_ct = send_ct.sum(1)
            dest_end = dest_ct.cumsum(0)
            i = torch.arange(x_sorted_nh.shape[0], device=x_sorted_nh.device)
            d = torch.searchsorted(dest_end, i, right=True)
            pos = d * capacity + i - (dest_end - dest_ct)[d]
            send = x_sorted_nh.new_zeros(ep * capacity,
                                         x_sorted_nh.shape[1]).index_copy(0, pos, x_sorted_nh)
            x = funcol.all_to_all_single_autograd(send, None, None, group)
            self._in_flight = _InFlight(x, recv_ct, pos, None)
        else:
            send_splits, recv_splits = torch.stack([send_ct.sum(1), recv_ct.sum(1)]).tolist()
            x = funcol.all_to_all_single_autograd(x_sorted_nh, recv_splits, send_splits, group)
            self._in_flight = _InFlight(x, recv_ct, None, (send_splits, recv_splits))

    def forward(self, x_sorted_nh: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return expert_swiglu(x_sorted_nh, counts, local(self.gate_proj), local(self.up_proj),
                                 local(self.down_proj), self.matmul)
        if self._in_flight is None:  # a caller that skipped `dispatch`
            self.dispatch(x_sorted_nh, counts)
        (x, recv_ct, pos, back_splits), self._in_flight = self._in_flight, None
        # the local shards are taken after the dispatch: where a host read breaks a compiled forward
        # (the exact dispatch's split sizes without dynamo's scalar capture, the expert loop's
        # counts), a view of a DTensor parameter's shard handed across the break makes the shard
        # itself require grad (torch 2.13), so the block's next compiled run, and a checkpoint's
        # recomputation, would pick another graph
        gate, up, down = local(self.gate_proj), local(self.up_proj), local(self.down_proj)
        # received rows are source-major ([src][local expert], padded blocks: valid rows first);
        # regroup them expert-major (stable within a block, padding last) by a device-side sort of
        # each row's (expert, source) key
        ep, n_local = recv_ct.shape
        if pos is None:  # exact: blocks packed back to back
            block = torch.repeat_interleave(torch.arange(ep * n_local, device=recv_ct.device),
                                            recv_ct.flatten(), output_size=x.shape[0])
            src, expert = block // n_local, block % n_local
        # padded: block s is rows s*capacity.., its row p belongs to the first expert whose count
        # ends past p
        else:
            capacity = x.shape[0] // ep
            rows = torch.arange(x.shape[0], device=recv_ct.device)
            src = rows // capacity
            expert = torch.searchsorted(recv_ct.cumsum(1), (rows % capacity).view(ep, capacity),
                                        right=True).flatten()
        # padding rows (expert == n_local) sort last
        perm = torch.argsort(expert * ep + src, stable=True)
        # index_select, not indexing: a permutation's gradient is a gather too (each row written
        # once), where indexing's backward is an accumulating index_put, several times slower on CPU
        y = expert_swiglu(x.index_select(0, perm), recv_ct.sum(0), gate, up, down, self.matmul)
        y = y.index_select(0, inverse_permutation(perm))
        if pos is None:
            return funcol.all_to_all_single_autograd(y, *back_splits, self.ep_group)
        return funcol.all_to_all_single_autograd(y, None, None, self.ep_group).index_select(0, pos)


class TensorParallelMoE(MoE):
    """MoE whose routed and shared experts run on tp shards; one all-reduce joins their outputs.

    The router is replicated and sees the full input. Routed outputs are partial sums, so the
    routing weights that scale them get their (partial) gradients summed over tp in backward.
    Built from the model's layer (same submodules and names); the shared expert's weights become tp
    shards. `switch`: the WholeSequenceSwitch under sequence parallelism (tokens are this rank's
    sequence shard while it is on), else None.
    """

    def __init__(self, moe: MoE, tp_mesh, switch: Optional[WholeSequenceSwitch] = None):
        nn.Module.__init__(self)
        adopt(self, moe)
        self.tp_group = tp_mesh.get_group()
        self.switch = switch
        if self.shared_experts is not None:
            se = self.shared_experts
            shard_parameter(se.gate_proj, "weight", tp_mesh, [Shard(0)])
            shard_parameter(se.up_proj, "weight", tp_mesh, [Shard(0)])
            shard_parameter(se.down_proj, "weight", tp_mesh, [Shard(1)])

    @property
    def sequence_parallel(self) -> bool:
        return self.switch is not None and self.switch.on

    def forward(self, x_bsh: torch.Tensor, context=None, aux_grad_scale: float = 1.0,
                counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape = x_bsh.shape
        x = x_bsh.reshape(-1, shape[-1])
        # `counted` [B, S]: the whole sequence's rows, for the aux losses; the router's counters
        # take the rows of its tokens (under SP this rank's shard)
        counted_t = router_counted = counted.reshape(-1) if counted is not None else None
        if counted is not None and self.sequence_parallel:
            tp, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
            shards = counted.unflatten(1, (tp, -1))  # [B, tp, S / tp]
            router_counted = shards[:, rank].reshape(-1)
            # in the order of the gathered logits below: rank by rank, each shard's [B, S / tp]
            counted_t = shards.transpose(0, 1).reshape(-1)
        weights, indices, logits = self.router(x, router_counted)  # under SP: this rank's tokens
        aux_scale = aux_grad_scale
        if self.sequence_parallel:
            # the experts are tp-sharded: every tp rank computes its slice for all tp ranks' tokens
            g = self.tp_group
            x_tp, w_tp, idx_tp = (gather_along(x, g, 0), gather_along(weights, g, 0),
                                  gather_along(indices, g, 0))
        else:
            x_tp, w_tp, idx_tp = (
                copy_to_group(x, self.tp_group),
                copy_to_group(weights, self.tp_group),
                indices,
            )
        out = self.route_and_compute(x_tp, w_tp, idx_tp)  # routed + shared (partial sums over tp)
        if self.sequence_parallel:
            out = scatter_reduce_along(out, self.tp_group, 0)
        else:
            out = reduce_from_group(out, self.tp_group)
        aux = None
        if self.training and torch.is_grad_enabled() and self._needs_aux():
            if self.sequence_parallel:
                # the balance / z losses are means over the whole sequence: every tp rank computes
                # them on the gathered logits, and the gather's backward sums the tp copies
                logits = gather_along(logits, self.tp_group, 0)
                indices = idx_tp
                aux_scale = aux_scale / dist.get_world_size(self.tp_group)
            aux, aux_scale = self._window_aux(logits, indices, aux_scale, context, counted_t)
        if aux is not None:
            self.record_aux(aux)
            out = AuxLossGrad.apply(out, aux, aux_scale)
        return out.view(shape)

    def shared_mlp(self, x_th: torch.Tensor) -> torch.Tensor:
        """This rank's partial shared-expert output (its tp shard of the intermediate width)."""
        se = self.shared_experts
        h = F.silu(F.linear(x_th, local(se.gate_proj.weight))) * F.linear(x_th,
                                                                          local(se.up_proj.weight))
        return F.linear(h, local(se.down_proj.weight))


def parallelize_moe(moe: MoE, tp_mesh, ep_mesh, expert_mesh,
                    switch: Optional[WholeSequenceSwitch] = None,
                    ep_dispatch: str = "exact") -> MoE:
    """One MoE layer with its experts sharded over (ep, tp) (`ParallelExperts` replaces
    `moe.experts`) and, under tp, the layer rebuilt as a TensorParallelMoE: returns the layer to use
    (the caller puts it in place of `moe`). `switch`: under sequence parallelism. `ep_dispatch`:
    `parallel.ep_dispatch`."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    replace_child(moe, moe.experts,
                  ParallelExperts(moe.experts, moe.cfg.num_experts, moe.cfg.top_k, ep_mesh,
                                                    expert_mesh, tp, ep_dispatch))
    return TensorParallelMoE(moe, tp_mesh, switch) if tp > 1 else moe
