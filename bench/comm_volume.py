"""Bytes moved by each collective in one training step, per parallel layout, beside the analytic
volume.

`python bench/comm_volume.py` launches each layout under torchrun (gloo, CPU), trains one warm-up
step, then counts every collective of the second step (forward, backward, gradient sync, norm,
router-load and loss reductions) with a TorchDispatchMode that sees both c10d ops (process-group
calls, FSDP2, pipelining p2p) and functional collectives (DTensor). Payload convention per call and
rank: all-reduce / broadcast = tensor bytes, all-to-all = input bytes, all-gather = output bytes,
reduce-scatter = input bytes, p2p = bytes sent. The analytic volume of each rank is computed from
the model dims and the rank's micro-batches, summed over ranks:

  TP  per block execution and micro-batch: attention 2*T*H (o_proj all-reduce fwd, input-grad
      all-reduce bwd); dense MLP 2*T*H; MoE 2*T*H + T*k (routing-weight grads); embedding one
      lookup of B*(S+K) rows x H shared by the MTP steps
          (a pipeline's first stage B*S, its depth stage
      B*(S+K-1)); vocab-parallel CE per depth: 3*T (max, sum-exp, target logit) with the fused head
      backward (the default; 6*T with `recompute`, which reduces again in backward) + T*H: every row
      is kept, one without a valid target masked (IGNORE): no data-dependent shapes.
  SP  (sequence_parallel with tp) instead of TP's all-reduces, per TP region (attention, dense MLP)
      and micro-batch: 2 all-gathers + 2 reduce-scatters of T*H (gather / reduce-scatter forward,
      reduce-scatter / all-gather backward); MoE: the same for its tokens plus the routing weights
      (T*k, gathered and reduce-scattered) and expert ids (T*k int64, gathered); embedding: one
      window of B*(S+K) rows x H all-reduced forward and backward (a pipeline's first stage: a T*H
      reduce-scatter + all-gather, its depth stage's window B*(S+K-1) rows); head T*H gather +
      reduce-scatter per depth, CE 3*T (6*T);
      the tp sum of the sequence-shard gradients of replicated parameters (norms, routers, MTP
      projection); router loads over tp; pipeline activations T*H/tp.
  EP  per MoE block execution: 4*T*k*H (dispatch + combine, fwd + bwd) + E int64 counts.
  PP  activations T*H per micro-batch and stage boundary, gradients back likewise; the shared
      embedding gradient (V/tp*H) summed between first and last stage; (K+1) loss sums all-reduced.
  DP  FSDP2: unsharded (padded) bytes of each FSDP unit per all-gather and reduce-scatter; the
      all-reduce mode (replicate, FSDP2's units unsharded): each unit's gradients over its group, in
      every micro-batch's backward (`parallel.reshard_after_microbatch`, the default) or once per
          step
      (=false, the `...,reshard_after_microbatch=false` layouts: `_fsdp_events`). Plus counts / loss
          sums (K+1 each),
      router loads (E per MoE layer) and the grad-norm scalar.
Ends with `max_measured_over_analytic=<x>`: the ratio farthest from 1 of any collective, either way.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import run_bench, run_under_torchrun  # noqa: E402

LAYOUTS = {
    "tp=2": 2, "ep=2": 2, "pp=2": 2, "pp=2,pp_schedule=interleaved_1f1b": 2, "dp=2": 2,
    "dp=2,dp_mode=allreduce": 2, "dp=2,reshard_after_microbatch=false": 2,
    "dp=2,dp_mode=allreduce,reshard_after_microbatch=false": 2, "tp=2,pp=2": 4, "tp=2,ep=2": 4,
    "ep=2,pp=2": 4, "tp=2,ep=2,pp=2": 8,
    "tp=2,sequence_parallel=true": 2, "tp=2,pp=2,sequence_parallel=true": 4,
    "tp=2,ep=2,sequence_parallel=true": 4,
    "cp=2": 2, "cp=2,cp_sharding=contiguous": 2, "cp=2,tp=2,sequence_parallel=true": 4,
    "qwen4:cp=2": 2, "qwen4:cp=2,cp_sharding=contiguous": 2, "qwen4:cp=4": 4,
}
"""`qwen4:` layouts train QWEN4 (Gated DeltaNet, QSA, PLE, hyper-connections, MoE with the aux loss)
instead (without tp: its SP regions are not counted here)."""
MBS, ACCUM, SEQ, VOCAB, H = 2, 2, 64, 1024, 128
BASE = [
    f"model.hidden_size={H}", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=256", "model.moe_intermediate_size=64", "model.num_experts=4",
    "model.top_k=2",
    "model.num_shared_experts=1", "model.first_k_dense=1", "model.balance=aux_free",
    "model.max_seq_len=128",
    "mtp.num_steps=2", "mtp.num_layers=1", "mtp.loss_chunk_tokens=64", f"data.seq_len={SEQ}",
    f"train.micro_batch_size={MBS}", f"train.grad_accum_steps={ACCUM}", "train.dtype=fp32",
    "logging.wandb=false", "eval.interval=0", "device=cpu", "run.dir=/tmp/tandem_bench_unused",
]
# recipes/qwen4_exp_tiny.yaml's model at narrow widths, in QSA's sparse stage
# (bench/context_scaling.py)
QWEN4 = [
    "flavor=qwen4_exp_tiny", "model.hidden_size=32", "model.head_dim=8",
    "model.linear_key_head_dim=8",
    "model.linear_value_head_dim=8", "model.indexer_head_dim=8", "model.intermediate_size=32",
    "model.moe_intermediate_size=32", "model.shared_expert_intermediate_size=32",
    "model.ple_embed_dim=16",
    "model.hc_lowrank=8", f"data.vocab_size={VOCAB}", "model.indexer_budget=16",
    "model.indexer_warmup_steps=0", "model.max_seq_len=128",
    "mtp.num_steps=2", "mtp.num_layers=1", "mtp.style=looped", f"data.seq_len={SEQ}",
    f"train.micro_batch_size={MBS}",
    f"train.grad_accum_steps={ACCUM}", "train.dtype=fp32", "logging.wandb=false", "eval.interval=0",
    "device=cpu", "run.dir=/tmp/tandem_bench_unused",
]
F32 = 4
I64 = 8


def batch(step, n):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    eod = torch.rand(n, SEQ + 1, generator=g) < 0.05
    return {"tokens": tokens, "loss_mask": torch.ones(n, SEQ),
            "doc_ids": torch.cumsum(eod.long(), 1) - eod.long()}


# --- counting ------------------------------------------------------------------------------------
def _bytes(x):
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(v) for v in x)
    return 0


def make_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = defaultdict(int)
            self.calls = defaultdict(int)

        def add(self, kind, n):
            if os.environ.get("BENCH_DEBUG") and n >= int(os.environ.get("BENCH_DEBUG_MIN",
                                                                         100000)) and (
                    os.environ.get("RANK", "0") == os.environ.get("BENCH_DEBUG_RANK", "0")):
                import traceback
                print(kind, n, "".join(traceback.format_stack(limit=24)[:-3])[-3000:], flush=True)
            self.bytes[kind] += n
            self.calls[kind] += 1

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = f"{func.namespace}.{func.__name__.split('.')[0]}"
            a = args
            if name in ("c10d.allreduce_", "_c10d_functional.all_reduce",
                        "_c10d_functional.all_reduce_"):
                self.add("all_reduce", _bytes(a[0]))
            elif name in ("c10d.alltoall_base_", "_c10d_functional.all_to_all_single"):
                self.add("all_to_all", _bytes(a[1] if name.startswith("c10d") else a[0]))
            elif name == "c10d._allgather_base_":
                self.add("all_gather", _bytes(a[0]))
            elif name == "_c10d_functional.all_gather_into_tensor":
                self.add("all_gather", _bytes(a[0]) * int(a[1]))
            elif name in ("c10d._reduce_scatter_base_", "_c10d_functional.reduce_scatter_tensor"):
                self.add("reduce_scatter", _bytes(a[1] if name.startswith("c10d") else a[0]))
            elif name == "c10d.send":
                self.add("p2p", _bytes(a[0]))
            elif name == "c10d.broadcast_":
                self.add("broadcast", _bytes(a[0]))
            elif name.startswith("c10d.") and name not in ("c10d.recv_", "c10d.barrier",
                                                           "c10d.monitored_barrier_"):
                self.add("other:" + name, _bytes(a[0]))
            return func(*args, **(kwargs or {}))

    return Counter()


# --- analytic -------------------------------------------------------------------------------------
def analytic(cfg, model, pstate, batches):
    """This rank's expected bytes per collective kind for one step."""
    from torch.distributed.tensor import DTensor

    from tandem.models.moe import MoE

    tp, ep, dp, cp = pstate.degrees.tp, pstate.degrees.ep, pstate.degrees.dp, pstate.degrees.cp
    m, K, k = cfg.model, cfg.mtp.num_steps, cfg.model.top_k
    E, Hh = m.num_experts, m.hidden_size
    out = defaultdict(float)
    pipe = pstate.pipeline
    if pipe is not None:
        has_first, has_last = pipe.has_first, pipe.has_last
    else:
        has_first = has_last = True
    trunk = [model.layers[i] for i in model.layers]
    execs = [(isinstance(b.mlp, MoE)) for b in trunk]
    if has_last:
        execs += [isinstance(model.mtp.layer_for_step(s).block.mlp, MoE) for s in range(1, K + 1)]
    n_micro = len(batches)
    T = MBS * SEQ // cp  # this rank's rows of each micro-batch
    sp = bool(cfg.parallel.sequence_parallel and tp > 1)
    # the head's per-row reductions, fwd (+ recompute)
    ce = 3 if cfg.mtp.loss_head_backward == "fused" else 6
    for b in batches:
        if sp:
            aux = m.computes_aux_loss
            for is_moe in execs:
                regions = 1 if is_moe else 2
                out["all_gather"] += F32 * 2 * T * Hh * regions
                out["reduce_scatter"] += F32 * 2 * T * Hh * regions
                if is_moe:
                    out["all_gather"] += F32 * 2 * T * Hh + F32 * T * k + 8 * T * k + (F32 * T * E
                                                                                       if aux
                                                                                       else 0)
                    out["reduce_scatter"] += F32 * 2 * T * Hh + F32 * T * k + (F32 * T * E if aux
                                                                               else 0)
            # the embedding: the trunk and the MTP steps read one lookup of the whole S+K window,
            # all-reduced forward and backward (`SequenceShards`); under a pipeline the first stage
            # reduce-scatters its S tokens' lookup (all-gather backward) and the depth stage
            # all-reduces a window of S+K-1 rows
            if pipe is None:  # under cp the rank's rows of each of the K + 1 shifts
                out["all_reduce"] += 2 * F32 * MBS * ((K + 1) * SEQ // cp if cp > 1
                                                      else SEQ + K) * Hh
            else:
                out["reduce_scatter"] += F32 * T * Hh * (1 if has_first else 0)
                out["all_gather"] += F32 * T * Hh * (1 if has_first else 0)
                out["all_reduce"] += 2 * F32 * MBS * (SEQ + K - 1) * Hh * (1 if has_last and K
                                                                           else 0)
            if has_last:
                out["all_gather"] += F32 * T * Hh * (K + 1)
                out["reduce_scatter"] += F32 * T * Hh * (K + 1)
                # every row keeps its place (no valid target: IGNORE), so each depth reduces T rows
                out["all_reduce"] += F32 * ce * T * (K + 1)
        elif tp > 1:
            for is_moe in execs:
                out["all_reduce"] += F32 * (2 * T * Hh + 2 * T * Hh + (T * k if is_moe else 0))
            # the embedding: one lookup per forward, the MTP steps reading it shifted (S+K rows per
            # sequence); under a pipeline the first stage looks up its S tokens and the stage
            # holding the MTP depths one window of S+K-1 rows for them all (models/model.py
            # `shared_lookup`)
            window = (K + 1) * SEQ // cp if cp > 1 else SEQ + K
            rows = window if pipe is None else (SEQ if has_first else 0) + (SEQ + K - 1 if has_last
                                                                            and K else 0)
            out["all_reduce"] += F32 * MBS * rows * Hh
            if has_last:
                # all T rows per depth, as above
                out["all_reduce"] += F32 * (ce * T + T * Hh) * (K + 1)
        if ep > 1:
            for is_moe in execs:
                if is_moe:
                    out["all_to_all"] += F32 * 4 * T * k * Hh + 8 * E
    if sp:
        finisher = pstate.gradient_finisher
        for name, p in model.named_parameters():
            if name in finisher.sp_partial:
                out["all_reduce"] += F32 * (p.to_local() if isinstance(p, DTensor) else p).numel()
        # router loads summed over tp (otherwise counted with the batch ranks')
        if dp * cp * ep == 1:
            out["all_reduce"] += F32 * E * len([x for x in model.modules() if isinstance(x, MoE)])
    act = T * Hh // (tp if sp else 1)
    if pipe is not None:
        for s in pipe._mine:
            if s != pipe._n_stages - 1:
                out["p2p"] += F32 * n_micro * act
            if s != 0:
                out["p2p"] += F32 * n_micro * act
        # the shared-embedding gradient, as held locally (tp / fsdp shard)
        if has_first or has_last:
            w = model.embed_tokens.weight
            out["all_reduce"] += F32 * (w.to_local() if isinstance(w, DTensor) else w).numel()
        # the per-depth loss sums, each from the rank holding its depth
        out["all_reduce"] += F32 * (K + 1)
    if cp > 1:
        for kind, n in context_exchanges(cfg, model, pstate).items():
            out[kind] += n_micro * n
    # the valid-target counts over the batch split (every cp rank counts whole samples)
    if dp * ep > 1:
        out["all_reduce"] += F32 * (K + 1)
    if dp * cp * ep > 1:  # the loss sums and router loads over the ranks computing different rows
        out["all_reduce"] += F32 * (K + 1) + F32 * E * len([x for x in model.modules()
                                                            if isinstance(x, MoE)])
        from torch.distributed.fsdp import FSDPModule

        # torch's replicate: FSDP2's units, all-reduced
        replicate = cfg.parallel.dp_mode == "allreduce"
        for unit in model.modules() if pipe is None else list(model.modules()) + pipe.modules:
            if not isinstance(unit, FSDPModule):
                continue
            state = unit._get_fsdp_state()
            for group in ([state._fsdp_param_group] if state._fsdp_param_group else []):
                full = 0
                for fp in group.fsdp_params:
                    shape = fp.padded_sharded_param_size
                    full += math.prod(shape) * (1 if replicate else group.mesh_info.shard_mesh_size)
                every = cfg.parallel.reshard_after_microbatch
                gathers, scatters = _fsdp_events(unit, model, pipe, n_micro, every)
                if pipe is None and _inside_mtp(unit, model):
                    # run once per MTP step: gathered each time. Its post-backward hook fires K
                    # times per backward, the first before any of its gradients exist: with a sync
                    # in every micro-batch that one finds nothing to reduce (one reduce-scatter per
                    # micro-batch); with reshard_after_microbatch=false the last micro-batch's first
                    # hook reduces what the earlier micro-batches accumulated, the later ones the
                    # rest (K per step, K=2 here). Under cp x ep, experts sharded over cp (not
                    # among LAYOUTS), autograd reaches depth 1's experts before depth 2's
                    # post-backward: the unit is still unsharded there and fires one post-backward,
                    # so a backward gathers it once, not K times (one gather per rank and
                    # micro-batch less than counted here; the layout equals one process,
                    # test_context_parallel.py)
                    gathers *= K
                    scatters = n_micro if every else K
                if replicate:
                    out["all_reduce"] += F32 * full * scatters
                else:
                    out["all_gather"] += F32 * full * gathers
                    out["reduce_scatter"] += F32 * full * scatters
    out["all_reduce"] += F32  # the global grad-norm scalar (fp32: no fp64 on accelerators)
    m = cfg.model
    if m.num_experts > 0 and m.computes_aux_loss:
        out["all_reduce"] += 2 * F32  # the logged moe/aux_loss's [sum, forwards] (loss.step_mean)
    return dict(out)


def context_exchanges(cfg, model, pstate):
    """This rank's bytes per micro-batch for the cp exchanges (trainer/parallel/context.py), each an
    all-gather (output bytes: the whole window's) whose backward reduce-scatters as many bytes where
    the tensor has a gradient (not token ids, positions or expert ids), per mixer execution:
      attention  K and V [B, S, kv_heads / tp, head_dim];
      QSA        K, V and positions [B, S] int64 (no gradient); the layers that select (not the
                 MTP depths reusing depth 1's selection) also the indexer's raw keys [B, S, D_i],
                 and where the indexer trains by its KL, the raw keys' gradient and the count of
                 queries with a visible block ([B, S] int64);
      GDN        the conv input's halo, kernel - 1 rows of [conv width / tp] per window chunk, and
                 the carry: one [H / tp, dk, dk + dv] fp32 per window chunk;
      PLE        the n-gram ids' halo (ngram_size - 1 int64 per chunk, no gradient) and the conv
                 input's, conv_window rows of [hc x H] per chunk;
      MoE        with the aux / z loss, an all-reduce of its 2E + 3 fp32 sums forward and backward.
    Chunks: 2 cp (zigzag) or cp (contiguous); S, B the micro-batch's window and rows. Plus, with
    PLE, the n-gram table's row split over the stage's ranks (cp among them): per PLE layer, the
    send counts (int64 per rank), this rank's ids (int32, S / cp x ngram heads per row) and their
    rows back and their gradients (fp32, embed_dim / ngram heads each; the rows' all-to-all input is
    data-dependent per rank, its sum over ranks is not)."""
    from tandem.models.moe import MoE

    m, p, K = cfg.model, cfg.parallel, cfg.mtp.num_steps
    tp, cp = p.tp, p.cp
    chunks = 2 * cp if p.cp_sharding == "zigzag" else cp
    rows, length = MBS * SEQ, SEQ // chunks
    kv = m.num_kv_heads // tp * m.resolved_head_dim
    mtp_kind = "indexed_attention" if m.uses_qsa else "attention"
    kinds = [m.layer_type(int(i)) for i in model.layers] + [mtp_kind] * K
    # QSA layers that select run their indexer and gather its raw keys (MTP depths after the first
    # reuse depth 1's selection under mtp.qsa_reuse_indices, and run none); with the KL they train
    # it: their raw keys get a gradient, and they gather the window's count of queries with a
    # visible block (int64 [B, S])
    reusing = max(K - 1,
                  0) if (cfg.mtp.qsa_reuse_indices and mtp_kind == "indexed_attention") else 0
    selecting = sum(k == "indexed_attention" for k in kinds) - reusing
    kl = selecting if m.indexer_loss_coef > 0 else 0
    ag = F32 * rows * m.indexer_head_dim * selecting + I64 * rows * kl
    rs = F32 * rows * m.indexer_head_dim * kl
    for kind in kinds:
        if kind == "attention":
            ag += 2 * F32 * rows * kv
            rs += 2 * F32 * rows * kv
        elif kind == "indexed_attention":
            ag += F32 * rows * 2 * kv + I64 * rows
            rs += F32 * rows * 2 * kv
        elif kind == "linear_attention":
            nk, nv = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
            dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
            conv = 2 * nk * dk + nv * dv
            halo = F32 * MBS * chunks * min(m.linear_conv_kernel - 1, length) * conv
            state = F32 * MBS * chunks * nv * dk * (dk + dv)
            ag += halo + state
            rs += halo + state
    for i in model.layers:
        if int(i) in m.ple_layers:
            ag += I64 * MBS * chunks * min(m.ngram_size - 1, length)
            # a chunk sends at most itself
            conv_window = min((m.ple_conv_kernel - 1) * m.ngram_size, length)
            ag += F32 * MBS * chunks * conv_window * m.hc_count * m.hidden_size
            rs += F32 * MBS * chunks * conv_window * m.hc_count * m.hidden_size
    ar, a2a = 0.0, 0.0
    if m.ple_layers and pstate.world_size > 1:
        heads = (m.ngram_size - 1) * m.heads_per_ngram
        ids = MBS * SEQ // cp * heads
        a2a += len([i for i in model.layers if int(i) in m.ple_layers]) * (
            8 * pstate.world_size + 4 * ids + 2 * F32 * ids * (m.ple_embed_dim // heads))
    # the aux / z loss's per-expert sums, all-reduced forward and backward (`context.sum`)
    if m.computes_aux_loss:
        moe = sum(isinstance(model.layers[i].mlp, MoE) for i in model.layers)
        moe += K * isinstance(model.mtp.layer_for_step(1).block.mlp, MoE) if K else 0
        ar += moe * 2 * F32 * (2 * m.num_experts + 3)
    return {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar, "all_to_all": a2a}


def _inside_mtp(unit, model) -> bool:
    mtp = getattr(model, "mtp", None)
    return mtp is not None and unit is not model and any(unit is x for x in mtp.modules())


def _fsdp_events(unit, model, pipe, n_micro, every: bool):
    """(all-gathers, reduce-scatters) of one FSDP unit per step."""
    is_root = unit is model or (pipe is not None and unit in pipe.modules)
    if every:
        # parallel.reshard_after_microbatch (the default): each micro-batch's backward
        # reduce-scatters and reshards: blocks gather in every forward and every backward, the root
        # (not resharded after forward) once per micro-batch.
        return (n_micro if is_root else 2 * n_micro), n_micro
    # gradient sync (and the resharding after backward) only on the last micro-batch: blocks gather
    # in the first forward and in every backward, the root once; one reduce-scatter per step.
    return (1 if is_root else n_micro + 1), 1


def _count_context_exchanges() -> dict:
    """Wraps the cp exchanges (trainer/parallel/context.py): counts the all-gathers' output bytes
    and their gradients' (the backward reduce-scatters' input) as `gather`, and
    `ContextShards.sum`'s all-reduced bytes forward and backward as `sum`, while `on`."""
    from tandem.trainer.parallel import context

    seen = defaultdict(float)

    def on_grad(kind, y):
        if y.requires_grad:
            y.register_hook(lambda g: seen.__setitem__(kind, seen[kind] + _bytes(g)))

    inner_gather, inner_sum = context.gather_along, context.ContextShards.sum

    def gather(x, group, dim):
        y = inner_gather(x, group, dim)
        if seen["on"]:
            seen["gather"] += _bytes(y)
            on_grad("gather", y)
        return y

    def summed(self, x):
        y = inner_sum(self, x)
        if seen["on"]:
            seen["sum"] += _bytes(y)
            on_grad("sum", y)
        return y

    context.gather_along, context.ContextShards.sum = gather, summed
    return seen


# --- worker (under torchrun) ----------------------------------------------------------------------
def worker(out_path, layouts):
    import torch.distributed as dist

    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    torch.set_num_threads(1)
    exchanged = _count_context_exchanges()
    results = {}
    for layout in layouts:
        base, spec = (QWEN4, layout[len("qwen4:"):]) if layout.startswith("qwen4:") else (BASE,
                                                                                          layout)
        cfg = load_config(None, base + [f"parallel.{kv}" for kv in spec.split(",")])
        cfg.model.vocab_size = VOCAB
        device = resolve_device("cpu")
        pstate = init_parallel(cfg, device)
        model = build_model(cfg, pstate)
        tr = TrainStep(cfg, model, pstate)
        model.train()
        counter = None
        for step in range(2):
            full = batch(step, MBS * ACCUM * pstate.dp_size)
            per = MBS * ACCUM
            mine = {k: v[pstate.dp_rank * per:(pstate.dp_rank + 1) * per] for k, v in full.items()}
            batches = [{k: v[i * MBS:(i + 1) * MBS] for k, v in mine.items()} for i in range(ACCUM)]
            coefs = depth_coefficients(cfg.mtp, step)
            if step == 1:
                counter = make_counter()
                counter.__enter__()
                exchanged.clear()
                exchanged["on"] = 1
            counts = tr.global_target_counts(batches)
            # QSA's stage, as the training loop passes it
            pstate.all_reduce_replicas(tr.forward_backward(batches, counts, coefs,
                                                           tr.indexers.dense(step)))
            tr.clip_gradients()
            tr.update_router_biases()
            if step == 1:
                counter.__exit__(None, None, None)
                exchanged["on"] = 0
            tr.optimizer.step()
            tr.optimizer.zero_grad(set_to_none=True)
        measured = dict(counter.bytes)
        expected = analytic(cfg, model, pstate, batches)
        # the cp exchanges alone, beside context_cost's count of the bytes a rank sends
        if cfg.parallel.cp > 1:
            from tandem.trainer.context_cost import context_bytes

            # of an all-gather's output / a reduce-scatter's input
            share = (cfg.parallel.cp - 1) / cfg.parallel.cp
            # a ring all-gather / reduce-scatter sends `share` of its output / input, an all-reduce
            # twice that
            measured["cp_sent"] = share * (exchanged["gather"] + 2 * exchanged["sum"]) / ACCUM
            expected["cp_sent"] = context_bytes(cfg, list(range(cfg.model.num_layers)),
                                                cfg.mtp.num_steps, F32)["sent"]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (measured, expected))
        results[layout] = gathered
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(only=()):
    """`python bench/comm_volume.py [LAYOUT ...]`: every layout, or just the named ones."""
    selected = {k: v for k, v in LAYOUTS.items() if not only or k in only}
    by_world = defaultdict(list)
    for layout, world in selected.items():
        by_world[world].append(layout)
    results = {}
    for world, layouts in sorted(by_world.items()):
        results.update(run_under_torchrun(__file__, world, layouts))
    worst, worst_sent = 1.0, 0.0
    print(f"{'layout':36s} {'collective':16s} {'measured MB':>12s} {'analytic MB':>12s} "
          f"{'ratio':>7s}")
    for layout in selected:
        meas, ana = defaultdict(float), defaultdict(float)
        for m_rank, a_rank in results[layout]:
            for k, v in m_rank.items():
                meas[k] += v
            for k, v in a_rank.items():
                ana[k] += v
        for kind in sorted(k for k in (set(meas) | set(ana)) - {"cp_sent"} if meas[k] or ana[k]):
            ratio = meas[kind] / ana[kind] if ana[kind] else float("inf")
            # the ratio farthest from 1 either way: a collective under-counted or missing too
            worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
            print(f"{layout:36s} {kind:16s} {meas[kind] / 1e6:12.4f} {ana[kind] / 1e6:12.4f} "
                  f"{ratio:7.3f}")
        sent_m, sent_a = meas.pop("cp_sent", 0.0), ana.pop("cp_sent", 0.0)
        total_m, total_a = sum(meas.values()), sum(ana.values())
        print(f"{layout:36s} {'TOTAL':16s} {total_m / 1e6:12.4f} {total_a / 1e6:12.4f} "
              f"{total_m / total_a:7.3f}")
        if sent_a:  # per micro-batch, summed over ranks
            worst_sent = max(worst_sent, abs(sent_m / sent_a - 1))
            print(f"{layout:36s} {'cp sent/microb.':16s} {sent_m / 1e6:12.4f} {sent_a / 1e6:12.4f} "
                  f"{sent_m / sent_a:7.3f}  (context_cost.context_bytes 'sent')")
    print(f"max_measured_over_analytic={worst:.4f}")
    if any("cp=" in layout for layout in selected):
        print(f"context_cost_sent_max_deviation={worst_sent:.4f}")


if __name__ == "__main__":
    run_bench(lambda: main(sys.argv[1:]), worker)
