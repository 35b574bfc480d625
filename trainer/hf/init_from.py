"""`model.init_from=DIR`: start training (usually MTP fine-tuning) from an existing checkpoint.

DIR is either a Hugging Face directory (config.json + safetensors: see importer) or a Tandem
checkpoint (a `step_<N>/` directory with DCP shards, or a run directory: its newest complete one).
The trunk is loaded strictly; the MTP module is loaded when the checkpoint has MTP weights, otherwise
it keeps its fresh initialisation, or (`mtp.init_from_last_layer=true`) each MTP block starts as a copy
of the last trunk layer. `adopt_checkpoint_config` first makes the run's trunk shape the checkpoint's,
so a fine-tuning recipe does not need to repeat it.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import torch
from torch import nn

# Fields that describe the weights (taken from the checkpoint); the rest of model.* stays the run's.
_KEEP = {"init_from", "max_seq_len", "init_std", "balance", "aux_loss_coef", "bias_update_rate", "z_loss_coef"}


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def resolve_tandem_checkpoint(path: str) -> str:
    from ..checkpoint import MARKER, latest_checkpoint

    if os.path.exists(os.path.join(path, MARKER)):
        return path
    found = latest_checkpoint(path, report=False)
    if found is None:
        raise FileNotFoundError(
            f"model.init_from={path!r} is neither a Hugging Face directory (config.json) nor a Tandem checkpoint "
            "(step_<N>/ with COMPLETE, or a run directory holding one)")
    return found[1]


def checkpoint_model_config(path: str):
    """(ModelConfig of the checkpoint, MTP trunk_input convention or None, has MTP weights)."""
    if is_hf_dir(path):
        from .families import detect_family, is_mtp_key, model_config_from_hf, trunk_input_of
        from .importer import CheckpointReader, read_config

        hf = read_config(path)
        detect_family(hf)
        reader = CheckpointReader(path)
        keys = reader.keys()
        reader.close()
        spec = detect_family(hf, keys)
        cfg = model_config_from_hf(hf, spec)
        has_mtp = any(is_mtp_key(k, cfg) for k in keys)
        return cfg, trunk_input_of(hf), has_mtp
    from ..config import load_config

    step = resolve_tandem_checkpoint(path)
    saved = load_config(os.path.join(step, "config.yaml"))
    return saved.model, saved.mtp.trunk_input, saved.mtp.num_steps > 0


def adopt_checkpoint_config(cfg) -> List[str]:
    """Overwrite cfg.model's weight-shape fields (and mtp.trunk_input when the checkpoint has MTP weights)
    with the checkpoint's; revalidate; return the keys that changed (also printed)."""
    from ..config import ConfigError, validate

    ckpt, trunk_input, has_mtp = checkpoint_model_config(cfg.model.init_from)
    changed = []
    for key, value in vars(ckpt).items():
        if key in _KEEP or getattr(cfg.model, key) == value:
            continue
        changed.append(f"model.{key}: {getattr(cfg.model, key)!r} -> {value!r}")
        setattr(cfg.model, key, value)
    if has_mtp and cfg.mtp.trunk_input != trunk_input:
        changed.append(f"mtp.trunk_input: {cfg.mtp.trunk_input!r} -> {trunk_input!r}")
        cfg.mtp.trunk_input = trunk_input
    try:
        validate(cfg)
    except ConfigError as exc:
        raise ConfigError(f"after taking the model shape from model.init_from: {exc}") from None
    if changed and int(os.environ.get("RANK", "0")) == 0:
        print(f"init_from: model shape from {cfg.model.init_from}: " + "; ".join(changed), file=sys.stderr)
    return changed


@torch.no_grad()
def init_mtp_from_last_layer(model: nn.Module) -> None:
    """Copy the last trunk layer's weights into every MTP block (same names under `block.`)."""
    from .importer import local_tensors

    tensors = local_tensors(model)
    last = max(int(n.split(".")[1]) for n in tensors if n.startswith("layers."))
    prefix = f"layers.{last}."
    for name, t in tensors.items():
        if not (name.startswith("mtp.layers.") and ".block." in name):
            continue
        src = prefix + name.split(".block.", 1)[1]
        if src not in tensors:
            raise ValueError(f"mtp.init_from_last_layer: {name} has no counterpart {src} (MTP block and last trunk "
                             "layer differ: dense vs MoE? set mtp.moe to match)")
        if tensors[src].shape != t.shape:
            raise ValueError(f"mtp.init_from_last_layer: {src} {tuple(tensors[src].shape)} vs {name} {tuple(t.shape)}")
        t.copy_(tensors[src])


def load_tandem_weights(model: nn.Module, path: str) -> bool:
    """Load a Tandem DCP checkpoint's model weights: the trunk strictly, the MTP module if the checkpoint
    has it (names and shapes must then match). Returns whether MTP weights were loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    step = resolve_tandem_checkpoint(path)
    saved = set(dcp.FileSystemReader(step).read_metadata().state_dict_metadata)
    saved = {k[len("model."):] for k in saved if k.startswith("model.")}
    state = get_model_state_dict(model)
    trunk_missing = [k for k in state if not k.startswith("mtp.") and k not in saved]
    if trunk_missing:
        raise ValueError(f"{step} lacks trunk tensors: {', '.join(sorted(trunk_missing))}")
    has_mtp = any(k.startswith("mtp.") for k in saved)
    wanted = {k: v for k, v in state.items() if not k.startswith("mtp.") or has_mtp}
    if has_mtp:
        mtp_missing = [k for k in wanted if k.startswith("mtp.") and k not in saved]
        if mtp_missing:
            raise ValueError(f"{step}'s MTP module differs from this run's (missing {', '.join(sorted(mtp_missing))}); "
                             "match mtp.num_layers / mtp.moe or start from an export without MTP")
    dcp.load({"model": wanted}, checkpoint_id=step)
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return has_mtp


def load_initial_weights(model: nn.Module, path: str, *, mtp_init_from_last_layer: Optional[bool] = None,
                         trust_pickle: bool = False) -> None:
    """Initialise `model` (plain or sharded) from `path`; see the module docstring."""
    if mtp_init_from_last_layer is None:
        mtp_init_from_last_layer = getattr(getattr(model, "mtp_cfg", None), "init_from_last_layer", False)
    if is_hf_dir(path):
        from .importer import load_hf_weights

        report = load_hf_weights(model, path, trust_pickle=trust_pickle)
        has_mtp = not report.fresh_mtp
    else:
        has_mtp = load_tandem_weights(model, path)
    if getattr(model, "mtp", None) is not None and not has_mtp:
        if mtp_init_from_last_layer:
            init_mtp_from_last_layer(model)
        if int(os.environ.get("RANK", "0")) == 0:
            how = "copied from the last trunk layer" if mtp_init_from_last_layer else "freshly initialised"
            print(f"init_from: {path} has no MTP weights; the MTP module is {how}", file=sys.stderr)
