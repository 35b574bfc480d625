"""DTensor parameters: making one (`shard_parameter`) and computing with its local shard (`local`).

Shared by the tensor-parallel plans (tensor.py, tensor_hybrid.py) and FSDP's gradient finishing
(data.py), which all meet parameters that may or may not be DTensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a (possibly DTensor) parameter, differentiably."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_parameter(module: nn.Module, name: str, mesh, placements) -> None:
    """Replace `module.<name>` by a DTensor parameter (every rank holds the same full init)."""
    p = getattr(module, name)
    dt = distribute_tensor(p.detach(), mesh, placements, src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
