"""The device mesh and how a plain model becomes this rank's part of the layout: the trainer's two
entry points, `init_parallel` (process group, mesh and the typed `ParallelState`) and
`parallelize_model`.

Mesh dims (outer to inner) `pp x dp x cp x ep x tp`, in Megatron's terms:
* tp: tensor parallel (innermost, the fastest links), also the vocab split of embedding and head;
* ep: expert parallel, carved out of data parallelism: the batch is split over dp*ep ranks; routed
  experts are sharded over ep and replicated over dp (expert-data-parallel group = dp); every other
  parameter is replicated over dp*ep (Megatron's data-parallel group for dense parameters);
* cp: context parallelism: each sequence split over cp ranks reading the same samples (context.py);
  parameters are replicated over cp like over dp: FSDP shards over dp x cp x ep and sums gradients
  there, and routed experts are replicated over dp x cp (Megatron carves expert data parallelism out
  of dp x cp the same way). cp sits inside dp, next to the ep/tp ranks its chunk exchanges meet;
* dp: the remaining (expert-)data parallelism; pp: pipeline stages (outermost).
The loop's `dp_size`/`dp_rank`/`dp_group` describe the batch split, i.e. the flattened dp*ep mesh.

`apply_parallelism` runs, in order: pipeline pruning (PP), the PLE n-gram tables' row split over the
stage's dp x ep x tp ranks (tensor_hybrid.shard_ple_tables: never gathered, kept out of FSDP, their
gradients complete without a dp reduction), TP/EP (DTensor shards + dispatch), FSDP2 (fully_shard,
or replicate for `dp_mode=allreduce`; a piece two pipeline stages of one rank share is an FSDP unit
of its own, data.PieceUnits), then sets the state's optional pieces: `pipeline`, `gradient_finisher`
(gradient sync + true global norm), `mtp_copies_group` and, under sequence parallelism,
`whole_sequence_switch` (decoding runs the TP regions on whole sequences). Sequence parallelism (tp
> 1) keeps activations sharded along the sequence over tp between the TP regions (tensor.py); the
router loads are then summed over tp as well.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from typing import Callable, NoReturn, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import init_device_mesh

from ..config import TandemConfig
from ..config_checks import ConfigError
from .activation_checkpoint import apply_activation_checkpointing
from .compile import apply_compile
from .context import ContextShards
from .data import (
    REDUCE_DTYPES,
    PieceUnits,
    apply_fsdp,
    cast_kept_whole,
    fp32_parameters,
    fsdp_mixed_precision,
)
from .device import Device, frozen_dtype
from .gradients import GradientFinisher
from .pipeline import Pipeline, prune_model
from .sharded_params import replace_child
from .state import ParallelDegrees, ParallelState, WholeSequenceSwitch
from .tensor import apply_tensor_and_expert_parallel
from .tensor_hybrid import shard_ple_tables
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
    if cfg.train.compile:  # first: checkpointing then wraps the compiled forward
        apply_compile(model)
    if cfg.train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if state.world_size == 1:
        return model
    return apply_parallelism(model, cfg, state)


def build_parallel_state(cfg: TandemConfig, device: Device, world: int, dp: int) -> ParallelState:
    p = cfg.parallel
    if not dist.is_initialized():
        init_process_group(device.process_group_backend)
    mesh = init_device_mesh(device.type, (p.pp, dp, p.cp, p.ep, p.tp),
                            mesh_dim_names=("pp", "dp", "cp", "ep", "tp"))
    data_mesh = mesh["dp", "ep"]._flatten("dp_ep")  # ranks reading different samples
    batch = dp * p.ep
    degrees = ParallelDegrees(pp=p.pp, dp=dp, cp=p.cp, ep=p.ep, tp=p.tp,
                              sequence_parallel=bool(p.sequence_parallel and p.tp > 1))
    # the ranks holding the same parameters (FSDP's shard dimension), and those holding the same
    # experts
    batch_mesh = mesh["dp", "cp", "ep"]._flatten("dp_cp_ep") if p.cp > 1 else data_mesh
    expert_data_mesh = mesh["dp", "cp"]._flatten("dp_cp") if p.cp > 1 else mesh["dp"]
    # one pipeline stage's ranks (the PLE tables' row split; the router loads' group under SP)
    stage_mesh = mesh["dp", "cp", "ep",
                      "tp"]._flatten("dp_cp_ep_tp") if degrees.replicas * p.tp > 1 else None
    return ParallelState(
        device=device, world_size=world, rank=dist.get_rank(), degrees=degrees,
        dp_size=batch, dp_rank=data_mesh.get_local_rank(), dp_group=data_mesh.get_group(),
        mesh=mesh, batch_mesh=batch_mesh, expert_data_mesh=expert_data_mesh, stage_mesh=stage_mesh,
        # Router loads are summed over the ranks that routed different tokens: the batch split and
        # cp, and under sequence parallelism also the tp ranks (each routes its sequence shard).
        router_load_group=_router_load_group(mesh, batch_mesh, stage_mesh, degrees.replicas,
                                             degrees.sequence_parallel),
        context_group=mesh["cp"].get_group() if p.cp > 1 else None)


def init_process_group(backend: str) -> None:
    """`dist.init_process_group` from the launcher's environment, with restart attempts kept apart.

    torchrun's c10d rendezvous shares its TCPStore with the workers (TORCHELASTIC_USE_AGENT_STORE)
    and torch (2.13) keeps every restart attempt's keys in it unprefixed (pytorch/pytorch#135712,
    #167288): a worker restarted after a rank died can read the dead attempt's peer addresses and
    fail in gloo's connectFullMesh ("Connection refused") or wait forever on a stale key. Under an
    agent store the process group therefore gets its own key prefix per attempt
    (TORCHELASTIC_RESTART_COUNT, which every worker of a restarted group shares)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend)
        return
    world = int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                is_master=False, timeout=default_pg_timeout)
    dist.init_process_group(backend=backend,
                            store=dist.PrefixStore(f"tandem/attempt_{attempt}", agent_store),
                            rank=int(os.environ["RANK"]), world_size=world)


T = TypeVar("T")


def decided_on_rank0(compute: Callable[[], T]) -> T:
    """`compute()` run on global rank 0 only, its result (a picklable value) returned on every rank
    of the launch, or its error (a ValueError, ConfigError included, or an OSError such as
    FileNotFoundError) raised on every rank: on rank 0 as raised, elsewhere as a ConfigError with
    its message. In one process, `compute()`.

    For what the ranks must agree on but each would find on a shared file system for itself, where
    another process (or this launch's rank 0) may change it meanwhile: a run directory's newest
    checkpoint, which moves on while that run trains; whether run.dir holds an earlier run, whose
    files rank 0 writes as soon as it starts. The ranks also leave together on a refusal, instead
    of waiting in their next collective for the one that left."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return compute()
    box, error = [None, None], None
    if dist.get_rank() == 0:
        try:
            box[0] = compute()
        except (ValueError, OSError) as exc:
            box[1], error = str(exc), exc
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        raise ConfigError(box[1])
    return box[0]


def leave_distributed_process(code: int) -> NoReturn:
    """End a rank's process after its command returned `code`: destroy the process group, run the
    exit handlers (wandb, logging), flush, and exit without the interpreter's finalisation.

    Finalisation is not safe after gloo collectives (torch 2.13, pytorch/pytorch#190489): a gloo
    worker thread can still hold the last reference to a finished collective's tensors when the
    main thread, released by that collective, reaches finalisation; dropping them then takes the
    GIL from a finalising interpreter and the process aborts ("terminate called without an active
    exception", SIGABRT), so torchrun fails a run whose results are written. destroy_process_group
    does not stop these threads: torch's DTensor caches keep the meshes, and so the groups, alive
    until finalisation (docs/parallelism.md, "How a rank exits")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    exit_without_finalisation(code)


def exit_without_finalisation(code: int) -> NoReturn:
    """Run the exit handlers (wandb, logging), flush, and exit with `code` without the
    interpreter's finalisation (see `leave_distributed_process`)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a closed stream: exit all the same
            pass
    os._exit(code)


def run_as_process(main: Callable[[], Optional[int]]) -> int:
    """`main()` as this process's entry point (`tandem`, the bench and test workers): its exit
    code. A rank of a multi-process launch (WORLD_SIZE > 1) does not return: it leaves through
    `leave_distributed_process` with that code, or with an exception's (its traceback printed, 1;
    a SystemExit's own code), so a failing rank is not aborted in finalisation either. A single
    process returns the code and lets exceptions propagate, as Python's entry points do."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return main() or 0
    leave_distributed_process(exit_code_of(main))


def exit_code_of(main: Callable[[], Optional[int]]) -> int:
    """The code the interpreter would exit with after `main()`: its return value (None: 0), a
    SystemExit's code (a message printed, 1), or 1 with the traceback printed."""
    try:
        return main() or 0
    except SystemExit as exc:  # sys.exit(...) / parser.exit(...): the code Python would exit with
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:  # noqa: BLE001 - the traceback is the report, as the interpreter prints it
        traceback.print_exc()
        return 1


def _router_load_group(mesh, batch_mesh, stage_mesh, batch: int, sp: bool):
    if sp:
        return mesh["tp"].get_group() if batch == 1 else stage_mesh.get_group()
    return batch_mesh.get_group() if batch > 1 else None


def apply_parallelism(model: nn.Module, cfg: TandemConfig, state: ParallelState) -> nn.Module:
    """This rank's part of `model` under the layout `state` describes (the module docstring's
    order); sets the state's pipeline, gradient finisher and groups."""
    deg = state.degrees
    compute_dtype = state.device.autocast_dtype(cfg.train.dtype)  # None: fp32
    if state.sequence_parallel or deg.cp > 1:  # sequences split in training, whole in evaluation
        state.whole_sequence_switch = WholeSequenceSwitch()
    # each rank computes its chunks of every window (before the pipeline reads the model)
    if deg.cp > 1:
        replace_child(model, model.context,
                      ContextShards(state.context_group, cfg.parallel.cp_sharding,
                                                          state.whole_sequence_switch))
    if state.pp_enabled:
        prune_model(model, cfg, state.mesh["pp"].get_local_rank())
    tables, sp_partial = _apply_tensor_parallel(model, cfg, state, compute_dtype)
    # pieces two stages of one rank use: FSDP units of their own (sharded over dp*ep like the rest,
    # gathered through the step, reduce-scattered once), or under the all-reduce mode kept whole
    # (summed over dp*ep by the finisher)
    own_units = deg.replicas > 1 and cfg.parallel.dp_mode == "fsdp"
    pipeline = None
    if state.pp_enabled:
        pipeline = Pipeline(model, cfg, state.mesh["pp"], state.device.device,
                            piece_units=own_units)
    shared_in_rank = pipeline.plan.shared_within_rank() if pipeline is not None else []
    units = {x: getattr(model, x) for x in shared_in_rank if own_units and getattr(model,
                                                                                   x) is not None}
    whole = [] if own_units else shared_in_rank
    whole_params = {name: q for name,
                    q in model.named_parameters() if name.split(".", 1)[0] in whole}
    mp_policy = None
    if deg.replicas > 1:
        mp_policy = _apply_data_parallel(model, cfg, state, pipeline, units, whole_params, tables,
                                         compute_dtype)
    piece_units = PieceUnits(units) if units else None
    shared = {}
    if pipeline is not None:
        pipeline.piece_units = piece_units
        shared = _build_pipeline(model, cfg, state, pipeline, mp_policy, compute_dtype)
    tp_group = state.mesh["tp"].get_group() if sp_partial else None
    state.gradient_finisher = GradientFinisher(
        model, state.world_size, deg.pp,
        batch_group=state.batch_mesh.get_group(), batch_size=deg.replicas,
        dp_group=state.expert_data_mesh.get_group(), dp_size=deg.dp * deg.cp,
        shared=shared, replicated_names=set(whole_params), sp_partial_names=sp_partial,
        tp_group=tp_group, device=state.device.device, piece_units=piece_units,
        reduce_dtype=REDUCE_DTYPES[cfg.train.grad_reduce_dtype] if compute_dtype is not None
        else torch.float32)
    # shared pieces' sums start as soon as this rank's stages using them are done
    if pipeline is not None:
        pipeline.finisher = state.gradient_finisher
    return model


def _apply_tensor_parallel(model: nn.Module, cfg: TandemConfig, state: ParallelState,
                           compute_dtype):
    """The PLE tables' row split over the stage's ranks, then TP/SP/EP: (the tables' parameter
    names, the parameters whose gradients are partial over tp under SP)."""
    deg, mesh = state.degrees, state.mesh
    tables = []
    if state.stage_mesh is not None:
        # rows travel in the dtype FSDP's policy would have gathered the table in
        tables = shard_ple_tables(model, state.stage_mesh,
                                  compute_dtype if deg.replicas > 1 else None)
    # decoding runs the TP regions on whole sequences (the evaluator flips the switch set up with
    # CP)
    switch = state.whole_sequence_switch if state.sequence_parallel else None
    tp_mesh = mesh["tp"] if state.tp_enabled else None
    ep_mesh = mesh["ep"] if state.ep_enabled else None
    expert_mesh = ep_mesh if ep_mesh is not None else tp_mesh
    if ep_mesh is not None and tp_mesh is not None:
        expert_mesh = mesh["ep", "tp"]
    sp_partial = apply_tensor_and_expert_parallel(model, tp_mesh, ep_mesh, expert_mesh,
                                                  state.sequence_parallel,
                                                  switch, cfg.parallel.ep_dispatch)
    return tables, sp_partial


def _apply_data_parallel(model, cfg, state, pipeline, units, whole_params, tables, compute_dtype):
    """FSDP2 (or replicate) over the dp x ep batch ranks; `whole_params` (pieces kept out of FSDP)
    gains what must stay fp32. Returns the mixed-precision policy (None in fp32)."""
    p = cfg.parallel
    cast_params = list(whole_params.values())
    if compute_dtype is not None:
        # what the recurrence and the stream mixing read stays fp32 under the bf16 policy: kept
        # whole (summed over dp x ep by the finisher like the whole pieces), never cast
        # (data.fp32_parameters)
        fp32 = fp32_parameters(model)
        cast_params = [q for n, q in whole_params.items() if n not in fp32]
        whole_params.update(fp32)
    blocks = list(model.layers.values())
    roots = pipeline.modules if pipeline is not None else [model]
    mp_policy, wire_dtype = fsdp_mixed_precision(compute_dtype, cfg.train.grad_reduce_dtype,
                                                 p.reshard_after_microbatch)
    keep_whole = set(whole_params.values()) | {q for n,
                                               q in model.named_parameters() if n in tables}
    apply_fsdp(blocks, roots, [model] + list(roots), state.batch_mesh, state.expert_data_mesh,
               mp_policy,
               keep_whole=keep_whole, replicated=p.dp_mode == "allreduce", wire_dtype=wire_dtype,
               units=units.values(),
               # a unit sums a whole step before its one reduce-scatter: the one-sync precision
               unit_precision=fsdp_mixed_precision(compute_dtype, cfg.train.grad_reduce_dtype,
                                                   False))
    if mp_policy is not None:  # the whole pieces compute in the policy's dtype too
        cast_kept_whole(model, cast_params, mp_policy.param_dtype)
    return mp_policy


def _build_pipeline(model, cfg, state, pipeline, mp_policy, compute_dtype) -> dict:
    """The schedule, and the groups summing the gradients of pieces several pp ranks hold: {piece:
    (group, copies)}."""
    # copies of the embedding / norm / head / MTP module on several pp ranks: sum their gradients
    shared = _shared_piece_groups(state.mesh, state.degrees.pp, pipeline.plan.holders())
    if "mtp" in shared:  # the loop sums the MTP routers' loads over the copies too
        state.mtp_copies_group = shared["mtp"][0]
    # the residual stream between stages: fp32 for hyper-connection streams on every layout (they
    # mix and inject in fp32, as one process's autocast leaves them); a plain residual takes the
    # gathered parameters' dtype under FSDP's policy, else fp32 (autocast leaves the embedding and
    # residual adds in fp32). See data.py's docstring.
    plain_bf16 = mp_policy is not None and cfg.model.hc_count == 1
    boundary = mp_policy.param_dtype if plain_bf16 else torch.float32
    if cfg.train.freeze_trunk and cfg.model.hc_count == 1:
        # a frozen trunk's weights are kept in train.frozen_dtype, and its plain residual stream
        # with them: fp32 at the boundary crashed the next stage (train.dtype=fp32, frozen bf16) or
        # left one process's bf16 stream (bf16 training)
        boundary = frozen_dtype(cfg, state.device)
    pipeline.build_schedule(compute_dtype, boundary)
    state.pipeline = pipeline
    return shared


def _shared_piece_groups(mesh, pp: int, holders) -> dict:
    """piece -> (process group of the pp ranks holding it with this rank's dp/ep/tp coordinates,
    number of copies), for the pieces held by more than one pp rank. Every rank creates every group
    in the same order (dist.new_group is collective); groups are reused across pieces with the same
    holders."""
    ranks = mesh.mesh.reshape(pp, -1)  # [pp, dp*ep*tp] global ranks
    me = dist.get_rank()
    made, out = {}, {}
    for piece in ("embed_tokens", "norm", "lm_head", "mtp"):
        members = tuple(holders[piece])
        if len(members) < 2:
            continue
        if members not in made:
            # a group of its own even when every pp rank holds the piece, never the pipeline's: the
            # sums start while the schedule's sends and receives still run, and one NCCL
            # communicator runs its operations in issue order (rank 1's early sum would wait behind
            # rank 0's sends)
            mine = None
            for col in range(ranks.shape[1]):
                group_ranks = [int(ranks[r, col]) for r in members]
                group = dist.new_group(group_ranks)
                if me in group_ranks:
                    mine = group
            made[members] = mine
        if made[members] is not None:
            out[piece] = (made[members], len(members))
    return out
