"""Build the model without ever holding it whole: meta device -> parallelize -> materialise shards.

`build_sharded_model(cfg, pstate)` constructs the plain TandemModel on the meta device (no memory),
applies the layout (pipeline pruning, TP/EP DTensor shards, FSDP2) while it is still meta, then
allocates only this rank's shards (`to_empty`) and fills them:

* parameters not read from `model.init_from` get the layout-independent initialisation of
  parallel/sharded_params.py (one process and every layout start from identical weights);
* `model.init_from` tensors are read slice by slice straight into the shards (trainer/hf/init_from);
  whatever the checkpoint lacks (new MTP layers) gets the seeded init.
* `mtp.init_from` then overwrites the MTP module (only `mtp.*`) with another checkpoint's, a Tandem
  checkpoint's or a Hugging Face directory's: an MTP refresh puts the old drafter on a trunk
  fine-tuned without it (recipes/mtp_refresh.yaml).
* buffers (rotary tables, router biases, load counts) are recomputed: `to_empty` leaves garbage.
* with `train.freeze_trunk` the trunk is materialised in `train.frozen_dtype` (the compute dtype).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from tandem.models import TandemModel

from . import safe_dcp
from .checkpoint_dirs import resolve_checkpoint
from .config_checks import ConfigError
from .hf.importer import check_hf_weights, load_hf_weights
from .hf.init_from import MTP_WIRING, checkpoint_model_config, is_hf_dir, load_initial_weights
from .parallel import parallelize_model
from .parallel.device import frozen_dtype
from .parallel.sharded_params import allocate, init_seeded
from .recipe import load_config


def frozen_trunk_to_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the (still meta, not yet sharded) frozen trunk `dtype`: it never trains, so it needs no
    fp32 master copy. Buffers keep their dtype (router biases compare in fp32)."""
    for name, p in model.named_parameters():
        if not p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)


def build_sharded_model(cfg, pstate, device: Optional[torch.device] = None) -> nn.Module:
    """This rank's part of the model, parallelized and initialised (or loaded from
    model.init_from)."""
    device = device or pstate.device.device
    with torch.device("meta"):
        model = TandemModel(cfg.model, cfg.mtp, distill=cfg.train.distill)
    if cfg.train.freeze_trunk:
        if not cfg.model.init_from and pstate.is_main:
            print("warning: train.freeze_trunk=true without model.init_from: the frozen trunk is "
                  "its random initialisation (train.seed), and the MTP module learns to draft for "
                  "it; set model.init_from to the checkpoint to fine-tune", file=sys.stderr)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("mtp."))
        frozen = frozen_dtype(cfg, pstate.device)
        if frozen is not None:
            frozen_trunk_to_dtype(model, frozen)
    model = parallelize_model(model, cfg, pstate)
    materialize(model, cfg, device)
    return model


@torch.no_grad()
def materialize(model: nn.Module, cfg, device) -> None:
    """Allocate this rank's shards of a meta model on `device` and fill them (see module
    docstring)."""
    allocate(model, device)
    if cfg.model.init_from:
        load_initial_weights(model, cfg.model.init_from,
                             mtp_init_from_last_layer=cfg.mtp.init_from_last_layer,
                             init_rest=lambda loaded: init_seeded(model, cfg.train.seed,
                                                                  skip=loaded))
    else:
        init_seeded(model, cfg.train.seed)
    # after the trunk, so it wins over whatever MTP weights model.init_from had
    if cfg.mtp.init_from:
        load_mtp_weights(model, cfg.mtp.init_from)


def mtp_checkpoint_step(path: str) -> str:
    """The step directory the Tandem checkpoint `mtp.init_from=path` (a step or run directory)
    reads; ConfigError naming the key when it is no checkpoint."""
    try:
        return os.path.abspath(resolve_checkpoint(path))
    except FileNotFoundError:
        raise ConfigError(f"config key 'mtp.init_from'={path!r} is not a Tandem checkpoint "
                          "(step_<N>/ with COMPLETE, or a run directory holding one)") from None


def mtp_checkpoint_keys(path: str) -> dict:
    """{name: global shape} of the `mtp.*` model tensors of the Tandem checkpoint at `path` (a step
    or run directory). ConfigError naming `mtp.init_from` when it is no checkpoint or holds no MTP
    module."""
    step = mtp_checkpoint_step(path)
    meta = safe_dcp.read_metadata(step).state_dict_metadata
    found = {k[len("model."):]: tuple(v.size) for k, v in meta.items()
             if k.startswith("model.mtp.") and hasattr(v, "size")}
    if not found:
        raise ConfigError(f"config key 'mtp.init_from'={path!r}: {step} holds no MTP weights "
                          "(mtp.* tensors)")
    return found



def adopt_mtp_init_from(cfg) -> list:
    """With mtp.init_from: check it holds an MTP module (before anything loads) and make this run's
    MTP wiring its (a trunk checkpoint without MTP weights leaves e.g. mtp.trunk_input at the
    recipe's, which the old drafter may not have been trained with). Returns the changes (also
    printed)."""
    if not cfg.mtp.init_from:
        return []
    path = cfg.mtp.init_from
    if is_hf_dir(path):
        # a Hugging Face directory: its MTP input convention (the rest of the MTP wiring is the
        # family's, which the load checks tensor by tensor), as model.init_from takes it
        _, wiring, has_mtp = checkpoint_model_config(path)
        if not has_mtp:
            raise ConfigError(f"config key 'mtp.init_from'={path!r}: its safetensors hold no MTP "
                              "weights")
    else:
        # the step read, recorded in config.yaml: a run directory's newest checkpoint moves on
        path = cfg.mtp.init_from = mtp_checkpoint_step(path)
        mtp_checkpoint_keys(path)
        saved = load_config(os.path.join(path, "config.yaml")).mtp
        wiring = {key: getattr(saved, key) for key in MTP_WIRING}
    changed = []
    for key, value in wiring.items():
        if getattr(cfg.mtp, key) != value:
            changed.append(f"mtp.{key}: {getattr(cfg.mtp, key)!r} -> {value!r}")
            setattr(cfg.mtp, key, value)
    try:
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(
            f"after taking the MTP module's wiring from mtp.init_from: {exc}"
        ) from None
    if is_hf_dir(path):  # its MTP tensors' names and shapes, before the data and the model
        try:
            check_hf_weights(path, cfg.model, cfg.mtp, mtp_only=True)
        except ValueError as exc:  # CheckpointError and the family checks' errors
            raise ConfigError(f"config key 'mtp.init_from'={path!r}: {exc}") from None
    if changed and int(os.environ.get("RANK", "0")) == 0:
        print(f"mtp.init_from: MTP wiring from {cfg.mtp.init_from}: " + "; ".join(changed),
              file=sys.stderr)
    return changed


@torch.no_grad()
def load_mtp_weights(model: nn.Module, path: str) -> list:
    """Read exactly the `mtp.*` parameters of `model` (plain or sharded) from the checkpoint at
    `path`, a Tandem checkpoint or a Hugging Face directory (a released model's MTP weights); the
    trunk is left as loaded. Every MTP tensor must be there with this run's shape, else one-line
    ConfigError naming `mtp.init_from`. Returns the names loaded."""
    if is_hf_dir(path):
        try:
            report = load_hf_weights(model, path, mtp_only=True)
        except ValueError as exc:  # CheckpointError and the family checks' errors
            raise ConfigError(f"config key 'mtp.init_from'={path!r}: {exc}") from None
        return sorted(report.loaded)
    saved = mtp_checkpoint_keys(path)
    # empty on pipeline stages without the MTP module: they still join dcp.load's collective
    # planning
    wanted = {k: v for k, v in get_model_state_dict(model).items() if k.startswith("mtp.")}
    bad = [f"{k} missing" for k in sorted(wanted) if k not in saved]
    bad += [f"{k} {saved[k]} vs {tuple(v.shape)}" for k, v in sorted(wanted.items())
            if k in saved and saved[k] != tuple(v.shape)]
    if bad:
        raise ConfigError(f"config key 'mtp.init_from'={path!r}: its MTP module does not fit this "
                          "run's "
                          "(match mtp.num_layers / mtp.moe and the trunk's shape): "
                          f"{'; '.join(bad[:3])}")
    safe_dcp.load({"model": wanted}, resolve_checkpoint(path))
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return sorted(wanted)
