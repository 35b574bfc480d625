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
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a (possibly DTensor) parameter, differentiably."""
    return t.to_local() if isinstance(t, DTensor) else t


def sharded_parameter(p: nn.Parameter, mesh, placements) -> nn.Parameter:
    """`p` as a DTensor parameter over `mesh` (every rank holds the same full init)."""
    dt = distribute_tensor(p.detach(), mesh, placements, src_data_rank=None)
    return nn.Parameter(dt, requires_grad=p.requires_grad)


def shard_parameter(module: nn.Module, name: str, mesh, placements) -> None:
    """Replace `module.<name>` by a DTensor parameter (every rank holds the same full init)."""
    module.register_parameter(name, sharded_parameter(getattr(module, name), mesh, placements))


_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def adopt(new: nn.Module, layer: nn.Module, keep_hooks: bool = False) -> None:
    """Build a parallel module from a model layer: `new` (a subclass of the layer's class whose
    constructor calls this right after `nn.Module.__init__`) takes the layer's parameters, buffers
    and submodules under the same names, so state-dict keys, checkpoints and initialisation rules
    are those of the single-process model, and its settings (plain attributes: config, sizes,
    flags). The parallel constructor then replaces what it shards and adds its own arguments
    (groups, meshes, switches). The layer must not carry hooks yet (parallel modules are built
    before FSDP, compile and checkpointing), unless `keep_hooks`: `new` then runs the layer's hooks
    (tensor-parallel styles' input and output functions). Never a module FSDP manages (its state is
    keyed by the module)."""

    if isinstance(layer, FSDPModule):
        raise RuntimeError(f"{type(layer).__name__} is an FSDP module: it cannot be rebuilt")
    hooks = [k for k in vars(layer) if k.endswith("hooks") and getattr(layer, k)]
    if hooks and not keep_hooks:
        raise RuntimeError(f"{type(layer).__name__} already has {', '.join(hooks)}: build parallel "
                           "modules first")
    object.__setattr__(new, "training", layer.training)
    for name, p in layer._parameters.items():
        new.register_parameter(name, p)
    for name, b in layer._buffers.items():
        new.register_buffer(name, b, persistent=name not in layer._non_persistent_buffers_set)
    for name, m in layer._modules.items():
        new.add_module(name, m)
    for name, value in vars(layer).items():
        if name not in _MODULE_INTERNALS or (
            keep_hooks and name.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called"))
        ):
            object.__setattr__(new, name, value)


def replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    """Put `new` wherever a module under `root` (or `root` itself) holds `old` as a direct
    submodule."""
    parents = [m for m in root.modules() if any(c is old for c in m._modules.values())]
    if not parents:
        raise ValueError(f"{type(old).__name__} is not under {type(root).__name__}")
    for parent in parents:
        replace_child(parent, old, new)
    return new


def replace_child(parent: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    """Put `new` wherever `parent` holds `old` as a direct submodule (same names); returns `new`."""
    names = [n for n, m in parent._modules.items() if m is old]
    if not names:
        raise ValueError(f"{type(old).__name__} is not a submodule of {type(parent).__name__}")
    for n in names:
        setattr(parent, n, new)
    return new


def shard_index(global_shape: Sequence[int], mesh=None, placements=None) -> Tuple[slice, ...]:
    """The global index of this rank's local shard of a tensor of `global_shape` (everything when
    `mesh` is None). Works with any object shaped like a DeviceMesh (tests use a fake one)."""
    if mesh is None:
        return tuple(slice(0, s) for s in global_shape)

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
    """A parameter's name without the wrappers' prefixes (compile, activation checkpointing, FSDP1,
    DDP)."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.",
                    "module."):
        name = name.replace(wrapper, "")
    return name
