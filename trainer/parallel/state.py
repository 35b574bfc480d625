"""The view of the layout the training loop needs (setup.py builds it).

The loop only asks a `ParallelState` for ranks, the data-parallel reduction and whether this rank
holds the loss; how the mesh is carved into tp/pp/ep/dp lives in this package alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

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
