"""Size a recipe before launching it (`tandem train --check`): exact parameter counts and a per-rank
memory estimate, with the cost model's FLOPs per token (cost.py).

Parameters are counted from the model built on the meta device (no memory). Memory per rank for the
recipe's layout is an estimate:
- model states: fp32 parameter + fp32 gradient + two fp32 AdamW moments = 16 bytes per parameter
  this rank owns (with train.freeze_trunk only the MTP module's; the frozen trunk costs 2 or 4 bytes
  per parameter, train.frozen_dtype, and keeps no activations), summed over the parameters of the pp
  rank holding the most: routed experts split over ep and tp and FSDP-sharded over dp (under
  dp_mode=allreduce nothing is sharded over dp: every rank holds its tp / ep shards whole); the PLE
  n-gram table split by rows over the stage's dp x ep x tp ranks (trainer/parallel/tensor_hybrid.py,
  out of FSDP: never gathered); everything else split over tp and FSDP-sharded over dp x ep. The
  table is trained by the same dense AdamW as every other parameter, over those shards: every row's
  moments live (and are updated) every step;
- FSDP's gathered copies (compute dtype: bf16 under mixed precision): the rank's two largest layers
  (one gathered, the next prefetched; a PLE layer without its table) and the root pieces (embedding,
  head, final norm, MTP module, whose routed experts are units of their own), kept gathered through
  the step;
- FSDP's gradient buffers of the root group (embedding, head, final norm and the MTP module's own
  parameters: `root_grad_bytes`): their unsharded gradients (compute dtype) live from the head's
  backward, the first, to the group's reduce-scatter at the end of each micro-batch's backward,
  whose input (reduce dtype) is then added where it exceeds the activations it follows. A block's
  own buffers (one layer's) are left out. Pieces two pipeline stages of one rank share are FSDP
  units of their own (sharded like the rest in the states above), reduce-scattered once per step:
  each holds an unsharded fp32 gradient accumulator through the step (`piece_unit_grad_bytes`);
- with several micro-batches per step and `parallel.reshard_after_microbatch=false` (one gradient
  sync per step, in the last micro-batch's backward), `single_sync_bytes`: from the first backward
  to that sync every FSDP-managed parameter of the rank holds its unsharded fp32 gradient (in place
  of its sharded one: + 4 bytes x (unsharded - owned)) and its gathered copy (compute dtype; beyond
  the two layers above). Without a pipeline the copies stand between micro-batches, when the
  activations are freed (the next forward reshards them as it goes), so they count only where they
  exceed the activations; a pipeline stage holds them while other micro-batches' activations are in
  flight (counted in full). Under dp_mode=allreduce the gradients are whole either way and only the
  copies count. The default (a reduce-scatter and reshard after every micro-batch) adds nothing;
- the PLE lookup (`ple_lookup_bytes`), transient, one micro-batch: the hashed ids and their sort by
  owner, the rows exchanged both ways (fp32 looked up, sent in the compute dtype) and the tp gather
  of the rows (the backward adds the rows' gradients into the table's gradient in place: no dense
  copy);
- activations (in the compute dtype: bf16 under mixed precision, fp32 otherwise, whatever the
  device): about 34 * s * b * h / tp bytes per transformer layer per
  micro-batch in flight (Korthikanti et al. 2022, SDPA/flash attention, no s^2 term) plus, with
  hyper-connections, the four hc x H-wide tensors each of a block's two mixers keeps for backward
  (its input, the grouped norm's output, the sigmoid mixing weights and the weighted streams): 16 *
  hc * s * b * h / tp; times the micro-batches each pp rank's schedule holds, stage by stage
  (parallel/validate.py `activations_held`: pp - rank under 1F1B, every one under GPipe; under
  interleaved 1F1B the peak of its stages' running sum, more than pp on the first ranks); a rank
  computing losses adds its MTP depths (on the stages that run them) and the buffers of one chunk
  of logits (`head_chunk_bytes`: the
  logits and, in bf16, their fp32 softmax block), and under the fused head (the default at tp=1)
  each loss's fp32 [vocab x hidden] weight gradient and input gradient, held from its forward to its
  backward (`fused_head_bytes`). Gated DeltaNet's and QSA's own activations are taken as an
  attention layer's (not modelled separately). `train.activation_checkpointing=full` keeps each
  block's input instead (its residual streams: fp32 hc x H under hyper-connections, else s * b * h
  in the compute dtype; a tp shard under SP) plus one block's activations live during its
  recomputation; `selective` is estimated as no checkpointing (an upper bound);
- context parallelism (parallel.cp > 1): every per-token figure above (activations, the PLE lookup,
  the fused head's input gradients) over S/cp rows, parameters sharded over dp x cp like over dp,
  plus what the exchanges keep (gathered K/V, QSA selections, Gated DeltaNet's states, halos) and
  the per-rank FLOPs balance of both shardings: trainer/context_cost.py.

The byte formulas of these terms (the functions named above) are in trainer/estimate_bytes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

import torch

from tandem.models import TandemModel
from tandem.models.latent_attention import TP_REPLICATED

from .config import TandemConfig
from .context_cost import context_fields
from .cost import flops_by_kind, training_flops_per_token
from .estimate_bytes import (
    compute_bytes,
    frozen_bytes,
    fused_head_bytes,
    head_chunk_bytes,
    per_tp_rank,
    piece_unit_grad_bytes,
    ple_lookup_bytes,
    root_grad_bytes,
    single_sync_bytes,
)
from .parallel.pipeline_plan import PipelinePlan
from .parallel.validate import (
    activations_held,
    microbatch_sequences,
    microbatches_held,
    pipeline_microbatches,
)

GIB = 2**30


@dataclass
class Estimate:
    total_params: int
    """Every parameter of trunk + MTP (tied embeddings counted once)."""
    expert_params: int
    """Routed-expert parameters (sharded over ep)."""
    active_params_per_token: int
    """Parameters a token touches in a forward (top-k routed experts only, the embedding included,
    the PLE n-gram tables not: a token reads a few rows of them)."""
    mtp_params: int
    """Parameters of the MTP module."""
    states_gib_per_rank: float
    """Parameters, gradients and AdamW moments held by one rank."""
    activations_gib_per_rank: float
    """Peak activations of one rank's pipeline stage."""
    gathered_gib_per_rank: float = 0.0
    """FSDP's unsharded copies: the rank's two largest layers (one gathered, the next prefetched;
    their tp/ep shards) and the root group (embedding, head, MTP module), kept gathered through the
    step."""
    grad_buffers_gib_per_rank: float = 0.0
    """FSDP's unsharded gradients of the root group (compute dtype) through each backward and their
    reduce-scatter input at its end (`root_grad_bytes`), and the step's fp32 accumulators of pieces
    two pipeline stages of a rank share (`piece_unit_grad_bytes`)."""
    accumulation_gib_per_rank: float = 0.0
    """What the one-sync-per-step mode (parallel.reshard_after_microbatch=false) holds beyond the
    above: unsharded fp32 gradients and gathered parameters between micro-batches
    (`single_sync_bytes`); 0 in the default mode, which syncs and reshards every micro-batch."""
    single_sync_gib_per_rank: float = 0.0
    """What parallel.reshard_after_microbatch=false would hold beyond the default mode's figures
    (equal to accumulation_gib_per_rank when that mode is set; 0 with one micro-batch or no data
    parallelism)."""
    ple_table_params: int = 0
    """PLE n-gram table parameters (every PLE layer's), part of total_params."""
    ple_states_gib_per_rank: float = 0.0
    """The PLE tables' share of the states of the pp rank holding them."""
    ple_lookup_gib_per_rank: float = 0.0
    """The PLE lookup's transient buffers on the rank holding a table (`ple_lookup_bytes`, the
    largest table's), part of the total."""
    ple_exchange_bytes: float = 0.0
    """Bytes one rank sends for one PLE table's lookup per micro-batch, forward and backward (ids,
    rows, their gradients, the tp gather); the table itself never moves."""
    ple_shard: str = ""
    """How the table is split, e.g. `1/16 = dp 2 x ep 4 x tp 2`."""
    train_flops_per_token: float = 0.0
    """Model FLOPs per trained token (`training_flops_per_token`, what MFU divides by)."""
    flops_by_kind: Dict[str, float] = None
    """Forward FLOPs per token of one layer's mixer of each kind, the block's hyper-connections, PLE
    and the MLP/MoE."""
    context_gib_per_rank: float = 0.0
    """What context parallelism adds (trainer/context_cost.py): gathered keys and values, QSA's
    selections and streamed top-k, Gated DeltaNet's exchanged states and augmented values, halos."""
    context_parts: Dict[str, float] = None
    """`context_bytes` of the rank holding the most, by part (bytes; `sent`: per micro-batch)."""
    cp_balance: Dict[str, float] = None
    """Under cp > 1, the most expensive cp rank's training FLOPs over the mean, by sharding."""
    context_note: str = ""
    """The --check line for CP (context_cost.describe)."""

    @property
    def total_gib_per_rank(self) -> float:
        return (self.states_gib_per_rank + self.activations_gib_per_rank
                + self.gathered_gib_per_rank
                + self.ple_lookup_gib_per_rank + self.grad_buffers_gib_per_rank
                + self.accumulation_gib_per_rank
                + self.context_gib_per_rank)

    def summary(self) -> str:
        # under 0.1B parameters or 1 GiB: in M, and GiB to 0.01 or MiB (tiny read 0.003B, 0.0 GiB)
        gib = (lambda x: f"{x:.1f} GiB") if self.total_gib_per_rank >= 1 else _gib
        out = (f"params total={_count(self.total_params)} "
               f"active/token={_count(self.active_params_per_token)} "
               f"experts={_count(self.expert_params)} mtp={self.mtp_params / 1e6:.1f}M; "
               "per-rank memory "
               f"states={gib(self.states_gib_per_rank)} "
               f"activations={gib(self.activations_gib_per_rank)} "
               f"gathered={gib(self.gathered_gib_per_rank)} "
               f"grad_buffers={gib(self.grad_buffers_gib_per_rank)} "
               + (f"ple_lookup={gib(self.ple_lookup_gib_per_rank)} " if self.ple_table_params
                  else "")
               + (f"accumulation={gib(self.accumulation_gib_per_rank)} "
                  if self.accumulation_gib_per_rank else "")
               + (f"context={gib(self.context_gib_per_rank)} " if self.context_parts else "")
               + f"total={gib(self.total_gib_per_rank)}")
        if self.accumulation_gib_per_rank:
            out += ("\n  accumulation: unsharded fp32 gradients and gathered parameters held "
                    "between micro-batches "
                    "(parallel.reshard_after_microbatch=false: one gradient sync per step); the "
                    "default syncs and "
                    f"reshards every micro-batch and saves {_gib(self.accumulation_gib_per_rank)}")
        elif self.single_sync_gib_per_rank:
            out += ("\n  parallel.reshard_after_microbatch=false (one gradient sync per step "
                    "instead of one per "
                    f"micro-batch) would add {_gib(self.single_sync_gib_per_rank)} per rank")
        if self.ple_table_params:
            out += (f"\n  PLE n-gram table: {_count(self.ple_table_params)} params, sharded "
                    f"{self.ple_shard} "
                    f"(rows over the stage's ranks, out of FSDP, never gathered): per rank "
                    f"states={_gib(self.ple_states_gib_per_rank)} (fp32 param + grad + AdamW m, v: "
                    "dense AdamW "
                    "over the shards, every row every step) "
                    f"lookup={_gib(self.ple_lookup_gib_per_rank)} "
                    f"(ids, exchanged rows, the tp gather; one micro-batch) "
                    f"exchange={self.ple_exchange_bytes / 2**20:.1f} MiB sent per rank per "
                    "micro-batch "
                    "(forward + backward, all-to-alls over the stage's ranks and the tp gather); "
                    "counted in "
                    f"the figures above for the pp rank holding it")
        if self.context_parts:
            out += self.context_note
        if self.train_flops_per_token:
            kinds = " ".join(f"{k}={v / 1e6:.3g}M" for k, v in (self.flops_by_kind or {}).items())
            out += (f"\n  FLOPs/token: train={self.train_flops_per_token / 1e9:.4g} GFLOP (model "
                    "FLOPs, MFU's); "
                    f"forward per layer: {kinds}")
        return out


def _gib(x: float) -> str:
    return f"{x:.2f} GiB" if x >= 0.05 else f"{x * 1024:.2f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def _kind(name: str) -> str:
    if ".experts." in name:
        return "experts"
    if name.endswith("ple_embedding.ngram_embedding.weight"):
        return "ple_table"
    if any(f".{module}." in name for module in TP_REPLICATED):
        return "replicated"  # whole on every tp rank, sharded by FSDP like the rest
    return "dense"


def _zero() -> Dict[str, int]:
    return {"dense": 0, "experts": 0, "ple_table": 0, "replicated": 0}


@dataclass
class _Counts:
    """The model's parameters, counted on the meta device, by kind (`dense`, `experts`,
    `ple_table`, `replicated`)."""
    total: int = 0
    expert: int = 0
    mtp: int = 0
    ple_table: int = 0
    per_layer: Dict[int, Dict[str, int]] = field(default_factory=dict)
    """Each trunk layer's counts by kind."""
    pieces: Dict[str, Dict[str, int]] = field(default_factory=dict)
    """Each top-level piece's (embed_tokens, norm, lm_head, mtp) counts by kind."""


def count_params(cfg: TandemConfig) -> _Counts:
    with torch.device("meta"):
        model = TandemModel(cfg.model, cfg.mtp)
    out = _Counts()
    for name, param in model.named_parameters():  # named_parameters de-duplicates tied weights
        n, kind = param.numel(), _kind(name)
        out.total += n
        out.expert += n if kind == "experts" else 0
        out.ple_table += n if kind == "ple_table" else 0
        out.mtp += n if name.startswith("mtp.") else 0
        top = name.split(".")[0]
        counts = (out.per_layer.setdefault(int(name.split(".")[1]), _zero()) if top == "layers"
                  else out.pieces.setdefault(top, _zero()))
        counts[kind] += n
    # each holding rank keeps the head's own copy
    if cfg.model.tie_embeddings and cfg.parallel.pp > 1:
        out.pieces["lm_head"] = dict(out.pieces["embed_tokens"])
    out.pieces.setdefault("lm_head", _zero())
    return out


@dataclass
class _RankLayout:
    """What each pp rank holds: the trunk layers of its stages and the pieces they use (embedding,
    final norm, head, MTP module: PipelinePlan.stage_pieces; copies on several ranks each count)."""
    layers: List[List[int]]
    pieces: List[Set[str]]
    depths: List[int]
    """MTP depths run by the rank."""
    loss_depths: List[List[int]]
    """Depths (0: the trunk's) whose loss the rank computes."""
    unit_pieces: List[str]
    """Pieces that are FSDP units of their own (trainer/parallel/data.py PieceUnits: shared by two
    of a rank's stages, sharded and reduce-scattered once a step)."""
    stages: List[List[Tuple[int, int]]]
    """Each of the rank's stages, in order: (its trunk layers, its MTP depths)."""

    def microbatches_held(self, cfg: TandemConfig, rank: int) -> float:
        """Micro-batches of all of the rank's layers and depths it holds at its peak: its stages'
        running sum under the schedule (activations_held) over their total."""
        mine = [n + d for n, d in self.stages[rank]]
        if not sum(mine):
            return microbatches_held(cfg, rank)
        return activations_held(cfg, rank, mine) / sum(mine)


def _rank_layout(cfg: TandemConfig, counts: _Counts) -> _RankLayout:
    m, p, k = cfg.model, cfg.parallel, cfg.mtp.num_steps
    if p.pp <= 1:
        return _RankLayout([list(range(m.num_layers))], [set(counts.pieces)], [k],
                           [list(range(k + 1))], [], [[(m.num_layers, k)]])
    plan = PipelinePlan(cfg)
    stages = [plan.stages_of(r) for r in range(p.pp)]
    return _RankLayout(layers=[[i for s in mine for i in plan.split[s]] for mine in stages],
                       pieces=[{piece for s in mine for piece in plan.stage_pieces(s)}
                               for mine in stages],
                       depths=[sum(1 for s in mine for d in plan.stages[s].depths if d > 0)
                               for mine in stages],
                       loss_depths=[[d for s in mine for d in plan.stages[s].depths]
                                    for mine in stages],
                       unit_pieces=plan.shared_within_rank() if p.dp_mode == "fsdp" else [],
                       stages=[[(len(plan.split[s]), sum(1 for d in plan.stages[s].depths if d > 0))
                                for s in mine] for mine in stages])


def _states(cfg: TandemConfig, counts: _Counts, lay: _RankLayout,
            split: Dict[str, int]) -> Tuple[float, float]:
    """(GiB of the states of the pp rank holding the most, GiB of its PLE tables' share)."""

    def owned(c: Dict[str, int]) -> float:
        return sum(c[k] / split[k] for k in c)

    def rank_states(r: int) -> Tuple[float, float]:
        own = sum(owned(counts.per_layer[i]) for i in lay.layers[r])
        ple = sum(counts.per_layer[i]["ple_table"] for i in lay.layers[r]) / split["ple_table"]
        mtp_own = 0.0
        for piece in lay.pieces[r]:
            # shared by two stages or not: sharded like the rest
            got = owned(counts.pieces.get(piece, _zero()))
            own += got
            mtp_own += got if piece == "mtp" else 0.0
        if cfg.train.freeze_trunk:
            # frozen trunk: its parameters alone, in train.frozen_dtype; only the MTP module
            # (FSDP-sharded like the rest) has fp32 master + gradient + AdamW moments
            return (frozen_bytes(cfg) * max(own - mtp_own,
                                            0) + 16 * mtp_own) / GIB, frozen_bytes(cfg) * ple / GIB
        return 16 * own / GIB, 16 * ple / GIB

    per_rank = [rank_states(r) for r in range(cfg.parallel.pp)]
    return max(x[0] for x in per_rank), max(x[1] for x in per_rank)


def _activations(cfg: TandemConfig, lay: _RankLayout) -> float:
    """Peak activation GiB over the pp ranks: each rank's stages' layers and MTP depths over the
    micro-batches its schedule holds of each (`activations_held`), and a rank computing losses its
    logits chunk and fused-head buffers besides."""
    m, p = cfg.model, cfg.parallel
    act_bytes = compute_bytes(cfg)  # the compute dtype's: bf16 under mixed precision, else fp32
    # a cp rank keeps its own rows' activations
    tokens = cfg.data.seq_len * microbatch_sequences(cfg) // p.cp
    # Korthikanti et al.: 34 sbh bytes a layer, all split over tp under sequence parallelism;
    # without it the norms' and dropouts' 10 sbh stay whole on every tp rank
    shared = 34 / p.tp if p.sequence_parallel or p.tp == 1 else 10 + 24 / p.tp
    per_layer = shared * tokens * m.hidden_size * act_bytes / 2
    if m.hc_count > 1:  # each of a block's two hyper-connections keeps ~4 stream-wide tensors
        per_layer += 16 * m.hc_count * tokens * m.hidden_size / p.tp * act_bytes / 2
    kept, live = per_layer, 0.0
    if cfg.train.activation_checkpointing == "full":
        # a block keeps only its input (the residual streams: fp32 hyper-connection streams, else
        # the compute dtype; a tp shard of the rows under SP), and one block's activations live
        # while its recomputation and backward run
        width = 4 * m.hc_count if m.hc_count > 1 else act_bytes
        kept = tokens * m.hidden_size * width / (p.tp if p.sequence_parallel else 1)
        live = per_layer
    chunk = min(cfg.mtp.loss_chunk_tokens or 1 << 30, tokens)

    def units(layers: int, depths: int, stages: int) -> float:
        # a frozen trunk runs under no_grad: it keeps no activations for backward, about one
        # layer's live per rank
        return (1 / stages if cfg.train.freeze_trunk else layers) + depths

    def rank_bytes(r: int) -> float:
        # the schedule's micro-batches in flight, stage by stage (interleaved 1F1B and GPipe hold
        # more than pp; the estimate assumed 1F1B's, then interleaved chunks of equal size), and a
        # rank holding loss depths their logits buffers too (on the first rank as well, which held
        # only its micro-batches before)
        mine = lay.stages[r]
        held = kept * activations_held(cfg, r, [units(n, d, len(mine)) for n, d in mine]) + live
        if "lm_head" in lay.pieces[r]:
            held += head_chunk_bytes(cfg, chunk) + fused_head_bytes(cfg, lay.loss_depths[r],
                                                                    act_bytes)
        return held

    return max(rank_bytes(r) for r in range(len(lay.layers))) / GIB


def _ple_lookup(cfg: TandemConfig, counts: _Counts, lay: _RankLayout) -> Tuple[float, float]:
    """(GiB of the PLE lookup's buffers, bytes it sends) on a rank holding a table; (0, 0) without
    one."""
    holds = any(counts.per_layer[i]["ple_table"] for layers in lay.layers for i in layers)
    if not holds:
        return 0.0, 0.0
    need, sent = ple_lookup_bytes(cfg)
    return need / GIB, sent


def _gathered(cfg: TandemConfig, counts: _Counts, lay: _RankLayout) -> float:
    """GiB of FSDP's gathered copies: a rank's two largest layers and its root pieces."""
    p = cfg.parallel
    width = frozen_bytes(cfg) if cfg.train.freeze_trunk else compute_bytes(cfg)
    mtp_width = compute_bytes(cfg)

    def layer_bytes(i: int) -> float:
        c = counts.per_layer[i]
        # a PLE table is never gathered
        return width * per_tp_rank(c, p)

    gathered = 0.0
    for r in range(p.pp):
        sizes = sorted((layer_bytes(i) for i in lay.layers[r]), reverse=True)[:2]
        # a piece's routed experts (the MTP layer's) are FSDP units of their own, freed after
        # their forward, and split over ep: they were counted whole, once per ep rank
        roots = sum((mtp_width if x == "mtp" else width)
                    * per_tp_rank({k: n for k, n in counts.pieces.get(x, {}).items()
                                   if k != "experts"}, p)
                    for x in lay.pieces[r])
        gathered = max(gathered, (sum(sizes) + roots) / GIB)
    return gathered


def estimate(cfg: TandemConfig, world_size: int | None = None,
             counts: _Counts | None = None) -> Estimate:
    """The figures of `tandem launch slurm --check`; `counts` (a `count_params`) saves rebuilding
    the model on the meta device when only the layout changes (context_cost.cp_sweep)."""
    m, p = cfg.model, cfg.parallel
    counts = counts or count_params(cfg)
    # a token reads (n-gram heads) rows of a PLE table: the tables count as inactive, like unrouted
    # experts
    routed_share = m.top_k / m.num_experts if m.num_experts else 1.0
    active = counts.total - counts.expert - counts.ple_table + int(counts.expert * routed_share)
    lay = _rank_layout(cfg, counts)
    dp = p.dp or (max(world_size // (p.tp * p.pp * p.cp * p.ep), 1) if world_size else 1)
    # parameters are replicated over cp as over dp: FSDP shards them (and experts) over dp x cp
    dp *= p.cp
    batch = dp * p.ep
    # what one rank owns of each kind (dp here counts dp x cp): experts over ep x tp, FSDP over dp;
    # the PLE table by rows over the stage's dp x cp x ep x tp ranks; the rest over tp and FSDP over
    # dp x cp x ep
    split = {"experts": p.ep * p.tp * dp, "ple_table": p.tp * batch, "dense": p.tp * batch,
             "replicated": batch}
    if p.dp_mode == "allreduce":  # every batch rank holds whole parameters, gradients and moments
        split.update(experts=p.ep * p.tp, dense=p.tp, replicated=1)
    states, ple_states = _states(cfg, counts, lay, split)
    activations = _activations(cfg, lay)
    ple_lookup, ple_sent = _ple_lookup(cfg, counts, lay)
    fsdp = batch > 1 and p.dp_mode == "fsdp"
    gathered = _gathered(cfg, counts, lay) if fsdp and counts.per_layer else 0.0
    grad_buffers = 0.0
    if fsdp:
        grad_buffers = max(root_grad_bytes(cfg, counts.pieces, lay.pieces[r], lay.unit_pieces,
                                           activations * GIB)
                           + piece_unit_grad_bytes(cfg, counts.pieces, lay.pieces[r],
                                                   lay.unit_pieces)
                           for r in range(p.pp)) / GIB
    single_sync = 0.0
    if batch > 1 and counts.per_layer and pipeline_microbatches(cfg) > 1:
        single_sync = max(single_sync_bytes(cfg, counts.per_layer, counts.pieces, lay.layers[r],
                                            lay.pieces[r],
                                            lay.unit_pieces, dp,
                                            activations * GIB) for r in range(p.pp)) / GIB
    shards = [f"dp {dp // p.cp}"] + [f"{k} {n}" for k,
                                     n in (("cp", p.cp), ("ep", p.ep), ("tp", p.tp)) if n > 1]
    return Estimate(counts.total, counts.expert, active, counts.mtp, states, activations, gathered,
                    grad_buffers, 0.0 if p.reshard_after_microbatch else single_sync, single_sync,
                    ple_table_params=counts.ple_table, ple_states_gib_per_rank=ple_states,
                    ple_lookup_gib_per_rank=ple_lookup, ple_exchange_bytes=ple_sent,
                    ple_shard=f"1/{split['ple_table']} = " + " x ".join(shards),
                    # (MFU's: a frozen trunk's forward only, as the run counts it)
                    train_flops_per_token=training_flops_per_token(m, cfg.mtp, cfg.data.seq_len,
                                                                   cfg.train.freeze_trunk),
                    flops_by_kind=flops_by_kind(m, cfg.mtp, cfg.data.seq_len),
                    **context_fields(cfg, lay.layers, lay.depths,
                                     [lay.microbatches_held(cfg, r)
                                      for r in range(len(lay.layers))]))
