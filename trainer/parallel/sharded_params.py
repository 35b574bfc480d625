"""DTensor parameters: making one (`shard_parameter`), computing with its local shard (`local`), and
which global slice a rank holds (`shard_index`, `local_target`) under which unwrapped name.

Shared by the tensor-parallel plans (tensor.py, tensor_hybrid.py), FSDP's gradient finishing
(data.py), the seeded initialisation below and the checkpoint readers, which all meet parameters
that may or may not be DTensors.

**Seeded initialisation** (the second half): parameters not read from a checkpoint get a seeded
initialisation that does not depend on the layout: each parameter is cut into blocks of rows along
dim 0 (`INIT_BLOCK_ELEMS` elements, a function of the global shape only), block b of parameter
`name` is drawn from its own generator seeded by (train.seed, name, b), and a rank draws only the
blocks that cover its shard (DTensor local shape and global offset; FSDP over TP's _StridedShard
included), keeping its slice. One process, every layout and every pipeline copy of a parameter (the
last stage's embedding) thus start from identical weights. *What* each parameter's distribution is
stays in `TandemModel.init_rule` (plain PyTorch).

`allocate` gives a meta model storage (ties kept, buffers recomputed) before anything fills it. Used
by trainer/materialize.py (the trainer's sharded build), trainer/hf/importer.py (a model built from
a Hugging Face directory) and trainer/checkpoint.py (a model rebuilt from a Tandem checkpoint).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence, Tuple

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


# --------------------------------------------------------------------------------------------------
# Seeded, layout-independent initialisation and storage of a meta-device model's shards


INIT_BLOCK_ELEMS = 1 << 20
"""Elements per generated block (rows along dim 0; at least one row). A rank holds at most one
block beyond its shards at any time."""


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_slice(name: str, global_shape: Sequence[int], index: Tuple[slice, ...],
                 rule: Tuple[str, float], seed: int) -> torch.Tensor:
    """fp32 CPU values of `name`'s global slice `index` under `rule` (see TandemModel.init_rule)."""
    kind, std = rule
    local_shape = [len(range(*s.indices(g))) for s, g in zip(index, global_shape)]
    if kind == "ones":
        return torch.ones(local_shape)
    if kind == "zeros":
        return torch.zeros(local_shape)
    out = torch.empty(local_shape)
    if out.numel() == 0:
        return out
    shape = list(global_shape) if global_shape else [1]
    row = 1
    for d in shape[1:]:
        row *= d
    per_block = max(1, INIT_BLOCK_ELEMS // max(row, 1))
    r0, r1 = index[0].indices(shape[0])[:2] if index else (0, 1)
    for b in range(r0 // per_block, (r1 + per_block - 1) // per_block):
        b0, b1 = b * per_block, min(shape[0], (b + 1) * per_block)
        g = torch.Generator().manual_seed(_block_seed(seed, name, b))
        draw = torch.rand if kind == "a_log" else torch.randn
        block = draw([b1 - b0] + shape[1:], generator=g)
        lo, hi = max(b0, r0), min(b1, r1)
        out[lo - r0: hi - r0] = block[(slice(lo - b0, hi - b0),) + tuple(index[1:])]
        del block
    if kind == "a_log":  # Gated DeltaNet's decay rates: log(uniform(0.01, 16))
        return out.mul_(15.99).add_(0.01).log_()
    return out.mul_(std)


def _init_name(name: str, model: nn.Module) -> str:
    # A tied head that TP turned into its own (vocab-parallel) parameter starts as the embedding.
    if name == "lm_head.weight" and getattr(model.cfg, "tie_embeddings", False):
        return "embed_tokens.weight"
    return name


@torch.no_grad()
def init_seeded(model: nn.Module, seed: int, skip: Iterable[str] = ()) -> None:
    """Seeded, layout-independent initialisation of every parameter this rank holds except
    `skip`."""
    skip = set(skip)
    for raw, p in model.named_parameters():
        name = unwrapped_name(raw)
        if name in skip:
            continue
        local, index = local_target(p)
        values = seeded_slice(_init_name(name, model), p.shape, index, model.init_rule(name), seed)
        local.copy_(values.to(local.dtype))


def _shared_parameters(model: nn.Module):
    """(module, attribute, (first owner, its attribute)) for every parameter shared by two modules
    (tied embeddings)."""
    first, ties = {}, []
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                ties.append((module, attr, first[id(p)]))
            else:
                first[id(p)] = (module, attr)
    return ties


@torch.no_grad()
def allocate(model: nn.Module, device) -> None:
    """Storage on `device` for a meta model's (shards of) parameters, ties kept, buffers recomputed;
    parameter values are left for the caller to fill."""
    ties = _shared_parameters(model)
    model.to_empty(device=device)
    for module, attr, (src, src_attr) in ties:  # to_empty gives each module its own tensor: re-tie
        setattr(module, attr, getattr(src, src_attr))
    model.reset_buffers()
