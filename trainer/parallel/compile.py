"""Regional `torch.compile` (`train.compile`): each transformer block's forward, compiled in place.

As torchtitan does, the unit of compilation is one transformer block (every trunk layer this rank
holds and every MTP layer's block, the list activation checkpointing uses), not the whole model:
blocks of one shape share one compiled graph (the parameters are graph inputs), so compile time does
not grow with depth, and the loss code around them (chunked head, MTP chain, pipeline stages) stays
eager. The grouped expert matmul is a custom op (models/moe.py), so a MoE block traces whole.

What is compiled is the block's `forward`, replaced on the instance, so parameter names (and
checkpoints) are unchanged and the module is the same object. `torch.compile` traces lazily, at the
first training forward, after `apply_parallelism` has installed TP/EP/PP/FSDP, and it compiles
`forward` (what the block's `__call__` runs between its hooks): FSDP2's hooks on the block run
eagerly around the compiled graph, while the submodules' tensor-parallel hooks (DTensor
`PrepareModuleInput` / `ColwiseParallel` / `RowwiseParallel`, sequence parallelism's gathers and
reduce-scatters) and the DTensor parameters are traced into it, as in torchtitan's per-block compile
under TP and SP. Only training forwards run compiled (grad enabled, no KV cache); decoding and
evaluation (no_grad or inference mode, KV caches, prompt and draft lengths that change every call)
run the original eager forward, so the speculative decoder never triggers recompiles.

Two details make TP blocks compile:
* The vocab-parallel embedding's output under SP is an `AsyncCollectiveTensor` (its reduce-scatter
  runs asynchronously); handed to a compiled graph as is, dynamo unwraps it and the embedding's
  gradient is lost (the engine then feeds zeros of the wrong type to DTensor's redistribute). The
  dispatch waits on it first, differentiably (`_Waited`).
* Expert parallelism's `exact` dispatch (the default) reads its split sizes back to the host with
  `.tolist()`. Dynamo captures those reads as unbacked symbolic sizes (`capture_scalar_outputs`, as
  torchtitan sets for its token-choice MoE), so a MoE block still traces whole and one graph serves
  every step's token counts; the read is still a host sync when the graph runs. Otherwise the read
  breaks the graph and the resumed frame guards on each received size: a recompile per new count,
  past dynamo's recompile limit at ep=4 (the block then runs eager). `parallel.ep_dispatch=padded`
  keeps the sizes static and the counts on the device. Either dispatch over ep=2 compiles into one
  graph that serves every routing and matches the one-process layer
  (tests/unit/test_ep_dispatch.py).

Activation checkpointing wraps the compiled forward (`parallelize_model` applies compile first, then
activation_checkpoint.py's per-block wrapper): AC(compile(block)), torchtitan's order for MoE
blocks. Compiling the checkpoint instead (compile(AC(block))) cannot trace Tandem's MoE blocks,
whose forward updates the routers' load counters and records the aux loss (side effects a checkpoint
region may not have under dynamo); it falls back to an eager checkpoint that replays the counters
(counted twice).
* `full`: the block keeps its input; backward reruns the compiled forward. The recomputation must
  run the graph the forward ran, so a frame's compiled graphs are taken in the order they were
  compiled, not most-recently-used first (dynamo's LRU order picks another valid graph whose saved
  tensors differ: PyTorch issue 166926, torchtitan's fix).
* `selective`: each compiled region is one op to the selective policy (inductor's
  `wrap_inductor_compiled_regions`), and the policy keeps it: inside it, inductor's own partitioner
  already keeps the matmul outputs and recomputes the fused elementwise work in backward, which is
  what `selective` asks for; ops outside compiled regions (the expert dispatch's all-to-alls) follow
  the op-level policy. Regions are wrapped whenever compile is on, so graphs compiled for one mode
  serve another in the same process.
The step counters (the routers' loads, the logged losses' sums) are restored after each
recomputation by the checkpoint wrapper, compiled or not.

Layouts: one process, data parallelism (FSDP2 or all-reduce), tensor and sequence parallelism,
expert parallelism, pipeline stages and their combinations (the flagship tp x ep x pp + SP), with
each activation checkpointing mode, run compiled and train like eager one-process training
(tests/distributed/test_compile_layout.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from .activation_checkpoint import checkpointed_blocks


class _Waited(torch.autograd.Function):
    """The waited-on tensor of an `AsyncCollectiveTensor`, with the gradient passed through."""

    @staticmethod
    def forward(ctx, x):
        out = x.trigger_wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _dispatch(compiled: Callable, eager: Callable, x_bsh: torch.Tensor, positions_bs: torch.Tensor,
              cache=None, input_ids_bs=None, **block_args):
    if cache is None and torch.is_grad_enabled():
        if isinstance(x_bsh, AsyncCollectiveTensor):
            x_bsh = _Waited.apply(x_bsh)
        # Autocast's weight-cast cache is part of the global state a compiled graph is guarded on,
        # and selective checkpointing turns it off around its blocks: off here always, so every
        # checkpointing mode, and a recomputation, runs the same graphs (casts inside a graph are
        # planned by inductor).
        was = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            return compiled(x_bsh, positions_bs, None, input_ids_bs, **block_args)
        finally:
            torch.set_autocast_cache_enabled(was)
    return eager(x_bsh, positions_bs, cache, input_ids_bs, **block_args)


def configure_compiler() -> None:
    """The process-wide compiler settings Tandem's compiled blocks rely on (`apply_compile` sets
    them)."""
    # the recomputation of a checkpointed block replays the graph its forward ran (issue 166926)
    torch._C._dynamo.eval_frame._set_lru_cache(False)
    # the selective checkpointing policy sees (and keeps) each compiled region as one op
    torch._inductor.config.wrap_inductor_compiled_regions = True
    # the exact expert dispatch's split sizes, read with `.tolist()`, become symbolic (unbacked)
    # sizes in the graph instead of a graph break whose resumed frame guards on every size: one
    # graph then serves every step's token counts (without it, each new count recompiles until
    # dynamo's limit is reached)
    torch._dynamo.config.capture_scalar_outputs = True
    # a block compiles one graph per variant it runs (Qwen4-Exp with two MTP layers: 6 of them:
    # with or without PLE ids, the mixer kind, the QSA stage and whether the selection is returned);
    # past dynamo's default limit of 8 a further variant would run eagerly without a word
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)


def apply_compile(model: nn.Module, backend=None) -> nn.Module:
    """Compile every block's training forward in place (see the module docstring). Apply before
    activation checkpointing, which then wraps the compiled forward.
    `backend`: torch.compile's (default inductor; tests pass a counting one)."""
    configure_compiler()
    for block in checkpointed_blocks(model):
        if getattr(block, "_tandem_compiled", False):
            continue
        eager = block.forward
        compiled = torch.compile(eager, backend=backend) if backend else torch.compile(eager)
        block.forward = functools.partial(_dispatch, compiled, eager)
        block._tandem_compiled = True
    return model
