"""Completing a step's gradients: the sums over the ranks that hold copies of a parameter
(data-parallel replicas kept whole, pipeline ranks sharing a piece, tp ranks under sequence
parallelism), bucketed and overlapped with the rest of backward, then the true global norm and
clipping (GradientFinisher)."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from .data import PieceUnits, expert_parameters, is_split_placement
from .sharded_params import local


def _match_placements(p: nn.Parameter) -> None:
    """A gradient can come back with other placements than its parameter (the backward of the
    vocab-parallel embedding leaves it Replicate): re-shard it locally before summing it."""
    if isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


GRAD_BUCKET_BYTES = 25 * 2**20
"""Largest flat buffer one gradient-sum all-reduce sends (DDP's default bucket): one collective per
bucket instead of one per parameter, without a flat copy the size of a whole piece (the flagship's
embedding and heads are GiBs)."""


@torch.no_grad()
def launch_gradient_sums(entries, reduce_dtype: Optional[torch.dtype] = None,
                         bucket_bytes: int = GRAD_BUCKET_BYTES) -> list:
    """Start summing the gradients of `entries` ((parameter, process group) pairs) over their
    groups: per group and dtype, in the entries' order, flat buckets of at most `bucket_bytes` (one
    parameter larger than that is a bucket of its own), each one asynchronous all-reduce in
    `reduce_dtype` (None: the gradient's dtype). Parameters backward never reached count as zeros.
    `finish_gradient_sums` waits and writes the sums back; every rank of a group must pass its
    entries in the same order."""
    groups: Dict[tuple, list] = {}
    for p, group in entries:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        _match_placements(p)
        groups.setdefault((id(group), p.dtype), [group, []])[1].append(local(p.grad))
    pending = []
    for group, grads in groups.values():
        bucket, size = [], 0
        for g in grads:
            nbytes = g.numel() * (reduce_dtype or g.dtype).itemsize
            if bucket and size + nbytes > bucket_bytes:
                pending.append(_start_bucket(bucket, group, reduce_dtype))
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            pending.append(_start_bucket(bucket, group, reduce_dtype))
    return pending


def _start_bucket(grads: List[torch.Tensor], group, reduce_dtype: Optional[torch.dtype]):
    flat = _flatten_dense_tensors(grads)
    flat = flat.to(reduce_dtype) if reduce_dtype is not None else flat
    return dist.all_reduce(flat, group=group, async_op=True), flat, grads


@torch.no_grad()
def finish_gradient_sums(pending: list) -> None:
    for work, flat, grads in pending:
        work.wait()
        for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)
    pending.clear()


def sum_gradients(entries, reduce_dtype: torch.dtype) -> None:
    """Sum the gradients of `entries` ((parameter, process group) pairs) over their groups now
    (`launch_gradient_sums`' buckets, waited for)."""
    finish_gradient_sums(launch_gradient_sums(entries, reduce_dtype))


class GradientFinisher:
    """`ParallelState.gradient_finisher`: completes this step's gradients (`sync`), then clips by
    the global norm (`clip`; TrainStep.clip_gradients drops the frozen ones in between).

    1. Data parallelism is FSDP2's (`dp_mode=fsdp`: reduce-scatter) or its replicate (`allreduce`:
       per-module all-reduces overlapped with backward), both issued by torch during every
       micro-batch's backward or the last one's (`apply_fsdp`, parallel.reshard_after_microbatch);
       nothing to do here.
    2. Pipeline: sums the gradients of the copies of the embedding, final norm, head and MTP module
       held by several pp ranks (`shared`: piece -> (group of the holding ranks, copies)), in flat
       buckets (`launch_gradient_sums`), started by the pipeline as soon as this rank's stages using
       a piece finished their step's backward (`start`) and waited for here, on the FSDP shards.
       Pieces two stages of one rank share are FSDP units of their own (`piece_units`): `start`
       first reduce-scatters their step's gradient (`PieceUnits.reduce`), then sums the shards over
       the pp copies. Under the all-reduce mode they are kept out of replicate (`replicated_names`)
       and summed over the data-parallel ranks the same way, before the pp copies are.
       Sequence parallelism: sums over tp the gradients of replicated parameters that computed on
       one sequence shard (norms, routers, the MTP input projection), as Megatron does.
    3. The true global norm: each rank's local squared norms weighted by 1/(copies of that shard
       in the job), summed over the world (DTensor shards, tp/ep/fsdp replication, pp copies).
    """

    def __init__(self, model: nn.Module, world: int, pp: int, batch_group, batch_size: int,
                 dp_group, dp_size: int, shared: Optional[Dict[str, tuple]] = None,
                 replicated_names=(),
                 sp_partial_names=(), tp_group=None, device: Optional[torch.device] = None,
                 reduce_dtype: torch.dtype = torch.float32,
                 piece_units: Optional[PieceUnits] = None):
        self.model, self.world, self.pp = model, world, pp
        # collectives need device tensors even on a rank with no gradients (a frozen pp stage)
        self.device = device if device is not None else next(model.parameters()).device
        # dtype of the whole pieces' gradient sums (train.grad_reduce_dtype)
        self.reduce_dtype = reduce_dtype
        # sequence parallelism: replicated parameters that saw one sequence shard (names survive
        # FSDP)
        self.sp_partial, self.tp_group = set(sp_partial_names), tp_group
        self.batch_group, self.batch_size = batch_group, batch_size
        self.dp_group, self.dp_size = dp_group, dp_size
        self.shared, self.replicated = dict(shared or {}), set(replicated_names)
        self.piece_units = piece_units
        # this step's started sums: parameter names, and the buckets in flight
        self._started, self._pending = set(), []

    def _params(self):
        for _, p, is_expert, piece in self._named_params():
            yield p, is_expert, piece

    def _named_params(self):
        """(name, parameter, is a routed expert, shared piece or None) of every trained
        parameter."""
        experts = {id(p) for p in expert_parameters(self.model)}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                piece = name.split(".", 1)[0]
                yield name, p, id(p) in experts, piece if piece in self.shared else None

    @torch.no_grad()
    def start(self, pieces: Iterable[str]) -> None:
        """Complete what this rank can of `pieces`' gradients and start their pipeline-group sums
        (asynchronous buckets, waited for in `sync`): the pipeline calls it once every stage of this
        rank using them finished its step's backward (FSDP's reduction included), so the sums
        overlap the backward left on this rank's other stages. Each group's pieces arrive in one
        call, in the same order of groups on every rank (`Pipeline`)."""
        pieces = set(pieces)
        # the step's dp x ep reduce-scatter first: it swaps the sharded
        if self.piece_units is not None:
            self.piece_units.reduce(pieces)  # parameters (and their gradients) back into the model
        self._start([entry for entry in self._named_params()
                     if entry[0].split(".", 1)[0] in pieces and entry[0] not in self._started])

    def unfinished(self) -> bool:
        """Whether sums were started that `sync` has not finished (a step's backward without its
        finishing: another backward would add to gradients already summed)."""
        return bool(self._started)

    def _start(self, params) -> None:
        self._started.update(n for n, _, _, _ in params)
        for _, p, _, _ in params:
            _match_placements(p)
        if self.tp_group is not None:
            for name, p, _, _ in params:
                if name in self.sp_partial:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(local(p.grad), group=self.tp_group)
        whole = [(p, self.dp_group if is_expert else self.batch_group) for name, p, is_expert,
                 _ in params
                 if name in self.replicated
                 and (self.dp_size if is_expert else self.batch_size) > 1]
        copies = [(p, self.shared[piece][0]) for _, p, _, piece in params if piece is not None]
        if whole and copies:  # the pp sum reads the dp sum
            sum_gradients(whole, self.reduce_dtype)
        elif whole:
            self._pending += launch_gradient_sums(whole, self.reduce_dtype)
        # copies on several pp ranks, in the gradients' dtype; every holder walks its parameters in
        # the model's order, so the buckets of a holder group are issued in the same order
        # everywhere
        self._pending += launch_gradient_sums(copies)

    @torch.no_grad()
    def sync(self) -> None:
        """Everything `start` has not started yet, then wait for every sum of the step."""
        if self.piece_units is not None:  # those the pipeline has not reduced (and resharded) yet
            self.piece_units.reduce(list(self.piece_units.units))
        self._start([entry for entry in self._named_params() if entry[0] not in self._started])
        finish_gradient_sums(self._pending)
        self._started = set()

    @torch.no_grad()
    def global_norm(self) -> torch.Tensor:
        holders = self.world // self.pp
        total = None
        for p, _, piece in self._params():
            if p.grad is None:
                continue
            g = p.grad
            shards = 1
            if isinstance(g, DTensor):
                shards = math.prod(g.device_mesh.size(i) for i,
                                   pl in enumerate(g.placements) if is_split_placement(pl))
            copies = holders * (self.shared[piece][1] if piece is not None else 1) / shards
            # fp32 (no fp64 on accelerators: the norm only sets the clipping coefficient), reduced
            # in place: a squared copy would be another gradient-sized tensor (a whole embedding)
            sq = torch.linalg.vector_norm(local(g), dtype=torch.float32).square() / copies
            total = sq if total is None else total + sq
        if total is None:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.all_reduce(total)
        return total.sqrt()

    @torch.no_grad()
    def clip(self, max_norm: float) -> torch.Tensor:
        """The global norm of the gradients left after `sync` (None counts as none), and clipping
        to `max_norm` when positive."""
        norm = self.global_norm()
        if max_norm > 0:
            coef = min(max_norm / (float(norm) + 1e-6), 1.0)
            if coef < 1.0:
                for p, _, _ in self._params():
                    if p.grad is not None:
                        local(p.grad).mul_(coef)
        return norm.float()
