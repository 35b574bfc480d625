"""One optimizer step on an already parallelized model: forward/backward, clipping, the router-bias
update and AdamW. The training loop, `bench/` and the equivalence tests all step through this class.

Every micro-batch of this rank runs forward+backward with its per-depth loss sums normalised by the
*global* number of valid targets per depth (all micro-batches, all data-parallel replicas), so any
layout optimises exactly the single-process objective.
"""

from __future__ import annotations

import sys
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from tandem.models import depth_target_mask
from tandem.models.experts import expert_paths
from tandem.models.layers import STEP_COUNTERS

from .config import TandemConfig
from .loss import combine_losses, loss_gradient, step_mean
from .optim import build_optimizer, schedule_warning
from .parallel import ParallelState
from .parallel.device import autocast_context
from .qsa_training import IndexerTraining


class TrainStep:
    """The optimizer, precision and MoE / indexer bookkeeping of one model on one rank."""

    def __init__(self, cfg: TandemConfig, model: nn.Module, pstate: ParallelState):
        t = cfg.train
        self.cfg, self.model, self.pstate, self.device = cfg, model, pstate, pstate.device
        self.optimizer = build_optimizer(model, t)
        warning = schedule_warning(t)
        if warning and pstate.is_main:
            print(warning, file=sys.stderr)
        self.autocast_dtype = self.device.autocast_dtype(t.dtype)
        self.moe_layers = [m for m in model.modules()
                           if hasattr(m, "router") and hasattr(m.router, "update_bias")]
        mtp = {id(m) for m in model.mtp.modules()} if model.mtp is not None else set()
        # rows of `moe_layers` in the MTP module (copies on several pp ranks sum their loads)
        self._mtp_rows = torch.tensor([i for i, m in enumerate(self.moe_layers) if id(m) in mtp],
                                      dtype=torch.long, device=self.device.device)
        m = cfg.model
        # whether MoE forwards compute an aux or z loss (`moe/aux_loss`, summed over every rank)
        self.counts_aux = m.num_experts > 0 and m.computes_aux_loss
        # which kernel the routed experts run (probed at this rank's layer widths): a silent
        # fall-back to the per-expert loop costs a host sync per layer, so the run says it at start
        # and in its records
        self.expert_path, line = self._expert_path(model)
        if line and pstate.is_main:
            print(line, file=sys.stderr)
        # The one-process objective is the mean aux/z-loss over every micro-batch of the global
        # step. Gradients are summed over the batch ranks (dp*ep), so each micro-batch's aux
        # gradient is 1/(micro-batches per rank * batch ranks); pipeline ranks split their share
        # into parallel.pp_microbatches instead of grad_accum_steps. (TP ranks compute the aux
        # gradient replicated; under SP it is computed on the gathered logits and scaled in
        # TensorParallelMoE.) Every forward passes it to the model (TandemModel.forward).
        micro = pstate.pipeline.n_micro if pstate.pipeline is not None else t.grad_accum_steps
        self.aux_grad_scale = 1.0 / (micro * pstate.dp_size)
        if micro != t.grad_accum_steps and pstate.is_main:  # (parallel.pp_microbatches)
            per_forward = t.micro_batch_size * t.grad_accum_steps // micro
            aux = " (and the MoE aux/z-loss is taken over each)" if self.counts_aux else ""
            print(f"pipeline: {micro} micro-batches of {per_forward} sequences per step, not "
                  f"{t.grad_accum_steps} of train.micro_batch_size={t.micro_batch_size}{aux}",
                  file=sys.stderr)
        self.indexers = IndexerTraining(model, m.uses_qsa, m.indexer_warmup_steps,
                                        m.resolved_indexer_warmup, pstate.context_group)

    # --- the step's pieces, in order -------------------------------------------------------------
    def global_target_counts(self, batches) -> torch.Tensor:
        """Valid targets per depth over the whole global batch (known before any forward)."""
        depths = 1 + self.cfg.mtp.num_steps
        # fp32, not fp64 (accelerators such as Ascend 910 have no fp64 units): counts are integers,
        # exact in fp32 up to 2^24 targets per depth per step.
        counts = torch.zeros(depths, dtype=torch.float32, device=self.device.device)
        for b in batches:
            for d in range(depths):
                counts[d] += depth_target_mask(b["loss_mask"], b["doc_ids"], d).sum()
        return self.pstate.all_reduce_dp(counts)

    def forward_backward(self, batches, global_counts: torch.Tensor, coefs: List[float],
                         qsa_dense: bool = False) -> torch.Tensor:
        """Run every micro-batch; return per-depth loss sums over this rank's data (detached).
        `qsa_dense`: the step is in QSA's dense warm-up (`self.indexers.dense`)."""
        if self.pstate.pipeline is not None:
            return self.pstate.pipeline.forward_backward(batches, global_counts, coefs,
                                                         self.aux_grad_scale, qsa_dense)
        return self._micro_batches(batches, global_counts, coefs, qsa_dense)

    def _expert_path(self, model: nn.Module):
        """`expert_paths` over the run's layers: under pipeline parallelism every stage's (rank 0,
        which logs, may hold none of them)."""
        value, line = expert_paths(model, self.device.device, self.autocast_dtype)
        if not self.pstate.pp_enabled:
            return value, line
        gathered = [None] * self.pstate.world_size
        dist.all_gather_object(gathered, (value, line))
        values = {v for v, _ in gathered if v}
        value = values.pop() if len(values) == 1 else "mixed" if values else ""
        return value, "\n".join(dict.fromkeys(ln for _, ln in gathered if ln))

    def _micro_batches(self, batches, global_counts: torch.Tensor, coefs: List[float],
                       qsa_dense: bool) -> torch.Tensor:
        # Loss sums are fp32 (as the losses themselves; no fp64 on accelerators): logged only.
        sums = torch.zeros(len(coefs), dtype=torch.float32, device=self.device.device)
        # FSDP2 (parallel.reshard_after_microbatch): by default every micro-batch's backward
        # reduce-scatters into the sharded fp32 gradients and reshards, as torchtitan does; false
        # accumulates unsharded gradients locally and reduce-scatters once, in the last
        # micro-batch's backward (one collective per step instead of per micro-batch), keeping the
        # parameters gathered in between, as torch's pipeline stages do.
        fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        every = self.cfg.parallel.reshard_after_microbatch
        # The gradient each depth's loss sum will receive: the fused head then accumulates every
        # depth's weight gradient into one buffer (models/loss.py).
        scales = loss_gradient(global_counts, coefs)
        for i, b in enumerate(batches):
            sync = every or i == len(batches) - 1
            for m in fsdp:
                m.set_requires_gradient_sync(sync, recurse=False)
                m.set_reshard_after_backward(sync, recurse=False)
            with self.autocast():
                out = self.model(b["tokens"], b["loss_mask"], b["doc_ids"],
                                 self.cfg.data.document_mask, loss_grad_scales=scales,
                                 aux_grad_scale=self.aux_grad_scale, qsa_dense=qsa_dense,
                                 padding_bs=b.get("padding"))
                loss = combine_losses(out.loss_sums, global_counts, coefs)
            loss.backward()
            sums += out.loss_sums.detach().float()
        return sums

    def autocast(self):
        """The compute-precision context of a forward (nullcontext in fp32)."""
        return autocast_context(self.device.type, self.autocast_dtype)

    def clip_gradients(self, schedule_step: float = float("inf")) -> float:
        """Complete the step's gradients (the layout's finisher), drop those of parameters that do
        not learn in the step starting at `schedule_step` (QSA's `indexer_only` warm-up), and clip
        the rest by their global norm: the gradients dropped neither count in it nor scale the
        ones kept."""
        finisher = self.pstate.gradient_finisher
        if finisher is not None:
            finisher.sync()
        self.indexers.drop_frozen_gradients(schedule_step)
        if finisher is not None:
            return float(finisher.clip(self.cfg.train.grad_clip))
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))

    def update_router_biases(self, move: bool = True) -> Dict[str, float]:
        """Aux-free bias step from the step's expert loads (summed over every rank that routed
        different tokens; `move=False` only reads them); returns load-balance metrics over every
        MoE layer of the model. Every all-reduce runs wherever its group exists, also on a rank
        with no MoE layer (a pipeline stage of dense layers beside a copy of a dense MTP module):
        its peers wait in the same collectives."""
        loads = self._expert_loads()
        for moe, load in zip(self.moe_layers, loads):
            # A frozen router (train.freeze_trunk) keeps its bias too: the trunk stays
            # bit-identical.
            if move and moe.cfg.balance == "aux_free" and moe.router.weight.requires_grad:
                moe.router.update_bias(load)
            moe.router.tokens_per_expert.zero_()
        metrics = self._load_balance(loads)
        if self.counts_aux:  # the step's mean over every MoE forward (one host sync, logged here)
            aux = step_mean([m.aux_loss_sum for m in self.moe_layers], self.device.device)
            if aux is not None:
                metrics["moe/aux_loss"] = aux
        return metrics

    def _load_balance(self, loads: torch.Tensor) -> Dict[str, float]:
        """max over mean expert load per layer: its max and mean over the model's MoE layers. Under
        pp each stage's layers count (the first copy of a shared MTP module counts its layers)."""
        ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9) if len(loads) else (
            loads.new_zeros(0))
        counted = torch.ones_like(ratio)
        copies = self.pstate.mtp_copies_group
        if copies is not None and dist.get_rank(copies) != 0:
            counted[self._mtp_rows] = 0
        total = torch.stack([(ratio * counted).sum(), counted.sum()])
        top = ratio.max() if len(ratio) else loads.new_zeros(())
        if self.pstate.pp_enabled:
            group = self.pstate.mesh["pp"].get_group()
            dist.all_reduce(total, group=group)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        if not total[1]:
            return {}
        return {"moe/max_over_mean_load": float(top),
                "moe/mean_max_over_mean_load": float(total[0] / total[1])}

    def _expert_loads(self) -> torch.Tensor:
        """[MoE layers, experts] tokens routed this step, summed over the ranks that routed them."""
        if self.moe_layers:
            loads = torch.stack([m.router.tokens_per_expert for m in self.moe_layers])
        else:
            loads = torch.zeros(0, self.cfg.model.num_experts, device=self.device.device)
        copies = self.pstate.mtp_copies_group
        # MTP depths spread over pp ranks: each copy routed its depths' tokens
        if copies is not None:
            part = loads.index_select(0, self._mtp_rows)
            dist.all_reduce(part, group=copies)
            loads.index_copy_(0, self._mtp_rows, part)
        group = self.pstate.router_load_group
        if self.pstate.world_size > 1 and group is not None:
            dist.all_reduce(loads, group=group)
        return loads

    def discard_router_loads(self) -> Dict[str, float]:
        """A dropped step must not move the aux-free biases either."""
        for moe in self.moe_layers:
            moe.router.tokens_per_expert.zero_()
        return {}

    def apply(self, schedule_step: float) -> Dict[str, float]:
        """The update: router biases moved only when everything learns, AdamW (on the gradients
        `clip_gradients` kept). Returns the load-balance metrics."""
        metrics = self.update_router_biases(
            move=not self.indexers.freezes_the_rest(schedule_step))
        self.optimizer.step()
        return metrics

    def __call__(self, batches, coefs: List[float], schedule_step: float = float("inf")):
        """Counts, forward/backward, the data-parallel loss sum and clipping: (per-depth loss sums
        over the global batch, global target counts, gradient norm). `schedule_step`: where the
        step starts (consumed samples / the first global batch; the default is past every
        warm-up). The update is `apply`."""
        for name, counter in self.model.named_buffers():
            if name.endswith(STEP_COUNTERS):  # a rewound step's counts are gone
                counter.zero_()
        counts = self.global_target_counts(batches)
        sums = self.pstate.all_reduce_replicas(
            self.forward_backward(batches, counts, coefs, self.indexers.dense(schedule_step)))
        return sums, counts, self.clip_gradients(schedule_step)
