"""DTensor parameters: making one (`shard_parameter`), computing with its local shard (`local`), and
which global slice a rank holds (`shard_index`, `local_target`) under which unwrapped name.

Shared by the tensor-parallel plans (tensor.py, tensor_hybrid.py), FSDP's gradient finishing
(data.py), the seeded initialisation and the checkpoint readers, which all meet parameters that may
or may not be DTensors.
"""

from __future__ import annotations

from typing import Sequence, Tuple

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


def shard_index(global_shape: Sequence[int], mesh=None, placements=None) -> Tuple[slice, ...]:
    """The global index of this rank's local shard of a tensor of `global_shape` (everything when
    `mesh` is None). Works with any object shaped like a DeviceMesh (tests use a fake one)."""
    if mesh is None:
        return tuple(slice(0, s) for s in global_shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tuple(global_shape), mesh, placements)
    if not offset:  # this rank is not part of the mesh
        return tuple(slice(0, 0) for _ in global_shape)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def local_target(t: torch.Tensor) -> Tuple[torch.Tensor, Tuple[slice, ...]]:
    """(the tensor this rank writes into, its global index) for a plain tensor or a DTensor."""
    if isinstance(t, DTensor):
        return t.to_local(), shard_index(t.shape, t.device_mesh, t.placements)
    return t, shard_index(t.shape)


def unwrapped_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (compile, activation checkpointing, FSDP1, DDP)."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name
