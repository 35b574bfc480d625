"""AdamW with warm-up + cosine decay."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig

from .loss import lambda_at
from .train_config import TrainConfig

FUSED_DEVICES = {"cpu", "cuda"}
"""Device types whose fused AdamW kernel `train.optimizer_kernel=auto` uses."""


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters only (a frozen trunk gets no optimizer state); no weight
    decay on norms and biases (1-D tensors); `train.optimizer_kernel` picks the fused or foreach
    kernel."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kinds = {p.device.type for group in groups for p in group["params"]}
    return MultiTensorAdamW(groups, lr=cfg.lr, **_settings(cfg, kinds))


def _settings(cfg: TrainConfig, device_types: set) -> dict:
    """AdamW's settings from train.* (the learning rate aside: `set_lr` writes it every step)."""
    fused = cfg.optimizer_kernel == "fused" or (cfg.optimizer_kernel == "auto"
                                                and device_types <= FUSED_DEVICES)
    return dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None, foreach=not fused)


def apply_settings(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """The run's train.* settings on an optimizer whose state a checkpoint loaded: torch's
    load_state_dict restores each group's settings with the moments, so a resume under another
    weight decay, beta, eps or kernel (which config.yaml then records) kept the checkpoint's."""
    kinds = {p.device.type for group in optimizer.param_groups for p in group["params"]}
    for group, decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):
        group.update(_settings(cfg, kinds), weight_decay=decay)
        # load_state_dict put each step count where the checkpoint's kernel keeps it (the host for
        # foreach, the parameter's device for fused): the run's kernel finds it where it looks
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device=p.device if on_device else "cpu",
                                                 dtype=torch.float32)


class MultiTensorAdamW(torch.optim.AdamW):
    """AdamW on a multi-tensor kernel (fused or foreach) for any mix of plain and DTensor
    parameters.

    torch's fused and foreach kernels take DTensors of different meshes and placements in one call
    (each element's update depends on that element alone, so a sharded parameter's update equals the
    whole one's, checked on torch 2.13) but not plain tensors mixed with DTensors, which a
    tensor/expert/FSDP-parallel model has (e.g. parameters FSDP ignores). Each step therefore runs
    the parameter groups split by that one property; the groups seen by the rest of the code
    (state_dict, checkpoints, `set_lr`) stay the two decay / no-decay groups."""

    def step(self, closure=None):
        groups = self.param_groups
        split = []
        for group in groups:
            kinds = ([p for p in group["params"] if isinstance(p, DTensor)],
                     [p for p in group["params"] if not isinstance(p, DTensor)])
            split += [{**group, "params": params} for params in kinds if params]
        self.param_groups = split
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


def lr_at(cfg: TrainConfig, step: float) -> float:
    """Learning rate at schedule step `step` (0-based; the loop passes consumed samples / the run's
    first global batch, `DataPosition.schedule_step()`: fractional after a global-batch change)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:  # never above lr between steps W-1 and W
        return cfg.lr * min(step + 1, cfg.warmup_steps) / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def schedule_warning(cfg: TrainConfig) -> str:
    """A warm-up as long as the run (a recipe shortened with train.max_steps keeps its
    warmup_steps): the rate rises to the last step and never decays. Empty when the schedule
    warms up and decays."""
    if not 0 < cfg.max_steps <= cfg.warmup_steps:
        return ""
    return (f"warning: train.warmup_steps={cfg.warmup_steps} >= train.max_steps={cfg.max_steps}: "
            f"the learning rate rises through the whole run to {lr_at(cfg, cfg.max_steps - 1):.3g} "
            f"at its last step (train.lr={cfg.lr:g}) and never decays; lower train.warmup_steps")


SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay_steps", "max_steps")
"""The train.* keys that shape the LR schedule."""


def schedule_note(saved: dict, cfg: TrainConfig, at: float, last: float) -> str:
    """What a resume changes about the LR schedule, for its start-up line (empty: nothing).
    `saved`: the checkpoint's train section; `at`, `last`: the schedule steps of the next and the
    last step to run. A schedule key changed since the checkpoint (a longer train.max_steps with
    decay_steps 0 re-plans the cosine, so the LR of an annealed run rises again) is named with both
    schedules' next LR; a global batch changed since the run began moves where its last step falls
    on the schedule (a smaller batch ends before the decay does)."""
    before = dataclasses.replace(cfg, **{k: saved[k] for k in SCHEDULE_KEYS if k in saved})
    note = ""
    changed = [f"train.{k} {getattr(before, k)!r} -> {getattr(cfg, k)!r}" for k in SCHEDULE_KEYS
               if getattr(before, k) != getattr(cfg, k)]
    if changed and not math.isclose(lr_at(before, at), lr_at(cfg, at), rel_tol=1e-9):
        # (a derived decay_steps follows max_steps: naming it helps only when max_steps moved)
        derived = not (cfg.decay_steps or before.decay_steps)
        keep = "" if not derived or before.max_steps == cfg.max_steps else (
            f"; train.decay_steps={max(before.max_steps - before.warmup_steps, 1)} keeps the "
            "checkpoint's decay")
        note += (f"; the LR schedule changed ({', '.join(changed)}): the next step's LR is "
                 f"{lr_at(cfg, at):.4g}, {lr_at(before, at):.4g} on the checkpoint's "
                 f"schedule{keep}")
    if not math.isclose(last, cfg.max_steps - 1, abs_tol=1e-9):
        note += (f"; the last step (train.max_steps={cfg.max_steps}) falls at schedule step "
                 f"{last + 1:g} of {cfg.max_steps} planned, at LR {lr_at(cfg, last):.4g} "
                 f"(train.min_lr={cfg.min_lr:g})")
    return note


def stage_note(saved_model: dict, saved_mtp: dict, model: ModelConfig, mtp: MTPConfig,
               at: float) -> str:
    """What a resume changes about the QSA stage and the MTP loss weight at its next step (`at`, a
    schedule step), for its start-up line (empty: nothing). Their keys may change on resume: a
    longer model.indexer_warmup_steps puts a sparse run back into the dense warm-up (under
    indexer_only holding every other weight still), a changed mtp.loss.lambda_after moves lambda
    back; `saved_*`: the checkpoint's sections."""
    note = ""
    if model.uses_qsa:
        before = dataclasses.replace(model, **{k: saved_model[k] for k in (
            "indexer_warmup_steps", "indexer_warmup") if k in saved_model})
        stage = lambda m: ("sparse" if at >= m.indexer_warmup_steps  # noqa: E731
                           else f"the dense warm-up ({m.resolved_indexer_warmup})")
        if stage(before) != stage(model):
            note += (f"; the QSA stage changed: the next step is {stage(model)}, {stage(before)} "
                     f"under the checkpoint's model.indexer_warmup_steps="
                     f"{before.indexer_warmup_steps}, indexer_warmup={before.indexer_warmup}")
    saved = saved_mtp.get("loss", {})
    loss = dataclasses.replace(mtp.loss, lambda_=float(saved.get("lambda", mtp.loss.lambda_)),
                               lambda_after={int(k): float(v) for k, v in saved.get(
                                   "lambda_after", mtp.loss.lambda_after).items()})
    now, then = lambda_at(mtp, at), lambda_at(dataclasses.replace(mtp, loss=loss), at)
    if mtp.num_steps and not math.isclose(now, then):
        note += (f"; the MTP loss weight changed: the next step's mtp.loss.lambda is {now:g}, "
                 f"{then:g} on the checkpoint's schedule")
    return note


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
