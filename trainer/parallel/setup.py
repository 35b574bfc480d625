"""Process-group setup and model parallelisation: the two entry points the trainer calls.

Kept apart from state.py so that the layout modules can import `ParallelState` without importing
the modules that build it.
"""

from __future__ import annotations

import os

from torch import nn

from ..config import TandemConfig
from .activation_checkpoint import apply_activation_checkpointing
from .compile import apply_compile
from .device import Device
from .layout import apply_parallelism, build_parallel_state
from .state import ParallelState
from .validate import validate_layout


def init_parallel(cfg: TandemConfig, device: Device) -> ParallelState:
    """Start the process group (under torchrun) and validate the layout against the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = validate_layout(cfg, world)  # config arithmetic, before any process-group work
    if world == 1:
        return ParallelState(device=device)
    return build_parallel_state(cfg, device, world, dp)


def parallelize_model(model: nn.Module, cfg: TandemConfig, state: ParallelState) -> nn.Module:
    """Apply regional compilation and activation checkpointing, then TP/EP/PP/FSDP, to a plain model
    for this rank (in a single process only the first two; compile.py explains the order)."""

    apply_compile(model, cfg.train.compile)  # first: checkpointing wraps the compiled forward
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if state.world_size == 1:
        return model

    return apply_parallelism(model, cfg, state)
