"""Train a tiny MoE+MTP model for a few steps under one or more parallel layouts and dump the
results.

Run as a module from the repository root on N ranks (`torchrun --standalone --nproc-per-node N -m
tests.distributed.worker OUT LAYOUT...`, or tests/processes.py's `command`, as the suite starts it;
each LAYOUT a comma-separated list of overrides such as `tp=2,pp=2,pp_schedule=interleaved_1f1b`),
or import `run_layout` in one process for the single-process reference. Data is synthetic (a pure
function of the step), split over the batch ranks exactly as the trainer splits a global batch. Each
rank writes `OUT/<layout>.rank<r>.pt`: per-step per-depth losses, the grad norms and the full
(gathered) parameters and router biases it holds after the last step; what its training steps handed
the collectives (op, device, dtype; see collectives.py), the dtypes its nn.Linear layers computed in
(bf16 evidence) and those of every module holding parameters itself (norms, embeddings, experts,
routers), by class. A layout item `train.dtype=bf16` trains in bf16 (any dotted key passes
through)."""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional

import torch

from tandem.models import flavors
from tests import processes

STEPS = 3
MICRO_BATCH = 2
GRAD_ACCUM = 2
SEQ = 16
VOCAB = 128

# Adam eps 1e-6 (not 1e-8): elements whose gradient is ~1e-8 would otherwise turn fp32 rounding
# noise (a different summation order) into O(lr) update differences.
BASE = [
    "model.hidden_size=32", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=64", "model.moe_intermediate_size=16", "model.num_experts=4",
    "model.top_k=2",
    "model.num_shared_experts=1", "model.first_k_dense=1", "model.balance=aux_free",
    "model.bias_update_rate=0.01",
    "model.max_seq_len=64", "mtp.num_steps=2", "mtp.num_layers=1", "mtp.loss_chunk_tokens=24",
    f"data.seq_len={SEQ}", f"train.micro_batch_size={MICRO_BATCH}", "train.lr=0.01",
    "train.min_lr=0.001",
    "train.warmup_steps=0", "train.eps=1e-6", f"train.max_steps={STEPS}", "train.dtype=fp32",
    "train.grad_clip=1.0", "logging.wandb=false", "eval.interval=0", "device=cpu",
]


# Named model presets a layout can carry as `preset.<name>=1` (dotted, so the single-process
# reference shares it; expanded here, so layout names and the files named after them stay short).
PRESETS = {
    # Qwen4-Exp: layers 1 and 3 QSA (budget 8 of 16 positions: selection active), 0 and 2 Gated
    # DeltaNet, PLE on layer 0, 4 hyper-connection streams, the qwen4_exp drafter, one dense warm-up
    # step in which only the indexers learn (model.indexer_warmup=indexer_only: a joint step updates
    # every parameter once more, and Adam turns the fp32 summation-order noise of elements whose
    # gradient is near its eps into parameter differences of 1e-4..1e-3 after three steps; the
    # warm-up mode is a trainer choice of which gradients to keep, the same on every layout).
    "qwen4": [
        "model.full_attention_interval=2", "model.hc_count=4", "model.hc_lowrank=8",
        "model.zero_centered_norm=true",
        "model.shared_expert_gate=true", "model.router_score=softmax", "model.first_k_dense=0",
        "model.head_dim=8",
        "model.partial_rotary_factor=0.5", "model.linear_num_key_heads=2",
        "model.linear_num_value_heads=4",
        "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "model.indexer_heads=2",
        "model.indexer_head_dim=8", "model.indexer_budget=8", "model.indexer_compress_ratio=4",
        "model.indexer_warmup_steps=1", "model.indexer_warmup=indexer_only", "model.ple_layers=[0]",
              "model.heads_per_ngram=2",
        "model.ngram_vocab_base=97", "model.eos_token_id=1",
    ],
    # MLA and YaRN as the `debug_mla` flavor sets them (models/flavors.py), on this file's 4 heads
    "mla": [kv for kv in flavors.overrides("debug_mla")
            if kv not in flavors.overrides("debug") and not kv.startswith("model.num_kv_heads=")]
    + ["model.num_kv_heads=4"],
}


LOGGED_FIGURES = ("moe/aux_loss", "loss/indexer", "moe/max_over_mean_load",
                  "moe/mean_max_over_mean_load")
"""What the step records log beside the per-depth losses: the auxiliary losses (means over every
forward of the step on every rank) and the expert loads' balance over every MoE layer (under pp,
every stage's)."""


def layout_overrides(layout: str) -> List[str]:
    """`tp=2,pp=2` -> parallel.* overrides; items with a dot (`model.qk_norm=true`) are full keys;
    list items are separated by `:` (`pp_layout=[4:0]`); `preset.<name>=1` expands to
    PRESETS[name]."""
    out = []
    for kv in layout.split(","):
        if not kv or kv == "single":
            continue
        key = kv.split("=")[0]
        if key.startswith("preset."):
            out += PRESETS[key[len("preset."):]]
        else:
            out.append((kv if "." in key else f"parallel.{kv}").replace(":", ","))
    return out


def make_cfg(layout: str, grad_accum: int):
    from tandem.trainer.recipe import load_config

    cfg = load_config(None, BASE + [f"train.grad_accum_steps={grad_accum}",
                                    "run.dir=/tmp/tandem_dist_unused"]
                      + layout_overrides(layout))
    cfg.model.vocab_size = VOCAB  # below the stdlib tokenizer's minimum; the data here is synthetic
    return cfg


def global_batch(step: int, n: int, edge_documents: bool = False, seq: int = SEQ,
                 padded: Optional[bool] = None) -> Dict[str, torch.Tensor]:
    """`edge_documents` (the layouts with data.document_mask): a document boundary in every row
    where layouts cut the window: a start exactly at the SP shard edge (tp=2: position SEQ/2) and
    one off either side, at position 1 and at the window's end (rows are what pipeline micro-batches
    and batch ranks split); with a longer `seq` (context parallelism's chunk edges) also at seq/4
    and 3seq/4 and one off them; and (`padded`, by default with the documents) padding at the end
    of half the rows."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    eod = torch.rand(n, seq + 1, generator=g) < 0.1
    if edge_documents:
        ends = [seq // 2 - 1, seq // 2 - 2, seq // 2, 0, seq - 1]
        if seq > SEQ:
            ends += [seq // 4 - 1, seq // 4, 3 * seq // 4 - 1, 3 * seq // 4 - 2]
        ends = torch.tensor(ends)
        eod[torch.arange(n), ends[torch.arange(n) % len(ends)]] = True
    padding = None
    if edge_documents if padded is None else padded:
        # padding (as the chat windows lay it out: a document of its own, no target in it), which
        # MoE loads and auxiliary losses and the QSA indexer's KL leave out: from one row before
        # the SP shard edge (so across it, and across the chunk edges after it), in the last input
        # only, or none (half the rows: documents long enough for QSA's indexer to have two
        # blocks to choose from, and a KL to learn from in the dense warm-up)
        first = torch.tensor([seq // 2 - 1, seq + 1, seq - 1, seq + 1])[torch.arange(n) % 4]
        padding = torch.arange(seq)[None] >= first[:, None]
        padded = first <= seq - 1
        eod[torch.arange(n)[padded], first[padded] - 1] = True
    doc_ids = torch.cumsum(eod.long(), dim=1) - eod.long()
    loss_mask = (torch.rand(n, seq, generator=g) > 0.1).float()
    if padding is None:
        return {"tokens": tokens, "loss_mask": loss_mask, "doc_ids": doc_ids}
    loss_mask[torch.arange(seq)[None] >= first[:, None] - 1] = 0.0
    return {"tokens": tokens, "loss_mask": loss_mask, "doc_ids": doc_ids, "padding": padding}


def rank_micro_batches(step: int, batch_rank: int, batch_size: int, grad_accum: int,
                       edge_documents: bool = False, seq: int = SEQ):
    """This batch rank's micro-batches: sample j of the global batch goes to rank j //
    (accum*mbs)."""
    per_rank = grad_accum * MICRO_BATCH
    full = global_batch(step, per_rank * batch_size, edge_documents, seq)
    start = batch_rank * per_rank
    return [{k: v[start + m * MICRO_BATCH: start + (m + 1) * MICRO_BATCH] for k, v in full.items()}
            for m in range(grad_accum)]


def run_layout(layout: str, batch_size_for_ref: int = 1, recorder=None) -> dict:
    """Train STEPS steps under `layout` (in this process group); return losses and full params.
    `recorder` (a collectives.CollectiveRecorder) is switched on around the training steps."""
    from torch.distributed.tensor import DTensor

    from tandem.models.layers import STEP_COUNTERS
    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.optim import lr_at, set_lr
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    single = layout.split(",")[0] == "single"
    accum = GRAD_ACCUM * (batch_size_for_ref if single else 1)
    cfg = make_cfg(layout, accum)
    device = resolve_device("cpu")
    if single:
        from tandem.trainer.parallel import ParallelState

        pstate = ParallelState(device=device)
    else:
        pstate = init_parallel(cfg, device)
    model = build_model(cfg, pstate)
    tr = TrainStep(cfg, model, pstate)
    model.train()
    losses, norms, logged = [], [], []
    linear_dtypes = set()
    # class of a module holding parameters itself -> its outputs' dtypes
    owner_dtypes: Dict[str, set] = {}

    def note_dtype(module, args, out):
        if isinstance(module, torch.nn.Linear) and isinstance(out, torch.Tensor):
            linear_dtypes.add(str(out.dtype))
        if isinstance(out,
                      torch.Tensor) and out.is_floating_point() and next(module.parameters(False),
                                                                              None) is not None:
            # a module that is an FSDP unit itself has the class FSDP<its class>: recorded by its
            # own
            owner_dtypes.setdefault(type(module).__name__.removeprefix("FSDP"),
                                    set()).add(str(out.dtype))

    # What the first forward's recurrence and stream mixing read (Gated DeltaNet's exp(A_log) and
    # dt_bias, each hyper-connection's stream norm, each router's weight: this rank's values, still
    # the initial ones), and the dtypes of the residual streams entering every trunk block but the
    # first (whose input is the embedding, gathered in bf16 under FSDP's policy).
    from tandem.models.block import TransformerBlock
    from tandem.models.gated_deltanet import GatedDeltaNet
    from tandem.models.hyper_connection import HyperConnection
    from tandem.models.moe import Router
    from tandem.trainer.parallel.sharded_params import local

    module_names = {id(m): n for n, m in model.named_modules()}
    fp32_seen: Dict[str, torch.Tensor] = {}
    stream_dtypes = set()

    def note_inputs(module, args):
        name = module_names.get(id(module))
        if name is None or not torch.is_grad_enabled():
            return
        if isinstance(module,
                      TransformerBlock) and name.startswith("layers.") and name != "layers.0":
            stream_dtypes.add(str(args[0].dtype))
        seen = {}
        if isinstance(module, GatedDeltaNet):
            _, a_log, dt_bias = module.computed_params()
            seen = {"A_exp": local(a_log).float().exp(), "dt_bias": local(dt_bias).float()}
        elif isinstance(module, HyperConnection):
            seen = {"hc_norm": local(module.hc_norm.weight).float()}
        elif isinstance(module, Router):
            seen = {"router": local(module.weight).float()}
        for key, value in seen.items():
            fp32_seen.setdefault(f"{name}.{key}", value.detach().clone())

    # torch.compile would trace the hook and guard on what it recorded (a recompile per new entry)
    compiled = "train.compile=true" in layout
    hook = None if compiled else torch.nn.modules.module.register_module_forward_hook(note_dtype)
    pre_hook = (
        None if compiled else torch.nn.modules.module.register_module_forward_pre_hook(note_inputs)
    )
    if compiled:
        # every case of a launch adds graphs of TransformerBlock.forward (new models, dtypes,
        # checkpointing modes); past dynamo's limit it would run the block eagerly without a word:
        # fail instead
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    if recorder is not None:
        recorder.active = True
    for step in range(STEPS):
        set_lr(tr.optimizer, lr_at(cfg.train, step))
        coefs = depth_coefficients(cfg.mtp, step)
        batches = rank_micro_batches(step, pstate.dp_rank, pstate.dp_size, accum,
                                     cfg.data.document_mask, cfg.data.seq_len)
        sums, counts, norm = tr(batches, coefs, step)  # the training loop's step
        norms.append(norm)
        # the step's logged auxiliary losses and load balance, the training loop's way
        logged.append({k: v for k, v in {**tr.apply(step), **tr.indexers.metrics()}.items()
                       if k in LOGGED_FIGURES})
        tr.optimizer.zero_grad(set_to_none=True)
        losses.append((sums / counts.clamp(min=1)).tolist())
    if hook is not None:
        hook.remove()
        pre_hook.remove()
    if recorder is not None:
        recorder.active = False
    params = {}
    # what this rank holds of each parameter (FSDP / TP / EP shards: fewer elements than the whole)
    local_numel = {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n,
                   p in model.named_parameters()}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(STEP_COUNTERS) or "rotary" in name:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        params[name] = full.detach().clone()
    return {"losses": losses, "grad_norms": norms, "params": params, "logged": logged,
            "linear_dtypes": sorted(linear_dtypes),
            "owner_dtypes": {k: sorted(v) for k, v in owner_dtypes.items()},
            "fp32_seen": fp32_seen, "stream_dtypes": sorted(stream_dtypes),
            "compiled": _compiled_blocks(model) if compiled else None,
            "local_numel": local_numel, "expert_path": tr.expert_path,
            "collectives": dict(recorder.calls) if recorder is not None else {}}


def _compiled_blocks(model) -> dict:
    """Evidence that training ran compiled: the blocks whose forward compile.py replaced, and the
    graphs dynamo holds for TransformerBlock.forward in this process."""
    from tandem.models.block import TransformerBlock
    from tandem.trainer.parallel.activation_checkpoint import checkpointed_blocks

    blocks = checkpointed_blocks(model)
    return {
        "blocks": len(blocks),
        "compiled_blocks": sum(getattr(b, "_tandem_compiled", False) for b in blocks),
        "graphs": len(
            torch._dynamo.eval_frame._debug_get_cache_entry_list(TransformerBlock.forward.__code__)
        ),
    }


ACCUM_CHECK = "accumulation:"
"""A layout named `accumulation:<layout>` runs `accumulated_gradients` instead of `run_layout`."""


def accumulated_gradients(layout: str) -> dict:
    """One step's gradients under `layout` (dp=2), accumulated over 4 micro-batches, beside each
    micro-batch's gradient computed alone (a step of one micro-batch, the same global target
    counts). Rank 1's micro-batches have no targets, so its gradients are exactly zero and every
    data-parallel sum, in any dtype, is exact: what remains is how the step accumulated its
    micro-batches."""
    from torch.distributed.tensor import DTensor

    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    micro = 4
    cfg = make_cfg(layout, micro)
    pstate = init_parallel(cfg, resolve_device("cpu"))
    model = build_model(cfg, pstate)
    tr = TrainStep(cfg, model, pstate)
    model.train()
    batches = rank_micro_batches(0, pstate.dp_rank, pstate.dp_size, micro)
    if pstate.dp_rank == 1:
        for b in batches:
            b["loss_mask"] = torch.zeros_like(b["loss_mask"])
    counts = tr.global_target_counts(batches)
    coefs = depth_coefficients(cfg.mtp, 0)

    def grads() -> Dict[str, torch.Tensor]:
        out = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
               for n, p in model.named_parameters() if p.grad is not None}
        tr.optimizer.zero_grad(set_to_none=True)
        return out

    singles = []
    for b in batches:
        tr.forward_backward([b], counts, coefs)
        singles.append(grads())
    tr.forward_backward(batches, counts, coefs)
    return {"singles": singles, "step": grads()}


def _rank_of_spawned(fn, out: str) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fn(rank, world, out)
    return 0


def spawn_ranks(fn, world: int, out: str) -> None:
    """Run `fn(rank, world, out)` on `world` ranks joined as one torch.distributed job (gloo;
    forked, tests/processes.py): for unit tests that need a small collective job without a worker
    module. A rank leaves as a rank of `tandem` does (`finish`); one that raises fails the call
    with its traceback."""
    proc = processes.run(("function", _rank_of_spawned, (fn, out)), world)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


def reuse_device_meshes() -> None:
    """One DeviceMesh, with its process groups, per mesh shape for the whole launch, as a run builds
    its mesh once. Without it every layout of a launch builds a mesh of its own: eight more gloo
    groups (12 threads and their sockets per rank) per layout, thousands of threads by the end of a
    shared launch. And a compiled block guards on the names of the process groups its collectives
    use, so a compiled case reuses the graphs an earlier case of the same shape compiled
    (test_compile_layout.py: the checkpointing modes share them) only if it gets the same groups.
    Replaces the `init_device_mesh` that trainer/parallel/layout.py calls; idempotent."""
    from tandem.trainer.parallel import layout

    build = layout.init_device_mesh
    if getattr(build, "reuses_meshes", False):
        return
    made = {}

    def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, **kwargs):
        key = (device_type, tuple(mesh_shape), tuple(mesh_dim_names or ()),
               tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = build(device_type, mesh_shape, mesh_dim_names=mesh_dim_names, **kwargs)
        return made[key]

    init_device_mesh.reuses_meshes = True
    layout.init_device_mesh = init_device_mesh


def process_group_count() -> int:
    """The process groups this rank has formed so far (each gloo group holds threads and
    sockets)."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def main(argv: List[str]) -> int:
    import torch.distributed as dist

    from tests.distributed.collectives import CollectiveRecorder

    out_dir, layouts = argv[0], argv[1:]
    torch.set_num_threads(1)
    reuse_device_meshes()
    for layout in layouts:
        start, groups = time.perf_counter(), process_group_count()
        # the recorder's wrappers keep Python state that torch.compile would guard on (a recompile
        # per call); compiled layouts are compared on losses and parameters only
        recorder = None if "train.compile=true" in layout else CollectiveRecorder().install()
        if layout.startswith(ACCUM_CHECK):
            result = accumulated_gradients(layout[len(ACCUM_CHECK):])
        else:
            result = run_layout(layout, recorder=recorder)
        if recorder is not None:
            recorder.uninstall()
        rank = dist.get_rank()
        result["seconds"] = time.perf_counter() - start  # what each layout costs the shared launch
        result["process_groups"] = (groups, process_group_count())  # before and after it ran
        torch.save(result, os.path.join(out_dir, f"{layout}.rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
