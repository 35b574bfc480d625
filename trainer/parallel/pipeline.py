"""Pipeline parallelism with torch.distributed.pipelining.

The trunk's layers are split over `pp * virtual` stages (evenly, or by `parallel.pp_layout`); stage s
lives on pp rank s % pp (so the interleaved schedule gets `virtual` chunks per rank). The model on
each rank is pruned in place to what its stages hold, keeping the single-process parameter names
(`layers.<global index>`), so DCP checkpoints stay portable between layouts.

The last stage holds the final norm, the MTP module, the output head and a copy of the token
embedding (the MTP steps embed tokens t+k), initialised identical to the first stage's and kept
identical by summing the two gradients each step (Megatron's shared-embedding all-reduce). Both
copies are saved under the same key `embed_tokens.weight`: identical replicas, deduplicated by DCP.

The last stage's forward computes the per-depth loss sums from the trunk output
(`model.losses_from_hidden`) and returns the loop's combined loss; the schedule backpropagates it
unscaled (`scale_grads=False`) because the loss is already normalised by the global target count.
Every stage receives the micro-batch's tokens / loss mask / doc ids as kwargs.

Precision: every stage's forward runs under the loop's autocast (bf16 compute), and stages exchange
the residual stream in the dtype it has: fp32 under autocast alone (the embedding and the residual
adds stay fp32), bf16 when FSDP's mixed-precision policy hands the stages bf16 parameters.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from tandem.trainer.loss import combine_losses

from .device import autocast_context
from .validate import pipeline_microbatches, stage_layer_split


class _StepContext:
    autocast: tuple = ("cpu", None)
    """(device type, autocast dtype or None for fp32) of every stage forward."""
    counts: Optional[torch.Tensor] = None
    coefs: Optional[List[float]] = None
    sums: Optional[torch.Tensor] = None


class StageModule(nn.Module):
    """One pipeline stage: (embedding) -> its trunk layers -> (the loss, on the last stage)."""

    def __init__(self, model: nn.Module, layer_ids: List[int], first: bool, last: bool, ctx: _StepContext):
        super().__init__()
        self.first, self.last = first, last
        self.embed = model.embed_tokens if (first or last) else None
        self.blocks = nn.ModuleList([model.layers[str(i)] for i in layer_ids])
        if last:
            self.norm, self.mtp, self.lm_head = model.norm, model.mtp, model.lm_head
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_ctx", ctx)
        # A frozen trunk (MTP fine-tuning) runs under no_grad on every stage: no activations kept, and
        # no activation gradients sent back (the received activation's gradient stays None).
        self.trunk_frozen = model.trunk_frozen()

    def forward(self, x, tokens, loss_mask, doc_ids):
        with autocast_context(*self._ctx.autocast):
            return self._forward(x, tokens, loss_mask, doc_ids)

    def _forward(self, x, tokens, loss_mask, doc_ids):
        b, s = tokens.shape[0], tokens.shape[1] - 1
        positions = torch.arange(s, device=tokens.device).expand(b, s)
        with torch.no_grad() if self.trunk_frozen else nullcontext():
            h = self.embed(x) if self.first else x
            for block in self.blocks:
                h = block(h, positions)
        if not self.last:
            return h
        out = self._model.losses_from_hidden(h, tokens, loss_mask, doc_ids, positions)
        self._ctx.sums += out.loss_sums.detach().float()
        return combine_losses(out.loss_sums, self._ctx.counts, self._ctx.coefs)


def plan_stages(cfg, pp_rank: int):
    """(stage indices of this rank, layer ids per stage index, total stages)."""
    p = cfg.parallel
    virtual = p.pp_virtual_stages if p.pp_schedule == "interleaved_1f1b" else 1
    n_stages = p.pp * virtual
    split = stage_layer_split(cfg.model.num_layers, n_stages, list(p.pp_layout))
    mine = [s for s in range(n_stages) if s % p.pp == pp_rank]
    return mine, split, n_stages


def prune_model(model: nn.Module, cfg, pp_rank: int) -> None:
    """Drop what this pp rank's stages do not hold (names of the rest are unchanged)."""
    mine, split, n_stages = plan_stages(cfg, pp_rank)
    keep = {i for s in mine for i in split[s]}
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    first, last = 0 in mine, (n_stages - 1) in mine
    if not (first or last):
        model.embed_tokens = None
    if not last:
        model.norm = None
        model.lm_head = None
        model.mtp = None


class Pipeline:
    """`extras["pipeline"]`: runs one step's micro-batches through the schedule on this rank."""

    def __init__(self, model: nn.Module, cfg, pp_mesh, device: torch.device):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        p = cfg.parallel
        self.ctx = _StepContext()
        self.pp_group = pp_mesh.get_group()
        self.pp = p.pp
        pp_rank = pp_mesh.get_local_rank()
        mine, split, n_stages = plan_stages(cfg, pp_rank)
        self.n_micro = pipeline_microbatches(cfg)
        self.num_depths = 1 + cfg.mtp.num_steps
        self.micro_size = cfg.train.micro_batch_size * cfg.train.grad_accum_steps // self.n_micro
        # stage boundaries carry [micro-batch, sequence (shard under SP), hidden] activations
        sp_tp = p.tp if (p.sequence_parallel and p.tp > 1) else 1
        self.seq_len, self.hidden = cfg.data.seq_len // sp_tp, cfg.model.hidden_size
        self.act_dtype = torch.float32  # build_schedule sets the run's
        self.device = device
        self.modules = [StageModule(model, split[s], s == 0, s == n_stages - 1, self.ctx) for s in mine]
        self.has_first, self.has_last = 0 in mine, (n_stages - 1) in mine
        self.last_rank = dist.get_global_rank(self.pp_group, (n_stages - 1) % p.pp)
        self._mine, self._n_stages = mine, n_stages
        self._kinds = (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B)
        self.schedule = None
        self.schedule_name = p.pp_schedule

    def build_schedule(self, autocast_dtype=None, act_dtype: torch.dtype = torch.float32) -> None:
        """After FSDP wrapped the stage modules (they are the FSDP roots). `autocast_dtype`: the
        stages' compute dtype (None: fp32); `act_dtype`: the dtype of the residual stream between
        stages (the static metadata must match what the stages produce)."""
        PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B = self._kinds
        self.ctx.autocast = (self.device.type, autocast_dtype)
        self.act_dtype = act_dtype
        # Static stage metadata: dynamic inference would run an extra forward of the first
        # micro-batch (counting its losses and router loads twice).
        b, s_len, h = self.micro_size, self.seq_len, self.hidden
        act = torch.empty(b, s_len, h, device=self.device, dtype=self.act_dtype, requires_grad=True)
        tokens = torch.zeros(b, s_len, dtype=torch.long, device=self.device)
        stages = [PipelineStage(m, s, self._n_stages, self.device, group=self.pp_group,
                                input_args=(tokens if s == 0 else act,),
                                output_args=(torch.empty((), device=self.device) if s == self._n_stages - 1 else act,))
                  for m, s in zip(self.modules, self._mine)]
        loss_fn = lambda out, target: out  # noqa: E731  (the last stage already returns the loss)
        if self.schedule_name == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, self.n_micro, loss_fn=loss_fn, scale_grads=False)
        else:
            kind = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            self.schedule = kind(stages[0], self.n_micro, loss_fn=loss_fn, scale_grads=False)

    def forward_backward(self, batches, global_counts: torch.Tensor, coefs: List[float]) -> torch.Tensor:
        tokens = torch.cat([b["tokens"] for b in batches])
        kwargs = {"tokens": tokens, "loss_mask": torch.cat([b["loss_mask"] for b in batches]),
                  "doc_ids": torch.cat([b["doc_ids"] for b in batches])}
        self.ctx.counts, self.ctx.coefs = global_counts, coefs
        self.ctx.sums = torch.zeros(self.num_depths, dtype=torch.float32, device=tokens.device)
        args = (tokens[:, :-1].contiguous(),) if self.has_first else ()
        target = torch.zeros(tokens.shape[0], device=tokens.device) if self.has_last else None
        self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        sums = self.ctx.sums
        dist.broadcast(sums, src=self.last_rank, group=self.pp_group)
        return sums
