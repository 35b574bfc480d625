"""Training the QSA indexers (DeepSeek-V3.2's sparse-attention recipe, applied to Qwen4-Exp's QSA).

The reference implementation has no indexer loss; a pretraining framework must train the indexer or
its selection stays random. Two stages (`model.indexer_warmup_steps`):

* dense warm-up: attention is dense and only the indexers learn, by KL(p_main || p_indexer) from the
  main attention's head-summed distribution over every visible complete block to the indexer's
  (the trunk's gradients are dropped before the optimizer step, so nothing else moves);
* sparse stage: attention reads only the selected tokens, the KL is restricted to the selected blocks
  and the indexer's input is detached, so the indexer learns from its KL alone and the language-model
  loss trains everything else.

The KL enters each QSA layer's backward through `AuxLossGrad` (as the MoE's balance loss does), scaled
like that loss to the mean over the global step's micro-batches; `loss/indexer` logs its mean over layers.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from tandem.models.qsa import IndexedAttention


class IndexerTraining:
    def __init__(self, model: nn.Module, coef: float, warmup_steps: int, grad_scale: float):
        self.layers: List[IndexedAttention] = [m for m in model.modules() if isinstance(m, IndexedAttention)]
        self.coef, self.warmup_steps, self.grad_scale = coef, warmup_steps, grad_scale
        indexer = {id(p) for layer in self.layers for p in layer.indexer.parameters()}
        self.main_params = [p for p in model.parameters() if id(p) not in indexer]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def dense(self, step: int) -> bool:
        return step < self.warmup_steps

    def begin_step(self, step: int) -> None:
        """Stage and loss weight of the layers for training step `step` (0-based)."""
        for layer in self.layers:
            layer.dense = self.dense(step)
            layer.indexer_loss_coef = self.coef * self.grad_scale

    def before_update(self, step: int) -> None:
        """In the dense warm-up only the indexers learn: drop every other gradient (the optimizer then
        skips those parameters entirely, weight decay included)."""
        if self.dense(step):
            for p in self.main_params:
                p.grad = None

    def metrics(self) -> Dict[str, float]:
        losses = [layer.last_indexer_loss for layer in self.layers if layer.last_indexer_loss is not None]
        if not losses:
            return {}
        return {"loss/indexer": float(torch.stack([x.float() for x in losses]).mean())}


class RecallProbe:
    """Context that makes every QSA layer measure its recall (the share of the dense attention's
    probability mass inside its selection) on each forward it runs, e.g. the evaluator's teacher-forced
    pass; `value()` is the mean over layers and forwards (None when no QSA layer ran)."""

    active = None
    """The probe currently entered in this process (None: none): a pipeline's decoding driver adds the
    values the other stages' QSA layers measured (trainer/parallel/pipeline_decode.py)."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, IndexedAttention)]
        self.values: List[torch.Tensor] = []
        self._hooks = []

    def _keep(self, layer, _inputs, _output) -> None:
        if layer.last_recall is not None:
            self.values.append(layer.last_recall.float())
            layer.last_recall = None

    def __enter__(self):
        for layer in self.layers:
            layer.measure_recall, layer.last_recall = True, None
            self._hooks.append(layer.register_forward_hook(self._keep))
        RecallProbe.active = self
        return self

    def __exit__(self, *exc):
        RecallProbe.active = None
        for layer in self.layers:
            layer.measure_recall = False
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False

    def value(self):
        return float(torch.stack(self.values).mean()) if self.values else None
