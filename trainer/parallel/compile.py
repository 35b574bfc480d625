"""Regional `torch.compile` (`train.compile`): each transformer block's forward, compiled in place.

As torchtitan does, the unit of compilation is one transformer block (every trunk layer this rank
holds and every MTP layer's block, the list activation checkpointing uses), not the whole model:
blocks of one shape share one compiled graph (the parameters are graph inputs), so compile time does
not grow with depth, and the loss code around them (chunked head, MTP chain, pipeline stages) stays
eager. The grouped expert matmul is a custom op (models/moe.py), so a MoE block traces whole.

What is compiled is the block's `forward`, replaced on the instance like activation checkpointing
replaces it, so parameter names (and checkpoints) are unchanged and the module is the same object:
* torchtitan applies TP -> AC -> compile -> FSDP so that the compiled region holds TP's sharded
  computation and AC's recomputation, and FSDP's per-block all-gather / reshard hooks stay outside
  it. Here that holds by construction: `torch.compile` traces lazily, at the first training forward,
  after `apply_parallelism` has installed TP/EP/PP/FSDP, and it compiles `forward` (what the block's
  `__call__` runs between its hooks), so FSDP2's hooks on the block run eagerly around the compiled
  graph while the submodules' TP hooks are traced inside it. It is therefore applied right after
  activation checkpointing in `parallelize_model`, before pipeline pruning (a pruned block is simply
  never called).
* Only training forwards run compiled (grad enabled, no KV cache). Decoding and evaluation (no_grad
  or inference mode, KV caches, prompt and draft lengths that change every call) run the original
  eager forward, so the speculative decoder never triggers recompiles.

Layouts: one process, data parallelism (FSDP2 or all-reduce), expert parallelism (its all-to-alls
and host-side split sizes break the graph around the dispatch; the rest compiles) and pipeline
stages run compiled and match eager one-process training (tests/distributed/test_compile_layout.py
checks FSDP dp=2). Rejected in validate.py with one line: tensor parallelism (the compiled graph
meets its DTensor hooks with plain tensors and fails) and activation checkpointing (the
recomputation under torch.compile replays a different graph than the one whose saved tensors it
replaces, because the MoE block's module state changes between forward and backward: PyTorch
issue 166926's error).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from .activation_checkpoint import checkpointed_blocks


def _dispatch(compiled: Callable, eager: Callable, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None,
              input_ids_bs=None):
    if cache is None and torch.is_grad_enabled():
        return compiled(x_bsh, positions_bs, None, input_ids_bs)
    return eager(x_bsh, positions_bs, cache, input_ids_bs)


def apply_compile(model: nn.Module, enabled: bool, backend=None) -> nn.Module:
    """Compile every block's training forward in place (see the module docstring); a no-op when off.
    `backend`: torch.compile's (default inductor; tests pass a counting one)."""
    if not enabled:
        return model
    for block in checkpointed_blocks(model):
        if getattr(block, "_tandem_compiled", False):
            continue
        eager = block.forward
        compiled = torch.compile(eager, backend=backend) if backend else torch.compile(eager)
        block.forward = functools.partial(_dispatch, compiled, eager)
        block._tandem_compiled = True
    return model
