"""Activation checkpointing (`train.activation_checkpointing`), applied to a plain model from
outside.

Per transformer block, trunk and MTP layers alike:
* `full`: the block keeps only its input; everything inside is recomputed in backward.
* `selective`: the block keeps the outputs of its matmuls (projections, routed experts, the
  head-sized products), of attention and of the expert-parallel all-to-alls, and recomputes the
  cheap, memory-heavy rest (norms, SwiGLU's elementwise products, rotary, routing softmax/top-k, the
  token gathers) — torchtitan's op-level selective policy.

The block's `forward` is wrapped in place, so parameter names, and with them checkpoints, are the
same with and without it, and the wrapping composes with TP/EP/FSDP hooks and pipeline stages.
Without autograd (evaluation, a frozen trunk under no_grad) the block runs as it is.

A recomputation replays the forward's side effects too: the step counters (models/layers.py
STEP_COUNTERS: the MoE routers' loads, which the aux-free balancing rule and the load metrics read,
and the sums behind the logged aux and indexer losses) are restored after each recomputation, so a
step counts every token and every forward once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator, List

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import tandem.models.moe  # noqa: F401  (registers torch.ops.tandem.grouped_mm, kept under `selective`)
from tandem.models.layers import STEP_COUNTERS

MODES = ("full", "selective")

# Outputs worth keeping under `selective`: the FLOP-heavy products and the expert dispatch's
# exchanges. Everything else is recomputed. The routed experts run as the custom op
# `tandem::grouped_mm` (models/moe.py), which is what the policy sees, not the aten kernel inside
# it. Expert parallelism's all-to-alls are functional collectives (trainer/parallel/tensor.py),
# whose outputs can be kept like any op's: a recomputation then neither re-sends tokens nor waits on
# peers.
_SAVE = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
         torch.ops.tandem.grouped_mm.default,
         torch.ops._c10d_functional.all_to_all_single.default]
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE.append(torch.ops.aten._grouped_mm.default)
# A region compiled by train.compile (compile.py) is one op to the policy; its own partitioner
# already keeps the products and recomputes the elementwise work inside it in backward.
_SAVE.append(torch._higher_order_ops.inductor_compiled_code)
_SAVE_SET = frozenset(_SAVE)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_SET else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _keep_step_counters(block: nn.Module) -> Iterator[None]:
    counters = [b for name, b in block.named_buffers() if name.endswith(STEP_COUNTERS)]
    saved = [c.clone() for c in counters]
    try:
        yield
    finally:
        with torch.no_grad():
            for c, s in zip(counters, saved):
                c.copy_(s)


@contextlib.contextmanager
def _recomputing(block: nn.Module, sac_recompute_ctx) -> Iterator[None]:
    # its clone/copy_ stay outside the SAC replay
    with _keep_step_counters(block), sac_recompute_ctx:
        yield


def _contexts(block: nn.Module, selective: bool):
    """checkpoint's context_fn: (context of the forward, context of the recomputation)."""
    if selective:
        # a compiled block's kept regions return the routers' load counters, which later calls and
        # the recomputation's restore update in place (compile.py)
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(
            _selective_policy, allow_cache_entry_mutation=getattr(block, "_tandem_compiled", False))
    else:
        forward_ctx, recompute_ctx = contextlib.nullcontext(), contextlib.nullcontext()
    return forward_ctx, _recomputing(block, recompute_ctx)


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    # Autocast caches its casts of weights until the outermost autocast exits, so a block run twice
    # in one forward (a looped MTP layer serving several depths) casts its weights only the first
    # time, while each recomputation in backward starts with an empty cache and casts again. The
    # selective policy's replay matches ops by count and would fail on the extra casts; with the
    # cache off, the forward and the recomputation (which inherits this setting) cast alike. The
    # casts are recomputed under `selective` anyway, so nothing more is kept.
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


# What `selective` keeps goes through the saved-tensor hooks in scope (torch's save_on_cpu, a
# memory probe), as every other tensor saved for backward does. torch >= 2.14 asks (and warns until
# told); older torch has no such choice, and its kept outputs bypass them.
_THROUGH_HOOKS = ({"respect_saved_tensors_hooks": True}
                  if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
                  else {})


def _checkpointed(forward: Callable, block: nn.Module, selective: bool, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with _autocast_cache_off() if selective else contextlib.nullcontext():
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=functools.partial(_contexts, block, selective),
                          **_THROUGH_HOOKS, **kwargs)


def checkpointed_blocks(model: nn.Module) -> List[nn.Module]:
    """The blocks that get wrapped: every trunk layer this rank holds and every MTP layer's
    block."""
    blocks = list(model.layers.values()) if getattr(model, "layers", None) is not None else []
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        blocks += [layer.block for layer in mtp.layers]
    return blocks


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Wrap every block's forward (`checkpointed_blocks`) in `mode`, `full` or `selective`."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r} must be one of "
                         f"{', '.join(MODES)}")
    for block in checkpointed_blocks(model):
        if getattr(block, "_tandem_checkpointed", False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward, block, mode == "selective")
        block._tandem_checkpointed = True
    return model
