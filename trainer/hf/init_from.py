"""`model.init_from=DIR`: start training (usually MTP fine-tuning) from an existing checkpoint.

DIR is either a Hugging Face directory (config.json + safetensors: see importer) or a Tandem
checkpoint (a `step_<N>/` directory with DCP shards, or a run directory: its newest complete one).
The trunk is loaded strictly; the MTP module is loaded when the checkpoint has MTP weights,
otherwise it keeps its fresh initialisation, or (`mtp.init_from_last_layer=true`) each MTP block
starts as a copy of the last trunk layer. `adopt_checkpoint_config` first makes the run's trunk
shape the checkpoint's, so a fine-tuning recipe does not need to repeat it. Reads go straight into
the (sharded, freshly materialised) model, slice by slice; what the checkpoint lacks is initialised
by the caller (`init_rest`). A frozen-trunk run's checkpoints point back here through
`make_reference` (path + content `fingerprint`), which `check_reference` verifies before resume,
eval and export.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Callable, FrozenSet, List, Optional, Set

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from .. import safe_dcp
from ..checkpoint_dirs import resolve_checkpoint
from ..config_checks import ConfigError
from ..recipe import load_config
from .families import detect_family, is_mtp_key, model_config_from_hf, trunk_input_of
from .importer import listed, load_hf_weights, local_tensors
from .reader import CheckpointReader, read_config, read_json

# Fields that describe the weights (taken from the checkpoint); the rest of model.* stays the run's.
_KEEP = {"init_from", "max_seq_len", "init_std", "balance", "aux_loss_coef", "bias_update_rate",
         "z_loss_coef",
         "expert_matmul", "linear_kernel", "qsa_form", "indexer_loss_coef", "indexer_warmup_steps",
         "indexer_warmup"}
_HF_BALANCE = {"balance", "aux_loss_coef"}
"""A Hugging Face family's router balancing, taken from it too: it is what the family's format holds
on export (Qwen3-MoE's softmax router has an aux loss and no bias: the run's aux-free default
trained a bias that `tandem export` then refused, after the whole fine-tune)."""


STAGE_SETTINGS = ("rope_theta", "indexer_budget", "rope_scaling", "rope_factor",
                  "rope_original_max_len", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
                  "rope_mscale_all_dim", "rope_low_freq_factor", "rope_high_freq_factor")
"""model.* fields that the checkpoint's weights were trained with but that a later stage may change
on purpose (a longer context's RoPE base or YaRN stretch, as DeepSeek-V3 extends 4K to 128K; QSA's
selection budget): model.init_from gives them unless the recipe or the overrides set them (an
override was reverted silently)."""


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def resolve_tandem_checkpoint(path: str) -> str:
    try:
        return resolve_checkpoint(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"model.init_from={path!r} is neither a Hugging Face directory (config.json) nor a "
            "Tandem checkpoint "
            "(step_<N>/ with COMPLETE, or a run directory holding one)") from None


def serving_origin(path: str) -> str:
    """The Hugging Face directory a model came from, following `path` (a `model.init_from`, or a
    Tandem checkpoint) back: itself when it is one; for a Tandem checkpoint (a step, or a run's
    newest), its frozen trunk's reference, else the `model.init_from` its run started from. Its
    serving files (generation_config.json's end-of-turn ids, the context length) then reach a
    model fine-tuned in several stages, as they reach one fine-tuned once. "" when the chain ends
    elsewhere: a run trained from scratch, or a link that is gone."""
    seen = set()
    while path and path not in seen:
        if is_hf_dir(path):
            return path
        seen.add(path)
        try:
            step = resolve_checkpoint(path)
        except FileNotFoundError:
            return ""
        ref = read_reference(step)
        path = ref["path"] if ref else str(
            load_config(os.path.join(step, "config.yaml")).model.init_from or "")
    return ""


MTP_WIRING = ("num_layers", "style", "moe", "combine", "concat_order", "trunk_input")
"""MTPConfig fields that decide an MTP module's weights and how they are wired: a run that loads a
checkpoint's MTP module (model.init_from, mtp.init_from) takes them from it."""


def checkpoint_model_config(path: str):
    """(ModelConfig of the checkpoint, its MTP wiring {field: value}, has MTP weights). A Hugging
    Face directory's wiring is its trunk_input convention; the rest is its family's, which the
    load checks tensor by tensor."""
    if is_hf_dir(path):
        hf = read_config(path)
        detect_family(hf)
        reader = CheckpointReader(path)
        keys = reader.keys()
        reader.close()
        spec = detect_family(hf, keys)
        cfg = model_config_from_hf(hf, spec)
        has_mtp = any(is_mtp_key(k, cfg) for k in keys)
        return cfg, {"trunk_input": trunk_input_of(hf)}, has_mtp

    step = resolve_tandem_checkpoint(path)
    saved = load_config(os.path.join(step, "config.yaml"))
    wiring = {key: getattr(saved.mtp, key) for key in MTP_WIRING}
    return saved.model, wiring, saved.mtp.num_steps > 0


def adopt_checkpoint_config(cfg, explicit: FrozenSet[str] = frozenset()) -> List[str]:
    """Overwrite cfg.model's weight-shape fields, and the MTP wiring when the checkpoint has MTP
    weights (which then load into this run's module), with the checkpoint's; revalidate; return
    the keys that changed (also printed). `explicit`: the keys the run set itself
    (recipe.explicit_keys), which keep their value among `STAGE_SETTINGS`."""
    ckpt, wiring, has_mtp = checkpoint_model_config(cfg.model.init_from)
    keep = _KEEP - _HF_BALANCE if is_hf_dir(cfg.model.init_from) else _KEEP
    changed = []
    for key, value in vars(ckpt).items():
        if key in keep or getattr(cfg.model, key) == value:
            continue
        if key in STAGE_SETTINGS and f"model.{key}" in explicit:
            if cfg.train.freeze_trunk:
                raise ConfigError(f"model.{key}={getattr(cfg.model, key)!r} differs from the "
                                  f"frozen trunk's {value!r} (model.init_from): a frozen trunk "
                                  "runs as it was trained; leave the key unset, or train the trunk")
            changed.append(f"model.{key}: {getattr(cfg.model, key)!r} as set (the checkpoint's "
                           f"{value!r})")
            continue
        changed.append(f"model.{key}: {getattr(cfg.model, key)!r} -> {value!r}")
        setattr(cfg.model, key, value)
    warmup = cfg.model.indexer_warmup_steps
    trained_drafter = (has_mtp or cfg.mtp.init_from or cfg.mtp.init_from_last_layer
                       or not cfg.mtp.num_steps)
    if (ckpt.uses_qsa and warmup and trained_drafter
            and "model.indexer_warmup_steps" not in explicit):
        # its indexers come trained (the drafter's too): the flavor's warm-up again would attend
        # densely for it and, under `auto` (indexer_only), hold every other weight still
        changed.append(f"model.indexer_warmup_steps: {warmup} -> 0 (the checkpoint's QSA "
                       "indexers are trained; set it to warm them up again)")
        cfg.model.indexer_warmup_steps = 0
    # Qwen4-Exp's drafter always reads the pre-mixer streams, with or without MTP weights in the
    # checkpoint; saved MTP weights run only as they were wired
    for key, value in wiring.items() if has_mtp else (
            [("trunk_input", wiring["trunk_input"])] if ckpt.hc_count > 1 else []):
        if getattr(cfg.mtp, key) != value:
            changed.append(f"mtp.{key}: {getattr(cfg.mtp, key)!r} -> {value!r}")
            setattr(cfg.mtp, key, value)
    try:
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"after taking the model shape from model.init_from: {exc}") from None
    if changed and int(os.environ.get("RANK", "0")) == 0:
        print(f"init_from: model shape from {cfg.model.init_from}: " + "; ".join(changed),
              file=sys.stderr)
    return changed


@torch.no_grad()
def init_mtp_from_last_layer(model: nn.Module) -> None:
    """Copy the last trunk layer's weights into every MTP block (same names under `block.`). A
    pipeline placement that puts an MTP depth on a stage without the last trunk layer is refused:
    the copy would take the last layer that stage holds, or none."""
    tensors = local_tensors(model)
    last = model.cfg.num_layers - 1
    prefix = f"layers.{last}."
    if any(n.startswith("mtp.layers.") for n in tensors) and not any(
            n.startswith(prefix) for n in tensors):
        raise ValueError(f"mtp.init_from_last_layer: this pipeline stage holds MTP layers but not "
                         f"the last trunk layer (layers.{last}) to copy; place an MTP depth with "
                         "it (parallel.pp_layout / parallel.pp_depth_stages) or leave the option "
                         "off")
    for name, t in tensors.items():
        if not (name.startswith("mtp.layers.") and ".block." in name):
            continue
        src = prefix + name.split(".block.", 1)[1]
        if src not in tensors:
            raise ValueError(f"mtp.init_from_last_layer: {name} has no counterpart {src} (MTP "
                             "block and last trunk "
                             "layer differ: dense vs MoE? set mtp.moe to match)")
        if tensors[src].shape != t.shape:
            raise ValueError(f"mtp.init_from_last_layer: {src} {tuple(tensors[src].shape)} vs "
                             f"{name} {tuple(t.shape)}")
        t.copy_(tensors[src])


def load_tandem_weights(model: nn.Module, path: str) -> List[str]:
    """Load a Tandem DCP checkpoint's model weights: the trunk strictly, the MTP module if the
    checkpoint has it (names and shapes must then match). A frozen-trunk fine-tune's checkpoint
    holds its MTP module only: the trunk comes from the checkpoint it references (unchanged since,
    check_reference). Returns the names loaded."""
    step = resolve_tandem_checkpoint(path)
    saved = set(safe_dcp.read_metadata(step).state_dict_metadata)
    saved = {k[len("model."):] for k in saved if k.startswith("model.")}
    ref = read_reference(step)
    trunk = set()
    if ref is not None:
        check_reference(ref, step)
        trunk = ({k for k in load_hf_weights(model, ref["path"]).loaded if not k.startswith("mtp.")}
                 if is_hf_dir(ref["path"]) else set(load_tandem_weights(model, ref["path"])))
        saved |= trunk
    state = get_model_state_dict(model)
    trunk_missing = [k for k in state if not k.startswith("mtp.") and k not in saved]
    if trunk_missing:
        raise ValueError(f"{step} lacks trunk tensors ({len(trunk_missing)}): "
                         f"{listed(sorted(trunk_missing))}")
    has_mtp = any(k.startswith("mtp.") for k in saved)
    wanted = {k: v for k, v in state.items()
              if k not in trunk and (not k.startswith("mtp.") or has_mtp)}
    if has_mtp:
        mtp_missing = [k for k in wanted if k.startswith("mtp.") and k not in saved]
        if mtp_missing:
            raise ValueError(f"{step}'s MTP module differs from this run's (missing "
                             f"{listed(sorted(mtp_missing))}); "
                             "match mtp.num_layers / mtp.moe or start from an export without MTP")
    safe_dcp.load({"model": wanted}, step)
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return list(wanted) + sorted(trunk)


def load_initial_weights(
    model: nn.Module,
    path: str,
    *,
    mtp_init_from_last_layer: Optional[bool] = None,
    trust_pickle: bool = False,
    init_rest: Optional[Callable[[Set[str]], None]] = None,
) -> Set[str]:
    """Initialise `model` (plain or sharded) from `path`; see the module docstring.
    `init_rest(loaded)` initialises what the checkpoint did not provide (the trainer's seeded init),
    before the MTP blocks are copied from the last trunk layer. Returns the names loaded."""
    if mtp_init_from_last_layer is None:
        mtp_init_from_last_layer = getattr(getattr(model, "mtp_cfg", None), "init_from_last_layer",
                                           False)
    if is_hf_dir(path):
        report = load_hf_weights(model, path, trust_pickle=trust_pickle)
        loaded, has_mtp = set(report.loaded), not report.fresh_mtp
    else:
        loaded = set(load_tandem_weights(model, path))
        has_mtp = any(k.startswith("mtp.") for k in loaded)
    if init_rest is not None:
        init_rest(loaded)
    if getattr(model, "mtp", None) is not None and not has_mtp:
        if mtp_init_from_last_layer:
            init_mtp_from_last_layer(model)
        if int(os.environ.get("RANK", "0")) == 0:
            how = (
                "copied from the last trunk layer"
                if mtp_init_from_last_layer
                else ("freshly initialised")
            )
            print(f"init_from: {path} has no MTP weights; the MTP module is {how}", file=sys.stderr)
    return loaded


# --------------------------------------------------------------------------------------------------
# frozen-trunk checkpoints: a fingerprinted reference to the checkpoint the trunk comes from
# --------------------------------------------------------------------------------------------------
REFERENCE_FILE = "frozen_trunk.json"
_SAMPLES, _SAMPLE_BYTES = 16, 4096


def _weight_files(path: str) -> List[str]:
    if is_hf_dir(path):
        names = [n for n in os.listdir(path) if n.endswith((".safetensors", ".bin", ".pt", ".pth"))
                 or n in ("config.json", "model.safetensors.index.json")]
    else:
        names = [n for n in os.listdir(path) if n.endswith(".distcp") or n == ".metadata"]
    return sorted(names)


def fingerprint(path: str) -> str:
    """A cheap content fingerprint of the weights in `path` (an HF directory or a Tandem step
    directory): sha256 over each weight file's name, size, first 64 KiB (the safetensors header:
    every name, dtype, shape and offset; DCP's metadata file is hashed whole) and 16 evenly spaced 4
    KiB samples plus the last 4 KiB. Any re-save of other weights (fine-tuned values, other shapes,
    a truncated copy) changes it; copying the directory elsewhere (new mtimes) does not. It reads
    well under 1 MiB per file, so a 200 GB checkpoint is fingerprinted in a moment."""
    h = hashlib.sha256()
    for name in _weight_files(path):
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        h.update(f"{name}\0{size}\0".encode())
        with open(file, "rb") as f:
            if name in (".metadata", "config.json", "model.safetensors.index.json"):
                h.update(f.read())
                continue
            h.update(f.read(64 << 10))
            for i in range(_SAMPLES + 1):
                f.seek(max(0, (size - _SAMPLE_BYTES) * i // _SAMPLES))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def resolve_init_from(path: str) -> str:
    """The directory whose weights `model.init_from=path` reads (a run directory's newest
    checkpoint)."""
    return os.path.abspath(path if is_hf_dir(path) else resolve_tandem_checkpoint(path))


def make_reference(init_from: str) -> dict:
    resolved = resolve_init_from(init_from)
    return {"path": resolved, "fingerprint": fingerprint(resolved)}


def read_reference(step_dir: str) -> Optional[dict]:
    """The frozen-trunk reference a checkpoint holds (None: the checkpoint is whole)."""
    file = os.path.join(step_dir, REFERENCE_FILE)
    if not os.path.isfile(file):
        return None
    return read_json(file)


def check_reference(ref: dict, checkpoint: str) -> None:
    """Refuse, in one line naming the path, a reference whose checkpoint is gone or changed."""
    path = ref["path"]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {checkpoint} holds only the MTP module; its frozen "
                                "trunk "
                                f"{path} (model.init_from) is gone")
    if fingerprint(path) != ref["fingerprint"]:
        raise ValueError(f"checkpoint {checkpoint} holds only the MTP module; its frozen trunk "
                         f"{path} "
                         "(model.init_from) changed since it was saved (content fingerprint "
                         "differs)")
