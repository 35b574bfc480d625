"""Pipeline parallelism with torch.distributed.pipelining.

The trunk's layers are split over `pp * virtual` stages (evenly, or by `parallel.pp_layout`); stage
s lives on pp rank s % pp (so the interleaved schedule gets `virtual` chunks per rank). The model on
each rank is pruned in place to what its stages hold, keeping the single-process parameter names
(`layers.<global index>`), so DCP checkpoints stay portable between layouts.

Which stage holds what is `pipeline_plan.PipelinePlan`: trunk layers per stage, and the loss depths
(the trunk's head, MTP step k with its head) on the last stage by default or spread over the stages
after the trunk (`parallel.pp_depth_stages`, `parallel.pp_balance`). A stage holding depths also
holds the output head, the final norm (where a depth reads it), the MTP module and a copy of the
token embedding (the MTP steps embed tokens t+k). Copies on several pp ranks start identical (the
same seeded init or checkpoint slice) and stay identical because their gradients are summed over the
ranks holding them (Megatron's shared-embedding all-reduce, generalised); they are saved under the
same keys: identical replicas, deduplicated by DCP. Those sums run in flat buckets
(GradientFinisher), started per unit of pieces with the same holders as soon as this rank's stages
using them finished the step's backward (each stage reports its REDUCE_GRAD, `_notifying`), so they
overlap the backward still to run on the rank's other stages; the optimizer step waits for them.
They sum FSDP shards: a piece in a stage's FSDP root is reduce-scattered with that root; a piece two
stages of this rank use (the interleaved schedule's first stage and an MTP stage both embed tokens,
two depth stages share the head and MTP module) is registered in neither root but is an FSDP unit of
its own (data.PieceUnits): gathered before the step's first forward, its gradient accumulated in
fp32 after each backward of a stage using it, and reduce-scattered once, right before its pp sum
starts.

Qwen4-Exp (hyper-connections, PLE): the state between blocks is the `hc_count` residual streams
[B, S, hc_count * H], so every boundary (trunk stages, the MTP chain after the trunk, h_0 beside it)
carries that width; the first stage repeats the embedding into the streams (`embed_streams`, as
`TandemModel.trunk` does). A block with PLE hashes the token ids: every stage already receives the
micro-batch's tokens as a kwarg, so a stage of any layer kinds (only Gated DeltaNet, only QSA, PLE
or not) runs its blocks exactly as the one-process trunk does. QSA's indexer KL rides on its layer's
output (AuxLossGrad) inside the stage's graph, like the MoE's balance loss.

A stage holding depths computes their per-depth loss sums (`model.losses_from_hidden`, continuing
the MTP chain from the hidden state it received). The last stage returns its combined share of the
loss and the schedule backpropagates it unscaled (`scale_grads=False`: the loss is already
normalised by the global target count); an earlier stage attaches its share to an output with
`AuxLossGrad` (the MoE's device for its auxiliary losses, at gradient scale 1), so it is
differentiated when that output's gradient comes back. Every stage receives the micro-batch's tokens
/ loss mask / doc ids as kwargs.

Precision: every stage's forward runs under the loop's autocast (bf16 compute), and stages exchange
the residual stream in one dtype: fp32 under autocast alone (the embedding and the residual adds
stay fp32), bf16 when FSDP's mixed-precision policy hands the stages bf16 parameters.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from tandem.models.block import block_kwargs
from tandem.models.model import window_documents, window_positions
from tandem.models.moe import AuxLossGrad
from tandem.models.qsa_index import QSASelection
from tandem.trainer.loss import combine_losses, loss_gradient

from .device import autocast_context
from .pipeline_plan import PipelinePlan, StagePlan
from .validate import pipeline_microbatches


def embed_streams(model: nn.Module, tokens_bs: torch.Tensor) -> torch.Tensor:
    """The first stage's input to the trunk blocks: the token embedding, repeated into the
    `hc_count` residual streams under hyper-connections ([B, S, hc_count * H]), as
    `TandemModel.trunk` starts."""
    h = model.embed_tokens(tokens_bs)
    hc = model.cfg.hc_count
    return h.repeat(1, 1, hc) if hc > 1 else h


def run_block(block: nn.Module, h: torch.Tensor, positions_bs: torch.Tensor,
              tokens_bs: torch.Tensor, cache=None, documents=None, context=None,
              aux_grad_scale: float = 1.0, qsa_dense: bool = False, counted=None):
    """One trunk block as `TandemModel.trunk` calls it: the token ids only for a block with PLE;
    `context` only when the window is split over context-parallel ranks."""
    extra = block_kwargs(documents, context, aux_grad_scale, qsa_dense, counted)
    return block(h, positions_bs, cache,
                 tokens_bs if getattr(block, "ple", None) is not None else None, **extra)


def boundary_width(model_cfg) -> int:
    """Channels of the hidden state crossing a stage boundary: every residual stream."""
    return model_cfg.hidden_size * model_cfg.hc_count


class _StepContext:
    autocast: tuple = ("cpu", None)
    """(device type, autocast dtype or None for fp32) of every stage forward."""
    act_dtype: torch.dtype = torch.float32
    """dtype of the tensors between stages."""
    counts: Optional[torch.Tensor] = None
    coefs: Optional[List[float]] = None
    grad_scales: Optional[torch.Tensor] = None
    """d total / d loss_sums[depth] of the step (TandemModel.forward's `loss_grad_scales`)."""
    aux_grad_scale: float = 1.0
    """The gradient of each micro-batch's auxiliary losses (TandemModel.forward's)."""
    qsa_dense: bool = False
    """QSA's dense warm-up stage (TandemModel.forward's)."""
    sums: Optional[torch.Tensor] = None
    document_mask: bool = False
    """data.document_mask: the stages keep packed documents apart."""
    cfg = None
    """The run's config (the selection tensors' shapes)."""


class StageModule(nn.Module):
    """One pipeline stage: (embedding) -> its trunk layers -> the losses of the depths it holds.

    Inputs: the token ids (first stage) or the hidden state from the stage before -- the trunk's
    residual stream, or after the trunk the MTP chain's state -- plus h_0 when the plan sends it
    separately. Outputs: the same for the next stage, or the combined loss on the last stage."""

    def __init__(self, model: nn.Module, plan: StagePlan, pieces: List[str], last: bool,
                 ctx: _StepContext):
        super().__init__()
        self.plan, self.first, self.last = plan, plan.index == 0, last
        self.blocks = nn.ModuleList([model.layers[str(i)] for i in plan.layers])
        # the shared pieces it uses, registered so that this stage's FSDP root covers them (not
        # those that are FSDP units of their own: another stage of this rank uses them too,
        # `Pipeline`)
        self.pieces = nn.ModuleDict({piece: getattr(model, piece) for piece in pieces})
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_ctx", ctx)
        # A frozen trunk (MTP fine-tuning) runs under no_grad on every stage: no activations kept,
        # and no activation gradients sent back (the received activation's gradient stays None).
        self.trunk_frozen = model.trunk_frozen()

    def _depth_index(self, device: torch.device) -> torch.Tensor:
        """This stage's depths as an index tensor, made once (not a host-to-device copy per
        micro-batch)."""
        if getattr(self, "_depth_idx", None) is None or self._depth_idx.device != device:
            self._depth_idx = torch.tensor(self.plan.depths, device=device)
        return self._depth_idx

    def forward(self, x, *received, tokens, loss_mask, doc_ids, padding=None):
        """`received`: h_0 (when `plan.recv_h0`), then depth 1's QSA selection as its tensors (when
        `plan.recv_selection`). `padding`: TandemModel.forward's `padding_bs`."""
        h0 = received[0] if self.plan.recv_h0 else None
        selection = received[1 if self.plan.recv_h0 else 0:] if self.plan.recv_selection else ()
        with autocast_context(*self._ctx.autocast):
            return self._forward(x, h0, tokens, loss_mask, doc_ids, selection, padding)

    def _forward(self, x, h0, tokens, loss_mask, doc_ids, selection_in=(), padding=None):
        plan = self.plan
        b, s = tokens.shape[0], tokens.shape[1] - 1
        documents = window_documents(doc_ids, s) if self._ctx.document_mask else None
        # this rank's rows of the window (all but under context parallelism)
        context = self._model.context
        positions = context.local(window_positions(documents, b, s, tokens.device))
        documents = documents.local(context) if documents is not None else None
        counted = self._model.counted_rows(tokens, padding)
        with torch.no_grad() if self.trunk_frozen else nullcontext():
            h = embed_streams(self._model, x) if self.first else x
            for block in self.blocks:
                h = run_block(block, h, positions, context.local(tokens[:, :s]),
                              documents=documents, context=context,
                              aux_grad_scale=self._ctx.aux_grad_scale,
                              qsa_dense=self._ctx.qsa_dense and not self.trunk_frozen,
                              counted=counted)  # a frozen trunk runs sparse, as it is served
        loss = None
        # depth 1's QSA selection for the MTP depths here (none in the dense warm-up: nothing
        # selected)
        mtp_here = any(d > 0 for d in plan.depths)
        selection = None
        if selection_in and mtp_here and not self._ctx.qsa_dense:
            selection = QSASelection(*selection_in)
        if plan.depths:
            if plan.chain_in == 0:
                h0 = h
            out = self._model.losses_from_hidden(h0, tokens, loss_mask, doc_ids, positions,
                                                 plan.depths,
                                                 h_chain=h, chain_depth=plan.chain_in,
                                                 documents=documents,
                                                 selection=selection,
                                                 loss_grad_scales=self._ctx.grad_scales,
                                                 aux_grad_scale=self._ctx.aux_grad_scale,
                                                 qsa_dense=self._ctx.qsa_dense,
                                                 counted=counted)
            selection = out.selection if mtp_here else None
            idx = self._depth_index(out.loss_sums.device)
            self._ctx.sums.index_add_(0, idx, out.loss_sums.detach().float())
            loss = combine_losses(out.loss_sums, self._ctx.counts[idx],
                                  [self._ctx.coefs[d] for d in plan.depths])
            h = out.chain
        if self.last:
            return loss
        outputs = [h] + ([h0] if plan.send_h0 else [])
        # the dtype the next stage's buffers expect
        outputs = [o.to(self._ctx.act_dtype) for o in outputs]
        if plan.send_selection:
            outputs += self._selection_tensors(selection, selection_in, b)
        if loss is not None and loss.requires_grad:
            i = next((i for i, o in enumerate(outputs) if o.requires_grad), None)
            if i is None:
                raise RuntimeError(f"pipeline stage {plan.index}: its loss needs a gradient but "
                                   "none of its outputs "
                                   "does")
            outputs[i] = AuxLossGrad.apply(outputs[i], loss, 1.0)
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    def _selection_tensors(self, selection, received, b: int) -> List[torch.Tensor]:
        """What this stage sends on of depth 1's QSA selection: the one its MTP depths left, else
        the one it received (it runs no MTP depth, or the dense warm-up selected nothing), else
        zeros (the dense warm-up on depth 1's stage: the receiving stage knows the warm-up and
        ignores them)."""
        if selection is not None:  # (top-k indices come out strided; a send needs them contiguous)
            parts = [selection.blocks_bsk, selection.counts_bs]
            parts += [selection.block_rows_bn] if self._ctx.document_mask else []
            return [p.contiguous() for p in parts]
        if received:
            return list(received)
        return [torch.zeros(shape, dtype=torch.long, device=self._ctx.sums.device)
                for shape in selection_shapes(self._ctx.cfg, b)]


def selection_shapes(cfg, micro_batch: int) -> List[tuple]:
    """Shapes of the long tensors carrying MTP depth 1's QSA selection across a stage boundary: its
    blocks [B, S, k], their counts [B, S] and, with packed documents, each block's first row [B, S /
    r]. The whole window's (the QSA mixer selects over the gathered sequence under SP), or under
    context parallelism this rank's queries (S / cp) over the window's blocks."""
    m, s = cfg.model, cfg.data.seq_len
    n = s // m.indexer_compress_ratio
    queries = s // cfg.parallel.cp
    shapes = [(micro_batch, queries, min(m.indexer_budget // m.indexer_compress_ratio, n)),
              (micro_batch, queries)]
    return shapes + ([(micro_batch, n)] if cfg.data.document_mask else [])


def plan_stages(cfg, pp_rank: int):
    """(stage indices of this rank, the pipeline plan)."""
    plan = PipelinePlan(cfg)
    return plan.stages_of(pp_rank), plan


def prune_model(model: nn.Module, cfg, pp_rank: int) -> None:
    """Drop what this pp rank's stages do not hold (names of the rest are unchanged)."""
    mine, plan = plan_stages(cfg, pp_rank)
    keep = {i for s in mine for i in plan.split[s]}
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    holders = plan.holders()
    for piece in ("embed_tokens", "norm", "lm_head", "mtp"):
        if pp_rank not in holders[piece]:
            setattr(model, piece, None)


def _shared_piece_units(model: nn.Module, plan, mine) -> List[tuple]:
    """The shared pieces this rank holds, in units of the same holder ranks (one pp group each), as
    (pieces, this rank's stages using them), in one order on every rank: a unit's gradient sums
    start once this rank's stages using it are done (`Pipeline._stage_done`) and every unit before
    it started, so the groups' buckets are issued in the same order everywhere."""
    holders, units = plan.holders(), []
    for piece in ("embed_tokens", "norm", "lm_head", "mtp"):
        if getattr(model, piece, None) is None:
            continue
        unit = next((u for u in units if holders[u[0][0]] == holders[piece]), None)
        if unit is None:
            units.append(([piece], set()))
        else:
            unit[0].append(piece)
    for pieces, stages in units:
        stages.update(s for s in mine if set(pieces) & set(plan.stage_pieces(s)))
    return units


def pipeline_stage_class(reshard_after_microbatch: bool):
    """The PipelineStage class for `parallel.reshard_after_microbatch`. torch's stage turns FSDP's
    gradient sync and resharding off for every micro-batch's backward and syncs once, in the
    schedule's REDUCE_GRAD after the last; with reshard_after_microbatch its full backward leaves
    them on, so every micro-batch reduce-scatters and reshards as `TrainStep.forward_backward` does
    without a pipeline (REDUCE_GRAD then finds nothing left to reduce)."""
    from torch.distributed.pipelining import PipelineStage  # see `Pipeline.__init__`
    from torch.distributed.pipelining._backward import stage_backward

    if not reshard_after_microbatch:
        return PipelineStage
    # torch's own full backward, without the no-sync switches around it (a private helper: the
    # pipeline equivalence tests run both modes)

    class ReshardingPipelineStage(PipelineStage):
        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            if backward_type != "full":  # split input/weight backward (zero-bubble schedules)
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                   bwd_kwargs["input_values"])
            return grads, None

    return ReshardingPipelineStage


class Pipeline:
    """`ParallelState.pipeline`: runs one step's micro-batches through the schedule on this rank."""

    def __init__(self, model: nn.Module, cfg, pp_mesh, device: torch.device,
                 piece_units: bool = False):
        """`piece_units`: the pieces two stages of this rank share
        (`PipelinePlan.shared_within_rank`) are FSDP units of their own (data.PieceUnits, set as
        `self.piece_units` once sharded), so no stage module registers them."""
        # imported here, not at the top: torch's pipelining imports dynamo (0.6 s in every process
        # that imports the trainer, on one core), which only a pipelined run needs
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        p = cfg.parallel
        self.context = model.context  # this rank's rows of each window (context parallelism)
        self.ctx = _StepContext()
        self.ctx.document_mask = bool(cfg.data.document_mask)
        self.ctx.cfg = cfg
        self.pp_group = pp_mesh.get_group()
        self.pp = p.pp
        pp_rank = pp_mesh.get_local_rank()
        mine, plan = plan_stages(cfg, pp_rank)
        n_stages = plan.n_stages
        self.n_micro = pipeline_microbatches(cfg)
        self.num_depths = 1 + cfg.mtp.num_steps
        self.micro_size = cfg.train.micro_batch_size * cfg.train.grad_accum_steps // self.n_micro
        # stage boundaries carry [micro-batch, sequence (shard under SP), hc_count * hidden]
        # activations
        sp_tp = p.tp if (p.sequence_parallel and p.tp > 1) else 1
        # (this rank's rows of the window under context parallelism)
        self.seq_len, self.hidden = cfg.data.seq_len // (sp_tp * p.cp), boundary_width(cfg.model)
        self.act_dtype = torch.float32  # build_schedule sets the run's
        self.device = device
        self.plan = plan
        own = set(plan.shared_within_rank()) if piece_units else set()
        # this rank's stages -> the pieces of their own each uses (gradients accumulated after its
        # backward)
        self._stage_units = {s: [x for x in plan.stage_pieces(s) if x in own] for s in mine}
        self.modules = [StageModule(model, plan.stages[s],
                                    [x for x in plan.stage_pieces(s) if x not in own],
                                    s == n_stages - 1, self.ctx) for s in mine]
        self.piece_units = None
        """data.PieceUnits of the pieces above (layout.py sets it after FSDP)."""
        self.has_first, self.has_last = 0 in mine, (n_stages - 1) in mine
        self._mine, self._n_stages = mine, n_stages

        self._kinds = (_notifying(pipeline_stage_class(p.reshard_after_microbatch)), Schedule1F1B,
                       ScheduleGPipe, ScheduleInterleaved1F1B)
        self._units = _shared_piece_units(model, plan, mine)
        self.finisher = None
        """The GradientFinisher: `start(pieces)` once a unit's gradients on this rank are final."""
        self._waiting: List[set] = []
        self.schedule = None
        self.schedule_name = p.pp_schedule

    def build_schedule(self, autocast_dtype=None, act_dtype: torch.dtype = torch.float32) -> None:
        """After FSDP wrapped the stage modules (they are the FSDP roots). `autocast_dtype`: the
        stages' compute dtype (None: fp32); `act_dtype`: the dtype of the residual stream between
        stages (the static metadata must match what the stages produce)."""
        PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B = self._kinds
        self.ctx.autocast = (self.device.type, autocast_dtype)
        self.act_dtype = self.ctx.act_dtype = act_dtype
        # Static stage metadata: dynamic inference would run an extra forward of the first
        # micro-batch (counting its losses and router loads twice).
        b, s_len, h = self.micro_size, self.seq_len, self.hidden
        def act():
            return torch.empty(b, s_len, h, device=self.device, dtype=self.act_dtype,
                               requires_grad=True)

        tokens = torch.zeros(b, s_len, dtype=torch.long, device=self.device)
        stages = []
        selection = lambda: tuple(torch.zeros(shape, dtype=torch.long, device=self.device)  # noqa: E731
                                  for shape in selection_shapes(self.ctx.cfg, b))
        for m, s in zip(self.modules, self._mine):
            st = self.plan.stages[s]
            inputs = (tokens,) if s == 0 else \
                (act(),) + ((act(),) if st.recv_h0 else ()) + (selection() if st.recv_selection
                                                               else ())
            outputs = (torch.empty((), device=self.device),) if s == self._n_stages - 1 else \
                (act(),) + ((act(),) if st.send_h0 else ()) + (selection() if st.send_selection
                                                               else ())
            stages.append(PipelineStage(m, s, self._n_stages, self.device, group=self.pp_group,
                                        input_args=inputs, output_args=outputs))
            stages[-1].on_grads_done = self._stage_done
            stages[-1].on_backward_done = self._backward_done
        loss_fn = lambda out, target: out  # noqa: E731  (the last stage already returns the loss)
        if self.schedule_name == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, self.n_micro, loss_fn=loss_fn,
                                                    scale_grads=False)
        else:
            kind = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            self.schedule = kind(stages[0], self.n_micro, loss_fn=loss_fn, scale_grads=False)

    def forward_backward(self, batches, global_counts: torch.Tensor, coefs: List[float],
                         aux_grad_scale: float = 1.0, qsa_dense: bool = False) -> torch.Tensor:
        """Every micro-batch of the step through the schedule; returns the per-depth loss sums.
        `aux_grad_scale`, `qsa_dense`: TandemModel.forward's, for every micro-batch."""
        tokens = torch.cat([b["tokens"] for b in batches])
        kwargs = {"tokens": tokens, "loss_mask": torch.cat([b["loss_mask"] for b in batches]),
                  "doc_ids": torch.cat([b["doc_ids"] for b in batches])}
        if any("padding" in b for b in batches):  # as one process reads each micro-batch's
            kwargs["padding"] = torch.cat([b.get("padding", torch.zeros_like(b["loss_mask"],
                                                                           dtype=torch.bool))
                                           for b in batches])
        self.ctx.counts, self.ctx.coefs = global_counts, coefs
        self.ctx.grad_scales = loss_gradient(global_counts, coefs)
        self.ctx.aux_grad_scale, self.ctx.qsa_dense = aux_grad_scale, qsa_dense
        self.ctx.sums = torch.zeros(self.num_depths, dtype=torch.float32, device=tokens.device)
        args = (self.context.local(tokens[:, :-1]).contiguous(),) if self.has_first else ()
        target = torch.zeros(tokens.shape[0], device=tokens.device) if self.has_last else None
        if self.finisher is not None and self.finisher.unfinished():
            # the last step's shared-piece sums ran inside its backward: this step's gradients would
            # add to sums already taken (checked before any of the step's communication)
            raise RuntimeError("pipeline forward_backward ran again before clip_gradients finished "
                               "the last one's gradients (ParallelState.gradient_finisher): call "
                               "it after every forward_backward")
        self._waiting = [set(stages) for _, stages in self._units]
        # gathered from the step's first forward to their reduce-scatter
        if self.piece_units is not None:
            self.piece_units.begin_step()
        self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        sums = self.ctx.sums  # each depth's sum lives on the rank holding it (zeros elsewhere)
        dist.all_reduce(sums, group=self.pp_group)
        return sums

    def fsdp_roots(self) -> List[nn.Module]:
        """This rank's FSDP roots: the stage modules and the pieces that are units of their own
        (code calling the model's pieces directly unshards them, as the in-loop decoder does)."""
        return list(self.modules) + (self.piece_units.roots() if self.piece_units is not None
                                     else [])

    def _backward_done(self, stage: int) -> None:
        """A backward of one of this rank's stages ran: fold the gradients of the pieces of their
        own it uses into their step's accumulators."""
        if self.piece_units is not None:
            self.piece_units.accumulate(self._stage_units[stage])

    def _stage_done(self, stage: int) -> None:
        """A stage of this rank finished its step's backward: start the sums of the units now
        complete."""
        for waiting in self._waiting:
            waiting.discard(stage)
        while self._waiting and not self._waiting[0] and self.finisher is not None:
            self._waiting.pop(0)
            self.finisher.start(self._units[len(self._units) - len(self._waiting) - 1][0])


def _notifying(stage_class):
    """`stage_class` that reports each stage's last gradient work of the step (the schedule's
    REDUCE_GRAD, after its last backward and FSDP's reduction) to `on_grads_done(stage index)`, and
    each of its backwards to `on_backward_done(stage index)`."""

    class NotifyingStage(stage_class):
        on_grads_done = None
        on_backward_done = None

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            # a split input-only backward (zero-bubble schedules) leaves the weights' gradients to
            # its "weight" pass
            if self.on_backward_done is not None and backward_type != "input":
                self.on_backward_done(self.stage_index)
            return out

        def perform_reduce_grad(self, grad_scale_factor: int):
            super().perform_reduce_grad(grad_scale_factor)
            if self.on_grads_done is not None:
                self.on_grads_done(self.stage_index)

    return NotifyingStage
