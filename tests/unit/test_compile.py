"""train.compile in one process: decoding stays eager (no recompiles), the bf16 MTP block reuses the
trunk's graph, and compiled blocks compose with activation checkpointing (losses, gradients and
router loads as eager training; the recomputation reruns the compiled forward under `full` and none
of it under `selective`, the routers count once).

Compiled training against eager training step by step is tests/distributed/test_compile_layout.py's:
tp2 + SP in fp32 with the load-balance and z losses (after three AdamW steps, losses within 1e-5 and
parameters within 3e-5 relative) and ep2 x pp2 in bf16."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tandem.models.attention import KVCache
from tandem.models.layers import STEP_COUNTERS
from tandem.trainer.loss import combine_losses, depth_coefficients
from tandem.trainer.parallel import ParallelState
from tandem.trainer.parallel.compile import apply_compile
from tandem.trainer.parallel.device import resolve_device
from tandem.trainer.recipe import load_config
from tandem.trainer.run import build_model as build_sharded

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OVERRIDES = ["model.vocab_size=300", "model.hidden_size=32", "model.num_layers=3",
             "model.num_heads=4",
             "model.num_kv_heads=2", "model.intermediate_size=64", "model.moe_intermediate_size=16",
             "model.num_experts=4", "model.first_k_dense=1", "model.max_seq_len=64",
             "mtp.num_steps=3",
             "data.vocab_size=260", "data.seq_len=24", "model.balance=aux_loss",
             "model.z_loss_coef=0.001", "train.lr=0.01", "train.warmup_steps=0", "train.eps=1e-6"]


def test_decoding_runs_eager_and_never_compiles():
    """Forwards with a KV cache, or without autograd, take the original forward: no graph is
    compiled however the shapes vary; a training forward compiles."""
    compiled_graphs = []

    def counting_backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    cfg = load_config(None, OVERRIDES)
    model = build_sharded(cfg, ParallelState(device=resolve_device("cpu"))).train()
    apply_compile(model, backend=counting_backend)
    with torch.no_grad():
        cache = KVCache(cfg.model.num_layers, 1, 40, torch.float32, torch.device("cpu"))
        # prefill, then decode steps of varying size
        for start, length in ((0, 7), (7, 1), (8, 4), (12, 1)):
            tokens = torch.randint(0, 300, (1, length))
            model.trunk(tokens, torch.arange(start, start + length).unsqueeze(0), cache)
        model(torch.randint(0, 300, (2, 25)))  # teacher-forced evaluation loss
    assert compiled_graphs == []
    model(torch.randint(0, 300, (2, 25))).loss_sums.sum().backward()
    assert compiled_graphs


def test_bf16_mtp_block_reuses_the_trunk_block_graph():
    """Under bf16 autocast the MTP block's residual stream is the trunk's (fp32), so the MTP block,
    a MoE block like the trunk's, runs the graph the trunk's MoE blocks compiled: two graphs (the
    dense first block, the MoE blocks), not a third for a bf16 input (what the MTP input projection
    returns)."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = build_sharded(load_config(None, OVERRIDES),
                          ParallelState(device=resolve_device("cpu"))).train()
    apply_compile(model, backend=counting_backend)
    block_inputs = []
    model.mtp.layers[0].block.register_forward_pre_hook(lambda m,
                                                        args: block_inputs.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, 300, (2, 25)))
    out.loss_sums.sum().backward()
    assert block_inputs == [torch.float32] * 3  # the K=3 steps of the one MTP layer
    assert len(graphs) == 2


def _checkpointed_step(mode: str, compile_: bool):
    """One training step under train.activation_checkpointing=`mode`: the per-depth losses, the
    gradients, the step counters (models/layers.py), and the matmuls (mm/bmm/addmm and the grouped
    expert op) that ran during backward."""
    torch.manual_seed(0)
    cfg = load_config(None, OVERRIDES + [f"train.compile={str(compile_).lower()}",
                                         f"train.activation_checkpointing={mode}",
                                         "model.balance=aux_free"])
    model = build_sharded(cfg, ParallelState(device=resolve_device("cpu"))).train()
    tokens = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    loss = combine_losses(out.loss_sums, out.token_counts.float(), depth_coefficients(cfg.mtp, 0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    products = ("aten::mm", "aten::bmm", "aten::addmm", "tandem::grouped_mm")
    matmuls = sum(e.count for e in prof.key_averages() if e.key in products)
    loads = {n: b.clone() for n, b in model.named_buffers() if n.endswith(STEP_COUNTERS)}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss_sums.detach() / out.token_counts, grads, loads, matmuls


def test_checkpointing_wraps_the_compiled_forward():
    """Compiled blocks under `full` and `selective` checkpointing: losses, gradients and router
    loads as eager training without checkpointing (a recomputation's counter updates undone, not
    counted twice). In backward, `full` reruns every compiled forward's matmuls, `selective` none:
    each compiled region is kept whole (its own partitioner already kept the products), so its
    backward runs the matmuls a run without checkpointing runs, no more."""
    losses, grads, loads, _ = _checkpointed_step("none", False)
    for mode in ("full", "selective"):
        got_losses, got_grads, got_loads, _ = _checkpointed_step(mode, True)
        torch.testing.assert_close(got_losses, losses, rtol=1e-6, atol=0)
        # the aux losses' [sum, forwards] too: each forward counted once
        assert got_loads.keys() == loads.keys() and any(n.endswith("aux_loss_sum") for n in loads)
        for n in loads:
            torch.testing.assert_close(got_loads[n], loads[n], rtol=1e-6, atol=0, msg=(mode, n))
        worst = max(float((got_grads[n] - grads[n]).norm() / grads[n].norm()) for n in grads)
        # fp32 fusion: 4.4e-6 measured
        assert got_grads.keys() == grads.keys() and worst <= 3e-5, (mode, worst)
    # Each mode's second step: the first step of a mode that compiles a graph compiles its
    # backward during that backward, and the profiler counts the matmuls compilation traces (on
    # fake tensors) as if they ran (with inductor's on-disk cache cold, as on a new CI machine, the
    # compiled backward without checkpointing counted 281 for 221). Past dynamo's recompile limit
    # a block would run eagerly, where these counts are the same: fail instead.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        matmuls = {mode: [_checkpointed_step(mode, True)[3] for _ in range(2)][1]
                   for mode in ("none", "full", "selective")}
    plain = matmuls["none"]
    print(f"matmuls in backward: no checkpointing {plain}, selective {matmuls['selective']}, full "
          f"{matmuls['full']}")
    assert plain > 0 and matmuls["selective"] == plain
    assert matmuls["full"] > plain


def test_qwen4_blocks_compile_without_graph_breaks():
    """Qwen4-Exp's QSA blocks compile as one graph each (the backend `eager`: tracing only). The
    streamed top-k read a data-dependent column count (`.tolist()` then a branch on it): six graph
    breaks per step, and dynamo ran the whole selection eagerly."""
    from torch._dynamo.utils import counters

    from tests.eval_helpers import tiny_qwen4_model

    model = apply_compile(tiny_qwen4_model(2, vocab=64).train(), backend="eager")
    counters.clear()
    tokens = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    out.loss_sums.sum().backward()
    frames = dict(counters["frames"])
    assert frames["total"] == frames["ok"] > 0, frames  # every frame dynamo met became a graph
    assert not counters["graph_break"], dict(counters["graph_break"])
