"""Training the QSA indexers (DeepSeek-V3.2's sparse-attention recipe, applied to Qwen4-Exp's QSA).

The reference implementation has no indexer loss; a pretraining framework must train the indexer or
its selection stays random. Two stages (`model.indexer_warmup_steps`, counted in schedule steps: the
consumed samples over the run's first global batch, as the LR and the MTP weight follow them):

* dense warm-up: attention is dense and the indexers learn by KL(p_main || p_indexer) from the main
  attention's head-summed distribution over every visible complete block to the indexer's.
  `model.indexer_warmup=joint` (a model trained from scratch) trains everything else by the language
  model loss meanwhile; `indexer_only` (DeepSeek-V3.2, which started from a dense-trained
  checkpoint) drops every other gradient before the optimizer step, so nothing else moves;
* sparse stage: attention reads only the selected tokens, the KL is restricted to the selected
  blocks and the indexer's input is detached, so the indexer learns from its KL alone and the
  language-model loss trains everything else.

The stage is a forward argument (`TandemModel.forward(qsa_dense=...)`, which `TrainStep` passes
from `dense` here). The KL's weight is the layers' own `indexer_loss_coef`
(model.indexer_loss_coef); it enters each QSA layer's backward through `AuxLossGrad` (as the MoE's
balance loss does), scaled like that loss by the forward's `aux_grad_scale` to the mean over the
global step's micro-batches; `loss/indexer` logs its mean over the step's QSA forwards.
"""

from __future__ import annotations

from typing import Dict, List

import torch.distributed as dist
from torch import nn

from tandem.models.qsa import IndexedAttention

from .loss import step_mean


class IndexerTraining:
    def __init__(self, model: nn.Module, uses_qsa: bool, warmup_steps: int, warmup: str = "joint",
                 context_group=None):
        """`uses_qsa`: the model has QSA layers (ModelConfig.uses_qsa; `model` may be a pipeline
        rank's stages, holding none of them, whose steps are warm-up steps all the same).
        `warmup`: `joint` or `indexer_only` (ModelConfig.resolved_indexer_warmup).
        `context_group`: the cp ranks splitting each window (parallel.cp > 1), whose indexer losses
        are shares of the window's (models/qsa.py) and are summed for the logged figure."""
        self.context_group = context_group
        self.device = next(model.parameters()).device
        self.layers: List[IndexedAttention] = [m for m in model.modules()
                                               if isinstance(m, IndexedAttention)]
        self.uses_qsa, self.warmup_steps = uses_qsa, warmup_steps
        self.indexer_only = warmup == "indexer_only"
        indexer = {id(p) for layer in self.layers for p in layer.indexer.parameters()}
        self.main_params = [p for p in model.parameters() if id(p) not in indexer]

    def dense(self, schedule_step: float) -> bool:
        """Whether the step starting at `schedule_step` (consumed samples / first global batch) is
        in the warm-up (never for a model without QSA layers)."""
        return self.uses_qsa and schedule_step < self.warmup_steps

    def freezes_the_rest(self, schedule_step: float) -> bool:
        """Whether only the indexers learn in the step starting at `schedule_step`: `indexer_only`
        in the dense warm-up (the MoE routers' biases stay as well, TrainStep.apply)."""
        return self.indexer_only and self.dense(schedule_step)

    def drop_frozen_gradients(self, schedule_step: float) -> None:
        """Drop every gradient but the indexers' when only they learn: the optimizer then skips
        the other parameters entirely, weight decay included. Before clipping (TrainStep.
        clip_gradients), so the norm is the indexers' alone; after a layout's gradient finisher
        has completed the gradients, whose collectives expect every rank's full set."""
        if self.freezes_the_rest(schedule_step):
            for p in self.main_params:
                p.grad = None

    def metrics(self) -> Dict[str, float]:
        """`loss/indexer`: the step's mean over its QSA layers' forwards (every micro-batch, every
        rank: the layers of every pipeline stage, each data-parallel replica's batch; the cp ranks'
        shares summed). Every rank calls it (its collective), each step of a QSA model."""
        if not self.uses_qsa:
            return {}
        cp = 1 if self.context_group is None else dist.get_world_size(self.context_group)
        value = step_mean([layer.indexer_loss_sum for layer in self.layers], self.device, cp)
        return {} if value is None else {"loss/indexer": value}
