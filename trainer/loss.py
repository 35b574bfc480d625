"""The weighted multi-step loss: L = L_main + lambda(step) * sum_k w_k * L_k."""

from __future__ import annotations

from typing import List

import torch

from tandem.models.config import MTPConfig


def depth_weights(mtp: MTPConfig) -> List[float]:
    """w_1..w_K: the explicit list, or geometric decay**(k-1); divided by their sum when normalize."""
    k = mtp.num_steps
    if k == 0:
        return []
    weights = list(mtp.loss.weights) if mtp.loss.weights else [mtp.loss.decay ** i for i in range(k)]
    if mtp.loss.normalize:
        total = sum(weights)
        weights = [w / total for w in weights] if total > 0 else weights
    return weights


def lambda_at(mtp: MTPConfig, step: float) -> float:
    """Piecewise-constant lambda: the initial value, replaced at each `lambda_after` milestone reached
    (`step`: the schedule step, samples seen in steps of the run's first global batch)."""
    value = mtp.loss.lambda_
    for milestone in sorted(mtp.loss.lambda_after):
        if step >= milestone:
            value = mtp.loss.lambda_after[milestone]
    return value


def depth_coefficients(mtp: MTPConfig, step: float) -> List[float]:
    """Coefficient of each depth's mean loss in the total: [1, lambda*w_1, ..., lambda*w_K]."""
    lam = lambda_at(mtp, step)
    return [1.0] + [lam * w for w in depth_weights(mtp)]


def combine_losses(loss_sums: torch.Tensor, global_counts: torch.Tensor, coefficients: List[float]) -> torch.Tensor:
    """Weighted total from per-depth summed losses, each normalised by the global (all micro-batches,
    all data-parallel ranks) count of valid targets, so every layout optimises the same objective."""
    # The coefficients stay Python floats: a tensor of them built on an accelerator is a host-to-device
    # copy that waits for the stream, once per micro-batch (and pipeline stage).
    scaled = torch.stack([c * x for c, x in zip(coefficients, loss_sums.unbind(0))])
    return (scaled / global_counts.clamp(min=1).to(loss_sums.dtype)).sum()
