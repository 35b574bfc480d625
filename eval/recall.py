"""QSA recall during evaluation: the share of the dense attention's probability mass inside each QSA
layer's selection, measured on the evaluator's teacher-forced pass (`eval/qsa_recall`)."""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from tandem.models.qsa import IndexedAttention
from tandem.models.qsa_loss import measuring_recall


class RecallProbe:
    """Context that makes every QSA layer measure its recall (the share of the dense attention's
    probability mass inside its selection) on each forward it runs, e.g. the evaluator's
    teacher-forced pass; `value()` is the mean over layers and forwards (None when no QSA layer
    ran)."""

    active = None
    """The probe currently entered in this process (None: none): a pipeline's decoding driver adds
    the values the other stages' QSA layers measured (trainer/parallel/pipeline_decode.py reads
    it)."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, IndexedAttention)]
        self.values: List[torch.Tensor] = []
        self._hooks = []

    def _keep(self, layer, _inputs, _output) -> None:
        if layer.last_recall is not None:  # each forward sets or clears it
            self.values.append(layer.last_recall.float())

    def __enter__(self):
        self._mode = measuring_recall()
        self._mode.__enter__()
        for layer in self.layers:
            self._hooks.append(layer.register_forward_hook(self._keep))
        RecallProbe.active = self
        return self

    def __exit__(self, *exc):
        RecallProbe.active = None
        self._mode.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False

    def value(self):
        return float(torch.stack(self.values).mean()) if self.values else None
