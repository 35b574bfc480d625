"""Seeded, layout-independent initialisation and storage of a meta-device model's shards.

Parameters not read from a checkpoint get a seeded initialisation that does not depend on
the layout: each parameter is cut into blocks of rows along dim 0 (`INIT_BLOCK_ELEMS` elements,
a function of the global shape only), block b of parameter `name` is drawn from its own generator
seeded by (train.seed, name, b), and a rank draws only the blocks that cover its shard (DTensor
local shape and global offset; FSDP over TP's _StridedShard included), keeping its slice. One
process, every layout and every pipeline copy of a parameter (the last stage's embedding) thus
start from identical weights. *What* each parameter's distribution is stays in
`TandemModel.init_rule` (plain PyTorch).

`allocate` gives a meta model storage (ties kept, buffers recomputed) before anything fills it. Used
by materialize.py (the trainer's sharded build), hf/importer.py (a model built from a Hugging Face
directory) and checkpoint.py (a model rebuilt from a Tandem checkpoint).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence, Tuple

import torch
from torch import nn

from .parallel.sharded_params import local_target, unwrapped_name

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
