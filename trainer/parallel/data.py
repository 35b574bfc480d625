"""Data parallelism (FSDP2's fully_shard, or its replicate for gradient all-reduce) and the step's
gradient finishing.

Megatron semantics: the batch is split over dp*ep ranks; non-expert parameters are replicated over
(and their gradients summed across) those dp*ep ranks, routed experts only over the dp ranks that
hold the same expert shard (the expert-data-parallel group). Gradients are *summed*, never averaged:
the loop already normalises every loss by the global target count.

Precision: master weights, gradients and optimizer state are fp32. Under bf16 training FSDP2's
`MixedPrecisionPolicy` all-gathers bf16 parameters (the stages then compute and exchange bf16;
routers compute in fp32 from the gathered bf16 weight, as Megatron's fp32 routing does from its bf16
parameters) and reduce-scatters gradients in `train.grad_reduce_dtype` (fp32 by default); the
all-reduce mode (`replicate`, the same machinery with replicated parameters) casts and all-reduces
the same way. Both sync in every micro-batch's backward, or once per step in the last one's
(`parallel.reshard_after_microbatch`); the sum over micro-batches is fp32 either way. Pieces two
pipeline stages of one rank share are FSDP units of their own (`PieceUnits`: gathered through the
step, reduce-scattered once, after the rank's last stage using them); under the all-reduce mode they
are kept out of replicate and compute the same way from bf16 copies made at each call of their
module (`cast_kept_whole`); the routed experts FSDP leaves out when dp = 1 already cast their
weights to the compute dtype (`expert_swiglu`). Every collective here takes device tensors, never
fp64 (NCCL/HCCL reject host tensors; Ascend has no fp64 units).

Parameters the recurrence and the stream mixing depend on (`fp32_parameters`: Gated DeltaNet's A_log
and dt_bias, the hyper-connections' stream norms, the MoE routers' weights) compute from their fp32
values on every layout, as one process computes them and as Megatron keeps A_log: a bf16 gather
moved exp(A_log), and with it every decay rate g = -exp(A_log) * softplus(a + dt_bias), by up to
2^-9 relative per rounding. FSDP keeps them whole (ignored: replicated on every batch rank in fp32,
their gradients summed over dp x ep by the GradientFinisher, as the whole pieces of the all-reduce
mode are), and `cast_kept_whole` never casts them. They are small (per-head vectors, one norm weight
per stream mixer, one E x H router per MoE layer), so a replica costs little next to the bf16
gathers it replaces. The hyper-connections' gate projections are plain Linears: autocast rounds
their fp32 weight to bf16 for its matmul on one process exactly as FSDP's gather rounds it, so they
stay in the blocks.

Residual streams: fp32 on every layout wherever the model carries hyper-connection streams. One
process's autocast leaves the embedding and the residual adds in fp32; under FSDP's policy the units
no longer cast their forward inputs (`cast_forward_inputs=False`), the hyper-connections mix and
inject in fp32 (models/hyper_connection.py), and pipeline stages exchange the streams in fp32
(layout.py). What a block hands its sublayers stays in the compute dtype (the hyper-connection's
mixed input under autocast), so sequence-parallel gathers and expert dispatch move bf16 as before.
A plain residual (hc_count = 1) is unchanged: fp32 on one process and under pipelining alone, bf16
under FSDP's policy (the gathered bf16 embedding and norms set it).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from tandem.models.block import OutputHead
from tandem.models.experts import GroupedExperts
from tandem.models.gated_deltanet import GatedDeltaNet
from tandem.models.hyper_connection import HyperConnection
from tandem.models.moe import Router

from .sharded_params import adopt, replace_module
from .tensor import VocabParallelHead


def is_split_placement(placement) -> bool:
    """Shard or _StridedShard (FSDP over a TP-sharded dim): both split the tensor."""
    return placement.is_shard() or hasattr(placement, "split_factor")


def expert_parameters(module: nn.Module) -> List[nn.Parameter]:
    return [p for m in module.modules() if isinstance(m, GroupedExperts)
            for p in m.parameters(recurse=False)]


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fsdp_mixed_precision(compute_dtype: Optional[torch.dtype], grad_reduce_dtype: str,
                         reshard_after_microbatch: bool = True):
    """(FSDP2's policy, gradient wire dtype) for a run computing in `compute_dtype` (None: fp32, no
    policy at all, so fp32 runs are unchanged): parameters gathered in the compute dtype, gradients
    reduced in `grad_reduce_dtype` and kept fp32 in the sharded (master) parameters.

    FSDP2 accumulates a step's unsharded gradients (`reshard_after_microbatch=False`) in the
    policy's reduce dtype, and in the parameter dtype when the two match: a bf16 reduction would
    round the running sum to bf16 at every micro-batch. There the policy reduces in fp32 (fp32
    accumulation) and the wire dtype is bf16: `apply_fsdp` casts just around the one reduce-scatter
    (`CastingReduceScatter`). The wire dtype is None where the policy's own is used."""
    if compute_dtype is None:
        return None, None

    reduce = REDUCE_DTYPES[grad_reduce_dtype]
    # No cast of a unit's forward inputs: the hyper-connection streams a block receives stay fp32,
    # as on one process (a plain residual arrives in bf16 from the bf16 embedding and adds anyway).
    if not reshard_after_microbatch and reduce == compute_dtype:
        return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False), reduce
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce,
                                cast_forward_inputs=False), None


def fp32_parameters(model: nn.Module) -> Dict[str, nn.Parameter]:
    """name -> parameter for those the recurrence and the stream mixing read as fp32 values (see the
    module docstring): Gated DeltaNet's A_log and dt_bias, each hyper-connection's stream norm, each
    MoE router's weight. Under a bf16 policy they are kept whole in fp32 (`apply_parallelism`)."""

    wanted = set()
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            wanted.update(id(p) for p in (m.A_log, m.dt_bias))
        elif isinstance(m, HyperConnection):
            wanted.update(id(p) for p in m.hc_norm.parameters())
        elif isinstance(m, Router):
            wanted.add(id(m.weight))
    return {name: p for name, p in model.named_parameters() if id(p) in wanted}


def _casting_reduce_scatter(wire_dtype: torch.dtype):
    """FSDP2's reduce-scatter with its fp32 input sent as `wire_dtype` (the output cast back to
    fp32)."""

    class CastingReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            out = torch.empty_like(output_tensor, dtype=wire_dtype)
            dist.reduce_scatter_single(out, input_tensor.to(wire_dtype), group=group, op=op)
            output_tensor.copy_(out)
            return None

    return CastingReduceScatter()


def apply_fsdp(blocks: Iterable[nn.Module], roots: Iterable[nn.Module],
               all_modules: Iterable[nn.Module],
               batch_mesh, dp_mesh, mp_policy=None, keep_whole=frozenset(),
               replicated: bool = False,
               wire_dtype: Optional[torch.dtype] = None, units: Iterable[nn.Module] = (),
               unit_precision: tuple = (None, None)) -> None:
    """fully_shard: routed experts over dp (when dp > 1), each block and the root(s) over dp*ep,
    under `mp_policy` and `wire_dtype` (see `fsdp_mixed_precision`; None: fp32; torch's replicate
    all-reduces in the policy's reduce dtype: no wire cast there). `keep_whole`: parameters FSDP
    leaves alone (pieces two pipeline stages of this rank share under `replicated`; the PLE n-gram
    tables, row-sharded over the stage's dp x ep x tp ranks by tensor_hybrid.shard_ple_tables: never
    gathered, and their gradients are already complete, so neither reduced here nor by the
    GradientFinisher; its global norm counts each of their shards once, as for any DTensor sharded
    over all of a stage's ranks). `units`: pieces two pipeline stages of this rank share (not
    registered in either stage's root), each an FSDP root of its own over dp*ep (its routed experts
    over dp) that `PieceUnits` drives; they accumulate a whole step before their one reduce-scatter,
    so they take `unit_precision`, `fsdp_mixed_precision(..., reshard_after_microbatch=False)`'s
    (policy, wire dtype)."""

    units = list(units)
    if units and replicated:
        raise ValueError("apply_fsdp: pieces of their own (units) are FSDP units; the all-reduce "
                         "mode keeps them whole")
    in_unit = {id(m) for unit in units for m in unit.modules()}
    unit_mp, unit_wire = unit_precision
    if unit_mp is not None:
        # a unit's forward takes what its stage hands it, as a piece inside a stage root does (that
        # root casts only the stage's inputs): the vocab-parallel head's fp32 gradient scales stay
        # fp32
        unit_mp = dataclasses.replace(unit_mp, cast_forward_inputs=False)

    def policy(m: nn.Module) -> dict:
        chosen = unit_mp if id(m) in in_unit else mp_policy
        return {"mp_policy": chosen or MixedPrecisionPolicy()}

    wrap = replicate if replicated else fully_shard
    root_kw = {} if replicated else {"reshard_after_forward": False}
    all_modules = list(all_modules)
    keep_whole = set(keep_whole)
    if dp_mesh.size() > 1:
        for top in all_modules:
            for m in top.modules():
                if isinstance(m, GroupedExperts) and not isinstance(m, FSDPModule) \
                        and not any(p in keep_whole for p in m.parameters()):
                    wrap(m, mesh=dp_mesh, **policy(m))
        ignored = set(keep_whole)
    else:  # experts replicated nowhere: keep them out of the dp*ep sharding
        ignored = {p for top in all_modules for p in expert_parameters(top)} | keep_whole
    ignored = ignored or None
    for block in blocks:
        wrap(block, mesh=batch_mesh, ignored_params=ignored, **policy(block))
    # gathered from the step's first use to its reduce-scatter: no reshard in between
    for unit in units:
        fully_shard(unit, mesh=batch_mesh, ignored_params=ignored, reshard_after_forward=False,
                    **policy(unit))
    for root in roots:
        wrap(root, mesh=batch_mesh, ignored_params=ignored, **root_kw, **policy(root))
    for top in all_modules:
        for m in top.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum: losses are already globally normalised
                # plain SUM collectives (gloo has no AVG/PREMUL_SUM)
                m.set_force_sum_reduction_for_comms(True)
                wire = unit_wire if id(m) in in_unit else wire_dtype
                if wire is not None and not replicated:
                    m.set_custom_reduce_scatter(_casting_reduce_scatter(wire))


class PieceUnits:
    """Pieces two pipeline stages of one rank share (`PipelinePlan.shared_within_rank`: the
    embedding of the first stage and of an MTP stage, a head or MTP module on two depth stages),
    each an FSDP root of its own (`apply_fsdp(units=...)`), sharded over dp x ep like every other
    dense parameter.

    FSDP2's own hooks cannot run such a unit: its post-backward fires per use (per stage, per
    micro-batch, and never for pieces called through methods such as the head's `loss_sums` or an
    MTP step's layer), and a module under two stage roots cannot be a unit of both. So the pipeline
    drives it as torch's pipeline stage drives a stage root without gradient sync: `begin_step`
    gathers it (sync off, no reshard after backward) before the step's first forward; `accumulate`
    after each backward of a stage using it folds the new gradient into FSDP's fp32 unsharded
    accumulator (the hooks that do fire do the same; the call is idempotent); `reduce` after the
    rank's last stage using it finished the step's backward (the point the pipeline-group sums
    start, `GradientFinisher.start`) reduce-scatters the step's gradient once and reshards. Between
    steps only the shard stays."""

    def __init__(self, units: Dict[str, nn.Module]):
        self.units = dict(units)
        """piece name -> its FSDPModule."""
        self._reduced: set = set()
        self._ready = False

    def _lazy_init(self) -> None:
        """Each unit a root of its own, before any forward: a nested expert unit whose forward ran
        first would otherwise make itself the root (the unit's own forward may never run)."""
        if not self._ready:
            for unit in self.units.values():
                unit._get_fsdp_state()._lazy_init()
            self._ready = True

    def roots(self) -> List[nn.Module]:
        """The units as FSDP roots to unshard for code that calls their modules directly
        (decoding)."""
        self._lazy_init()
        return list(self.units.values())

    def begin_step(self) -> None:
        self._lazy_init()
        for unit in self.units.values():
            unit.set_requires_gradient_sync(False)
            unit.set_reshard_after_backward(False)
            unit.set_is_last_backward(False)
            unit.unshard()
        self._reduced = set()

    @staticmethod
    def _groups(unit: nn.Module):
        for state in unit._get_fsdp_state()._state_ctx.all_states:
            yield from state._fsdp_param_groups

    @torch.no_grad()
    def accumulate(self, pieces: Iterable[str]) -> None:
        for piece in pieces:  # no collective: any order
            if piece in self.units and piece not in self._reduced:
                for group in self._groups(self.units[piece]):
                    # no sync: adds .grad into the fp32 accumulator, keeps it gathered
                    group.post_backward()

    @torch.no_grad()
    def reduce(self, pieces: Iterable[str]) -> None:
        """Reduce-scatter the step's gradients of `pieces` (those not reduced yet) over dp x ep
        (their experts over dp), as torch's PipelineStage.perform_reduce_grad does for a stage root.
        In the units' own order, the same on every rank (not `pieces`': a set's order differs
        between processes, and a dp peer reducing another piece at the same time would sum the wrong
        tensors)."""
        pieces = set(pieces)
        for piece, unit in self.units.items():
            if piece not in pieces or piece in self._reduced:
                continue
            unit.set_is_last_backward(True)
            unit.set_reshard_after_backward(True)
            unit.set_requires_gradient_sync(True)
            for group in self._groups(unit):
                group.post_backward()
            state = unit._get_fsdp_state()
            # torch >= 2.15 asks which finalization mode this backward runs in, which a backward
            # through the unit's own hooks would have set (a stage's may not run them): automatic
            if getattr(state._state_ctx, "manual_backward_finalization_active", False) is None:
                state._state_ctx.manual_backward_finalization_active = False
            state._root_post_backward_final_callback()  # waits for the reductions
            self._reduced.add(piece)


_COMPUTE_COPY_CLASSES: Dict[type, type] = {}


def _compute_copy_class(cls: type) -> type:
    """`cls` whose forward reads its `compute_copy_names` parameters as `compute_copy_dtype` copies;
    its constructor `(module, names, dtype)` builds one from a `cls` module (same parameters,
    buffers, submodules, settings and hooks: `adopt`), which `cast_kept_whole` puts in the module's
    place.

    A subclass rather than forward hooks: torch.compile shares one graph between blocks of one shape
    and does not guard on hooks (its default `skip_nnmodule_hook_guards`), so a trunk block's graph
    would run a kept-whole MTP block's norms without their casts; a different forward makes the MTP
    block trace its own."""
    if cls not in _COMPUTE_COPY_CLASSES:
        def __init__(self, module: nn.Module, names: List[str], dtype: torch.dtype):
            nn.Module.__init__(self)
            adopt(self, module, keep_hooks=True)
            self.compute_copy_names, self.compute_copy_dtype = names, dtype

        def forward(self, *args, **kwargs):
            for n in self.compute_copy_names:
                # An instance attribute shadows the registered parameter for `self.<n>` (nn.Module
                # looks in _parameters only when ordinary lookup fails), while named_parameters(),
                # the optimizer and checkpoints keep the fp32 parameter. The copy is differentiable:
                # its gradient reaches the parameter's .grad in fp32, as FSDP's gathered bf16
                # copies' do.
                self.__dict__[n] = self._parameters[n].to(self.compute_copy_dtype)
            try:
                return cls.forward(self, *args, **kwargs)
            finally:
                for n in self.compute_copy_names:
                    self.__dict__.pop(n, None)

        _COMPUTE_COPY_CLASSES[cls] = type(f"ComputeCopy{cls.__name__}", (cls,),
                                          {"__init__": __init__, "forward": forward})
    return _COMPUTE_COPY_CLASSES[cls]


def _autocast_computes(module: nn.Module) -> bool:
    """Modules whose parameters only enter matmuls that already run in the compute dtype (autocast's
    linears with its cached weight casts, the grouped experts' own cast, the vocabulary heads'
    chunked logits): a copy per call would add casts, and a chunked head would keep one per depth
    until backward."""

    return isinstance(module, (nn.Linear, GroupedExperts, OutputHead, VocabParallelHead))


def cast_kept_whole(model: nn.Module, params: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
    """Make `params` (kept out of FSDP) compute as FSDP's mixed-precision policy makes the rest:
    every other module holding one reads a `dtype` copy of it while it is called. Autocast alone
    would leave their norms and embedding lookups in fp32 (an fp32 weight promotes the product), so
    those pieces would hand fp32 activations to the sequence-parallel gathers, the expert dispatch
    and the next stage: twice the bytes of the FSDP-gathered pieces' bf16. The copy is made again at
    every call of the module (activation checkpointing's recomputation, every MTP depth), so none
    outlives its call or goes stale after an optimizer step. Each such module is replaced (under the
    same names, in every module of `model` holding it) by its compute-copy version built from it
    (`_compute_copy_class`)."""
    wanted = {id(p) for p in params}
    for module in list(model.modules()):
        names = [n for n, p in module._parameters.items() if p is not None and id(p) in wanted]
        if names and not _autocast_computes(module):
            if module is model:
                raise ValueError("cast_kept_whole: the model itself holds a kept-whole parameter")
            replace_module(model, module, _compute_copy_class(type(module))(module, names, dtype))


