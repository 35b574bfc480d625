"""Process-group setup and the view of the layout the training loop needs.

The loop only asks a `ParallelState` for ranks, the data-parallel reduction and whether this rank
holds the loss; how the mesh is carved into tp/pp/ep/dp lives in this package alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import TandemConfig
from .device import Device


@dataclass
class ParallelState:
    device: Device
    """This process's device and backend."""
    world_size: int = 1
    """Processes in the job."""
    rank: int = 0
    """Global rank."""
    dp_size: int = 1
    """Data-parallel ranks (replicas of the batch dimension)."""
    dp_rank: int = 0
    """This rank's data-parallel index (selects its share of each global batch)."""
    dp_group: Optional[object] = None
    """Process group that sums per-depth losses and token counts across data-parallel replicas."""
    mesh: Optional[object] = None
    """The DeviceMesh over (pp, dp, ep, tp) when distributed."""
    extras: dict = field(default_factory=dict)
    """Layout-specific handles (pipeline schedule, expert groups) owned by trainer/parallel/."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel replicas, in place; identity in a single process."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor


def init_parallel(cfg: TandemConfig, device: Device) -> ParallelState:
    """Start the process group (under torchrun) and validate the layout against the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from .validate import validate_layout  # pure config arithmetic, before any process-group work

    dp = validate_layout(cfg, world)
    if world == 1:
        return ParallelState(device=device)
    from .layout import build_parallel_state  # the mesh and groups (needs torch.distributed)

    return build_parallel_state(cfg, device, world, dp)


def parallelize_model(model: nn.Module, cfg: TandemConfig, state: ParallelState) -> nn.Module:
    """Apply activation checkpointing and regional compilation, then TP/EP/PP/FSDP, to a plain model
    for this rank (in a single process only the first two; compile.py explains the order)."""
    from .activation_checkpoint import apply_activation_checkpointing
    from .compile import apply_compile

    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    apply_compile(model, cfg.train.compile)
    if state.world_size == 1:
        return model
    from .layout import apply_parallelism

    return apply_parallelism(model, cfg, state)
