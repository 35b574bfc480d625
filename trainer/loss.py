"""The weighted multi-step loss: L = L_main + lambda(step) * sum_k w_k * L_k."""

from __future__ import annotations

from contextlib import nullcontext
from typing import List, Optional

import torch
import torch.distributed as dist

from tandem.models.mtp import depth_target_mask
from tandem.models.mtp_config import MTPConfig


def depth_weights(mtp: MTPConfig) -> List[float]:
    """w_1..w_K: the explicit list, or geometric decay**(k-1); divided by their sum when
    normalize."""
    k = mtp.num_steps
    if k == 0:
        return []
    weights = list(mtp.loss.weights) if mtp.loss.weights else [mtp.loss.decay ** i
                                                               for i in range(k)]
    if mtp.loss.normalize:
        total = sum(weights)
        weights = [w / total for w in weights] if total > 0 else weights
    return weights


def lambda_at(mtp: MTPConfig, step: float) -> float:
    """Piecewise-constant lambda: the initial value, replaced at each `lambda_after` milestone
    reached (`step`: the schedule step, samples seen in steps of the run's first global batch)."""
    value = mtp.loss.lambda_
    for milestone in sorted(mtp.loss.lambda_after):
        if step >= milestone:
            value = mtp.loss.lambda_after[milestone]
    return value


def depth_coefficients(mtp: MTPConfig, step: float) -> List[float]:
    """Coefficient of each depth's mean loss in the total: [1, lambda*w_1, ..., lambda*w_K]."""
    lam = lambda_at(mtp, step)
    return [1.0] + [lam * w for w in depth_weights(mtp)]


def loss_gradient(global_counts: torch.Tensor, coefficients: List[float]) -> torch.Tensor:
    """d total / d loss_sums[depth] of `combine_losses`: each depth's coefficient over its global
    count of valid targets. Known before the forward (the counts come from the batch), which lets
    the fused head keep one weight-gradient buffer for every depth (TandemModel.forward's
    `loss_grad_scales`)."""
    # The coefficients stay Python floats: a tensor of them built on an accelerator is a
    # host-to-device copy that waits for the stream, once per micro-batch (and pipeline stage).
    counts = global_counts.clamp(min=1).float()
    return torch.stack([c / n for c, n in zip(coefficients, counts.unbind(0))])


def combine_losses(loss_sums: torch.Tensor, global_counts: torch.Tensor,
                   coefficients: List[float]) -> torch.Tensor:
    """Weighted total from per-depth summed losses, each normalised by the global (all
    micro-batches, all data-parallel ranks) count of valid targets, so every layout optimises the
    same objective."""
    return (loss_sums * loss_gradient(global_counts, coefficients).to(loss_sums.dtype)).sum()


def one_batch_forward_backward(model, tokens_bs1: torch.Tensor, coefficients: List[float],
                               autocast=nullcontext):
    """Forward and backward of one batch in one process as `TrainStep.forward_backward` runs a
    step's micro-batches (the counts are this batch's, the head told each depth's gradient
    beforehand), for benchmarks and tests that time or inspect a bare model. `autocast`: the
    forward's precision context factory. Returns the model's output (loss sums and counts)."""
    ones = torch.ones_like(tokens_bs1[:, 1:])
    counts = torch.stack([depth_target_mask(ones, None,
                                            d).sum() for d in range(len(coefficients))]).float()
    with autocast():
        out = model(tokens_bs1, loss_grad_scales=loss_gradient(counts, coefficients))
    combine_losses(out.loss_sums, counts, coefficients).backward()
    return out


@torch.no_grad()
def step_mean(counters: List[torch.Tensor], device: torch.device, shares: int = 1
              ) -> Optional[float]:
    """The mean over the step's forwards, on every rank, of a loss the model counted
    (models/layers.py `count_loss`): this rank's [sum, forwards] counters added up and summed over
    the world, then zeroed. Ranks that ran copies of one forward (tp) add to both sums alike;
    `shares`: the ranks each of whose losses is a part of one forward's (cp, for the indexer's KL),
    which counted that forward `shares` times. None when no forward computed one. Every rank calls
    it."""
    total = torch.zeros(2, dtype=torch.float32, device=device)
    for counter in counters:
        total += counter.to(device)
        counter.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    sum_, forwards = total.tolist()
    return sum_ * shares / forwards if forwards > 0 else None
