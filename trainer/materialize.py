"""Build the model without ever holding it whole: meta device -> parallelize -> materialise shards.

`build_sharded_model(cfg, pstate)` constructs the plain TandemModel on the meta device (no memory),
applies the layout (pipeline pruning, TP/EP DTensor shards, FSDP2) while it is still meta, then
allocates only this rank's shards (`to_empty`) and fills them:

* parameters not read from `model.init_from` get seeded_init.py's layout-independent initialisation
  (one process and every layout start from identical weights);
* `model.init_from` tensors are read slice by slice straight into the shards (trainer/hf/init_from);
  whatever the checkpoint lacks (new MTP layers) gets the seeded init.
* buffers (rotary tables, router biases, load counts) are recomputed: `to_empty` leaves garbage.
* with `train.freeze_trunk` the trunk is materialised in `train.frozen_dtype` (the compute dtype).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .seeded_init import allocate, init_seeded


def frozen_trunk_to_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the (still meta, not yet sharded) frozen trunk `dtype`: it never trains, so it needs no
    fp32 master copy. Buffers keep their dtype (router biases compare in fp32)."""
    for name, p in model.named_parameters():
        if not p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)


def build_sharded_model(cfg, pstate, device: Optional[torch.device] = None) -> nn.Module:
    """This rank's part of the model, parallelized and initialised (or loaded from model.init_from)."""
    from tandem.models import TandemModel

    from .parallel import parallelize_model

    device = device or pstate.device.device
    with torch.device("meta"):
        model = TandemModel(cfg.model, cfg.mtp, distill=cfg.train.distill)
    if cfg.train.freeze_trunk:
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("mtp."))
        frozen = frozen_dtype(cfg, pstate.device)
        if frozen is not None:
            frozen_trunk_to_dtype(model, frozen)
    model = parallelize_model(model, cfg, pstate)
    materialize(model, cfg, device)
    return model


def frozen_dtype(cfg, device) -> Optional[torch.dtype]:
    """The dtype a frozen trunk is kept in (train.frozen_dtype; `auto` = the compute dtype)."""
    choice = cfg.train.frozen_dtype
    if choice == "auto":
        return device.autocast_dtype(cfg.train.dtype) or torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]


@torch.no_grad()
def materialize(model: nn.Module, cfg, device) -> None:
    """Allocate this rank's shards of a meta model on `device` and fill them (see module docstring)."""
    allocate(model, device)
    if cfg.model.init_from:
        from .hf.init_from import load_initial_weights

        load_initial_weights(model, cfg.model.init_from, mtp_init_from_last_layer=cfg.mtp.init_from_last_layer,
                             init_rest=lambda loaded: init_seeded(model, cfg.train.seed, skip=loaded))
    else:
        init_seeded(model, cfg.train.seed)
