"""The typed view of this rank's place in the layout (layout.py builds it; the loop reads it).

The loop asks a `ParallelState` for ranks, the data-parallel reduction, whether this rank holds the
loss, and for the optional pieces a layout adds (a pipeline schedule, a gradient finisher, the
sequence-parallel switch). How the mesh is carved into pp/dp/ep/tp lives in this package alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .device import Device


class WholeSequenceSwitch:
    """`ParallelState.whole_sequence_switch`: turns sequence splitting (sequence and context
    parallelism) off around decoding and evaluation.

    Under context parallelism, training forwards compute this rank's chunks of each window; with the
    switch off the model computes whole windows (the evaluator's teacher-forced losses), and the cp
    ranks decode as extra batch replicas (trainer/parallel/context.py `ContextShards.sharded`).
    Under sequence parallelism, training runs the TP regions on sequence shards (all-gather in,
    reduce-scatter out). A decode step has 1..K+1 tokens per row, which cannot be split over tp, so
    `whole_sequences()` makes the same modules take and return whole, replicated activations: the
    embedding and row-parallel outputs all-reduce instead of reduce-scattering, TP-region inputs are
    already whole, MoE layers route all tokens on every rank, and the head needs no gather. Same
    weights, same math. The parallel modules (TP mixers, MoE layers and PLE layers, the
    vocab-parallel head, the switchable styles, the context shards) take the switch as a constructor
    argument and read `on`."""

    def __init__(self):
        self.on = True

    @contextlib.contextmanager
    def whole_sequences(self):
        if not self.on:
            yield
            return
        self.on = False
        try:
            yield
        finally:
            self.on = True


@dataclass(frozen=True)
class ParallelDegrees:
    """How many ranks each mesh dimension has (1: the dimension is off)."""

    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas beside expert parallelism (the batch is split over dp x ep)."""
    cp: int = 1
    """Context-parallel ranks: each sequence is split over them; they read the same samples."""
    ep: int = 1
    """Expert-parallel ranks (carved out of data parallelism)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    sequence_parallel: bool = False
    """Activations between the TP regions are sequence shards over tp (only with tp > 1)."""

    @property
    def batch(self) -> int:
        """Ranks that see different samples: dp x ep."""
        return self.dp * self.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same non-expert parameters in a pipeline stage and tensor shard, whose
        gradients are summed: dp x cp x ep (FSDP shards over them)."""
        return self.dp * self.cp * self.ep


@dataclass
class ParallelState:
    """This rank's degrees, meshes, groups and the layout's optional pieces."""

    device: Device
    """This process's device and backend."""
    degrees: ParallelDegrees = field(default_factory=ParallelDegrees)
    """The layout's degrees."""
    world_size: int = 1
    """Processes in the job."""
    rank: int = 0
    """Global rank."""
    dp_size: int = 1
    """Ranks the batch is split over (dp x ep): each reads its own share of every global batch."""
    dp_rank: int = 0
    """This rank's index in the batch split."""
    dp_group: Optional[dist.ProcessGroup] = None
    """The batch split's group: sums the token counts (every cp rank counts its whole samples)."""
    mesh: Optional[object] = None
    """The DeviceMesh over (pp, dp, cp, ep, tp) when distributed."""
    batch_mesh: Optional[object] = None
    """The flattened dp x cp x ep mesh (FSDP's shard dimension; `degrees.replicas` ranks): the ranks
    summing non-expert gradients and the per-depth loss sums. Without cp the batch split's mesh."""
    expert_data_mesh: Optional[object] = None
    """The flattened dp x cp mesh: the ranks holding the same routed experts (their gradients'
    sum)."""
    stage_mesh: Optional[object] = None
    """One pipeline stage's dp x cp x ep x tp ranks (the PLE tables' row split), when there are
    several."""
    router_load_group: Optional[dist.ProcessGroup] = None
    """Sums the routers' expert loads: the ranks routing different tokens (dp x cp x ep), and under
    sequence parallelism also tp."""
    context_group: Optional[dist.ProcessGroup] = None
    """The cp ranks sharing each sample (parallel.cp > 1)."""
    mtp_copies_group: Optional[dist.ProcessGroup] = None
    """The pp ranks holding copies of the MTP module (their routers' loads are summed)."""
    pipeline: Optional[object] = None
    """This rank's pipeline stages and schedule (pipeline.Pipeline), when pp > 1."""
    gradient_finisher: Optional[object] = None
    """Completes a step's gradients and clips by the global norm (gradients.GradientFinisher)."""
    whole_sequence_switch: Optional[WholeSequenceSwitch] = None
    """Turns sequence splitting off around decoding and evaluation, under SP or CP."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def pp_enabled(self) -> bool:
        return self.degrees.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.degrees.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.degrees.ep > 1

    @property
    def sequence_parallel(self) -> bool:
        return self.degrees.sequence_parallel and self.degrees.tp > 1

    def all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel replicas, in place; identity in a single process."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def max_over_ranks(self, value: float) -> float:
        """The largest of every rank's `value` (a collective: every rank calls it); `value` in a
        single process. A CPU tensor, which the default group carries on every backend."""
        if self.world_size == 1:
            return value
        top = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return float(top)

    def all_reduce_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over dp x cp x ep (what each rank computed on its own rows), in place."""
        if self.degrees.replicas > 1:
            dist.all_reduce(tensor, group=self.batch_mesh.get_group())
        return tensor
