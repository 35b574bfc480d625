"""Import Hugging Face checkpoints (config.json + safetensors, sharded index included) into
TandemModel.

    model, cfg = load_hf_model(dir)            # builds the model from config.json
    report = load_hf_weights(model, dir)       # loads into an existing (possibly sharded) model

Only safetensors are read by default; a pickle checkpoint (`*.bin`, `*.pt`) needs
`trust_pickle=True` (the Python API only: no command takes it), because unpickling runs arbitrary
code. Every tensor is read slice by slice with plain reads of its byte ranges (no memory map): a
DTensor parameter (TP/EP/FSDP-sharded) reads only its local shard
(`compute_local_shape_and_global_offset`), a plain tensor reads everything, and a pipeline stage
that holds a subset of the layers reads only those.
Errors name what is wrong: the architecture, missing/unexpected tensor names, shapes (name,
expected, found; the first few of each list, and how many more) and a tokenizer that does not load
or is larger than the embedding table. The reading itself (files, byte
ranges, pickle refusal, `CheckpointError`) is trainer/hf/reader.py's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig, validate_model

from ..config import TandemConfig
from ..parallel.sharded_params import (  # noqa: F401 (shard_index: API)
    allocate,
    init_seeded,
    local_target,
    shard_index,
    unwrapped_name,
)
from .families import (
    DRAFT_STEPS_KEY,
    FamilySpec,
    Src,
    UnsupportedCheckpoint,
    detect_family,
    hf_name,
    ignorable_key,
    is_mtp_key,
    meta_state,
    model_config_from_hf,
    mtp_layer_of_key,
    trunk_input_of,
)
from .qwen4_exp import is_ple_buffer
from .reader import CheckpointError, CheckpointReader, read_config


def tokenizer_file_size(file: str) -> int:
    """Vocabulary size (ids are below it, added tokens included) of a tokenizer.json;
    CheckpointError naming the file if it is not one."""
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(file).get_vocab(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot read tokenizer file {file}: {first}") from None
    return max(len(vocab), max(vocab.values(), default=-1) + 1)


def tokenizer_vocab_size(path: str) -> Optional[int]:
    """Vocabulary size of a tokenizer saved beside the checkpoint (None if there is none)."""
    tj = os.path.join(path, "tokenizer.json")
    return tokenizer_file_size(tj) if os.path.isfile(tj) else None


def check_tokenizer(path: str, vocab_size: int) -> None:
    size = tokenizer_vocab_size(path)
    if size is not None and size > vocab_size:
        raise CheckpointError(
            f"tokenizer/vocab mismatch: {path}/tokenizer.json has {size} tokens but the model's "
            "vocab_size is "
            f"{vocab_size}")


def listed(items: Sequence[str], limit: int = 4, sep: str = ", ") -> str:
    """The first `limit` of `items`, comma-separated, then how many more: an error stays one
    readable line however many tensors are wrong."""
    more = len(items) - limit
    return sep.join(items[:limit]) + (f"{sep}and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------------------------------
def read_source(reader: CheckpointReader, src: Src, index: Tuple[slice, ...],
                global_shape: Sequence[int]) -> torch.Tensor:
    """Read `index` (a global slice of this model's tensor) from its checkpoint source."""
    # Gated DeltaNet's qkv rows, MLA's rotary rows: read whole, permute, then slice
    if src.permutes_rows:
        out = src.to_model_rows(reader.read(src.keys[0], (slice(None),)))[tuple(index)]
    # eh_proj: read this shard's rows whole, swap the column halves, then slice
    elif src.swap_halves:
        rows = reader.read(src.keys[0], (index[0],))
        half = rows.shape[1] // 2
        out = torch.cat([rows[:, half:], rows[:, :half]], dim=1)[(slice(None),) + tuple(index[1:])]
    elif src.concat:  # row blocks of dim 0 in consecutive keys: read the blocks this slice overlaps
        r0, r1 = index[0].indices(global_shape[0])[:2]
        parts, start = [], 0
        for key in src.keys:
            n = reader.shape(key)[0]
            lo, hi = max(r0, start), min(r1, start + n)
            if lo < hi:
                parts.append(reader.read(key, (slice(lo - start, hi - start),) + tuple(index[1:])))
            start += n
        out = (
            torch.cat(parts)
            if parts
            else torch.empty(
                0, *[len(range(*s.indices(g))) for s, g in zip(index[1:], global_shape[1:])]
            )
        )
    elif src.stacked:
        rows = range(*index[0].indices(len(src.keys)))
        parts = [reader.read(src.keys[e], index[1:]) for e in rows]
        out = (
            torch.stack(parts)
            if parts
            else torch.empty(
                0, *[len(range(*s.indices(g))) for s, g in zip(index[1:], global_shape[1:])]
            )
        )
    else:
        out = reader.read(src.keys[0], index)
    if src.plus_one:
        out = out.float() + 1.0
    return out


def source_shape(reader: CheckpointReader, src: Src) -> Tuple[int, ...]:
    if src.stacked:
        return (len(src.keys),) + reader.shape(src.keys[0])
    if src.concat:
        first = reader.shape(src.keys[0])
        return (sum(reader.shape(k)[0] for k in src.keys),) + tuple(first[1:])
    return reader.shape(src.keys[0])


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    loaded: List[str] = field(default_factory=list)
    """This model's tensors that were read."""
    fresh_mtp: bool = False
    """The checkpoint had no MTP weights for this model's MTP module (left as initialised)."""
    ignored: List[str] = field(default_factory=list)
    """Checkpoint keys deliberately not loaded (duplicates, extra MTP layers)."""


def local_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's parameters and persistent router-bias buffers, by unwrapped name."""
    out = {unwrapped_name(n): p for n, p in model.named_parameters()}
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias") or is_ple_buffer(n):
            out[unwrapped_name(n)] = b
    return out


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str, *, spec: Optional[FamilySpec] = None,
                    trust_pickle: bool = False,
                    cfg: Optional[ModelConfig] = None, mtp: Optional[MTPConfig] = None,
                    strict_mtp: bool = False, mtp_only: bool = False,
                    reader: Optional[CheckpointReader] = None) -> LoadReport:
    """Load an HF checkpoint into `model` (a TandemModel, possibly sharded/partial). Trunk tensors
    are strict; MTP tensors load when the checkpoint has them, else the MTP module keeps its fresh
    init (`strict_mtp=True` makes their absence an error). `mtp_only`: the checkpoint is checked
    as a whole against this model's shape, but only its MTP tensors are read (an MTP refresh,
    `mtp.init_from`: the trunk is another's); their absence is an error."""
    cfg = cfg or getattr(model, "cfg", None)
    mtp = mtp or getattr(model, "mtp_cfg", None)
    hf = read_config(path)
    detect_family(hf)  # an unsupported family is named before any shard is opened
    own_reader = reader is None
    reader = reader or CheckpointReader(path, trust_pickle=trust_pickle)
    try:
        spec, needed, full, report = _checked_sources(path, hf, reader, cfg, mtp, spec,
                                                      strict_mtp, mtp_only)
        targets = local_tensors(model)
        _copy_local_shards(targets, reader, needed, full, report)
        # no correction bias in the family: routing must not use a stale one
        if spec.name == "qwen3_moe":
            for name, t in targets.items():
                read_here = not mtp_only or name.startswith("mtp.")
                if name.endswith("e_score_correction_bias") and read_here:
                    local_target(t)[0].zero_()
        return report
    finally:
        if own_reader:
            reader.close()


def check_hf_weights(path: str, cfg: ModelConfig, mtp: Optional[MTPConfig], *,
                     mtp_only: bool = False, trust_pickle: bool = False) -> None:
    """Every check `load_hf_weights` makes before it reads a tensor (the family, the shape, the
    tokenizer, each tensor's name and shape), from config.json and the shards' headers alone: a
    fine-tune calls it before it builds its data and allocates its model, which a checkpoint that
    lacks one tensor made it do first."""
    hf = read_config(path)
    detect_family(hf)
    reader = CheckpointReader(path, trust_pickle=trust_pickle)
    try:
        _checked_sources(path, hf, reader, cfg, mtp, None, False, mtp_only)
    finally:
        reader.close()


def _checked_sources(path: str, hf: dict, reader: CheckpointReader, cfg: ModelConfig,
                     mtp: Optional[MTPConfig], spec: Optional[FamilySpec], strict_mtp: bool,
                     mtp_only: bool) -> Tuple[FamilySpec, Dict[str, Src], Dict[str, torch.Size],
                                              LoadReport]:
    """(family, the source of each model tensor to read, the full model's shapes, the report so
    far), once the checkpoint (its config.json `hf`) passed every check that needs no tensor
    read."""
    keys = set(reader.keys())
    spec = spec or detect_family(hf, list(keys))
    want = model_config_from_hf(hf, spec, max_seq_len=cfg.max_seq_len)
    _check_same_shape(want, cfg, path, mtp)
    check_tokenizer(path, cfg.vocab_size)
    full = meta_state(cfg, mtp)  # the whole model, even if this rank holds a part of it
    report = LoadReport()
    mtp_keys = {k for k in keys if is_mtp_key(k, cfg) and not ignorable_key(k, cfg, spec)}
    has_mtp_weights = bool(mtp_keys)
    if mtp_only and not has_mtp_weights:
        raise CheckpointError(f"{path} holds no MTP weights ({spec.name} MTP tensors)")
    needed = _needed_sources(full, cfg, mtp, spec, has_mtp_weights, strict_mtp or mtp_only, report)
    if has_mtp_weights and mtp is not None and mtp.num_steps and mtp.trunk_input != trunk_input_of(
            hf):
        raise CheckpointError(
            f"{path}'s MTP weights read the {trunk_input_of(hf)} trunk state but "
            f"mtp.trunk_input={mtp.trunk_input!r}; set mtp.trunk_input={trunk_input_of(hf)}")
    _check_names(path, keys, needed, mtp_keys, cfg, mtp, spec, report)
    if mtp_only:
        needed = {name: src for name, src in needed.items() if name.startswith("mtp.")}
    _check_source_shapes(path, reader, needed, full)
    return spec, needed, full, report


def _needed_sources(full: Dict[str, torch.Size], cfg: ModelConfig, mtp: Optional[MTPConfig],
                    spec: FamilySpec,
                    has_mtp_weights: bool, strict_mtp: bool, report: LoadReport) -> Dict[str, Src]:
    """The checkpoint source of each model tensor to load. Without MTP weights in the checkpoint the
    MTP tensors are left out (`report.fresh_mtp`) unless `strict_mtp`."""
    sources = {name: hf_name(name, cfg, mtp, spec) for name in full}
    needed: Dict[str, Src] = {}
    for name, src in sources.items():
        if src is None:
            continue
        if name.startswith("mtp.") and not has_mtp_weights and not strict_mtp:
            report.fresh_mtp = True
            continue
        needed[name] = src
    return needed


def _check_names(path: str, keys: set, needed: Dict[str, Src], mtp_keys: set, cfg: ModelConfig,
                 mtp: Optional[MTPConfig], spec: FamilySpec, report: LoadReport) -> None:
    """Raise CheckpointError listing the needed tensors the checkpoint lacks and the checkpoint's
    tensors nothing reads; those unread on purpose go to `report.ignored`."""
    missing = [k for src in needed.values() for k in src.keys if k not in keys]
    used = {k for src in needed.values() for k in src.keys}
    unexpected = []
    for k in sorted(keys - used):
        if ignorable_key(k, cfg, spec):
            report.ignored.append(k)
        elif k in mtp_keys and (mtp is None or mtp.num_steps == 0
                                or mtp_layer_of_key(k, cfg) >= mtp.num_layers):
            report.ignored.append(k)  # MTP layers this model does not have
        else:
            unexpected.append(k)
    held = len({mtp_layer_of_key(k, cfg) for k in mtp_keys})
    if (missing and mtp is not None and 0 < held < mtp.num_layers
            and all(mtp_layer_of_key(k, cfg) >= held for k in missing)):  # only layers past them
        raise CheckpointError(f"{path} holds {held} MTP layer(s), and mtp.num_layers="
                              f"{mtp.num_layers} asks for more: set mtp.num_layers={held} (a "
                              "looped module drafts any number of steps with them)")
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {listed(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {listed(unexpected)}")
        raise CheckpointError(f"{path} does not match a {spec.name} model of this shape: "
                              + "; ".join(parts))


def _check_source_shapes(path: str, reader: CheckpointReader, needed: Dict[str, Src],
                         full: Dict[str, torch.Size]) -> None:
    """Raise CheckpointError naming the first needed tensors whose checkpoint shape differs from the
    model's, and how many more."""
    mismatched = []
    for name, src in needed.items():
        found = source_shape(reader, src)
        if tuple(found) != tuple(full[name]):
            mismatched.append(f"{src.keys[0] if not src.stacked else src.keys[0] + ' (stacked)'} "
                              f"-> {name}: "
                              f"expected {tuple(full[name])}, found {tuple(found)}")
    if mismatched:
        raise CheckpointError(f"shape mismatch in {path} ({len(mismatched)} tensors): "
                              + listed(mismatched, 3, "; "))


def _copy_local_shards(targets: Dict[str, torch.Tensor], reader: CheckpointReader,
                       needed: Dict[str, Src],
                       full: Dict[str, torch.Size], report: LoadReport) -> None:
    """Read this rank's slice of each needed tensor it holds (`targets`: `local_tensors`) into it;
    the names read go to `report.loaded`."""
    for name, src in needed.items():
        if name not in targets:  # another pipeline stage holds it
            continue
        local, index = local_target(targets[name])
        value = read_source(reader, src, index, full[name])
        local.copy_(value.to(local.dtype))
        report.loaded.append(name)


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "resolved_head_dim",
                 "intermediate_size", "num_experts", "moe_intermediate_size", "num_shared_experts",
                 "first_k_dense", "qk_norm", "attention_bias", "tie_embeddings")
_ROUTING_FIELDS = ("top_k", "router_score", "norm_topk_prob", "routed_scaling_factor", "n_group",
                   "topk_group")
_MATH_FIELDS = _ROUTING_FIELDS + ("partial_rotary_factor",)
"""Not compared: init_from.STAGE_SETTINGS (the RoPE base, YaRN, QSA's budget), which a later stage
sets on purpose over the weights of an earlier one."""
_MLA_FIELDS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""MLA's widths, in use when model.kv_lora_rank > 0 (which is always compared)."""


def _fields_in_use(cfg: ModelConfig, mtp: Optional[MTPConfig]) -> Tuple[str, ...]:
    """The shape and routing fields that some tensor or op of this model depends on: without routed
    experts none of the MoE ones, and the dense MLP width only where a dense MLP is (a dense trunk,
    its first_k_dense layers, a dense MTP layer). A checkpoint that differs only in a field no
    tensor uses (Hugging Face configs fill them differently from Tandem's defaults) fits."""
    moe = cfg.num_experts > 0
    dense_mlp = not moe or cfg.first_k_dense > 0 or bool(mtp and mtp.num_steps and not mtp.moe)
    unused = set() if moe else {"moe_intermediate_size", "num_shared_experts", "first_k_dense",
                                *_ROUTING_FIELDS}
    if not dense_mlp:
        unused.add("intermediate_size")
    if not cfg.uses_head_dim:  # MLA's widths are its own (compared below)
        unused.add("resolved_head_dim")
    extra = ("kv_lora_rank",) + (_MLA_FIELDS if cfg.kv_lora_rank else ())
    return tuple(f for f in _SHAPE_FIELDS + _MATH_FIELDS + extra if f not in unused)


def _check_same_shape(want: ModelConfig, have: ModelConfig, path: str,
                      mtp: Optional[MTPConfig] = None) -> None:
    if want.vocab_size != have.vocab_size:
        raise CheckpointError(
            f"tokenizer/vocab mismatch: {path} has vocab_size={want.vocab_size} but "
            f"model.vocab_size={have.vocab_size}")
    diffs = []
    for key in _fields_in_use(have, mtp):
        a, b = getattr(want, key), getattr(have, key)
        if a != b and not (isinstance(a, float) and abs(a - b) < 1e-9 * max(1.0, abs(a))):
            diffs.append(f"model.{key}: checkpoint {a!r} vs model {b!r}")
    if diffs:
        raise CheckpointError(f"{path} has a different model shape: " + listed(diffs, 6, "; "))


def hf_config(path: str, mtp_overrides: Optional[dict] = None, *, trust_pickle: bool = False,
              max_seq_len: Optional[int] = None, reader: Optional[CheckpointReader] = None,
              hf: Optional[dict] = None):
    """(TandemConfig, FamilySpec) of an HF directory: the trunk from its config.json, the MTP module
    its weights hold (num_nextn_predict_layers / mtp.*: L of them, drafting the K a Tandem export
    recorded under DRAFT_STEPS_KEY, else K = L; or none); `mtp_overrides`
    (MTPConfig field -> value, e.g. {"num_steps": 3, "num_layers": 1}) adjusts that. Reads the
    tensor names, not the weights. `reader` / `hf`: the caller's open reader and config.json's
    contents (`read_config`), when it has them."""
    hf = read_config(path) if hf is None else hf
    # an unsupported architecture or option fails before any file is opened
    model_config_from_hf(hf, detect_family(hf), max_seq_len)
    own_reader = reader is None
    reader = reader or CheckpointReader(path, trust_pickle=trust_pickle)
    try:
        keys = reader.keys()
        spec = detect_family(hf, keys)
        cfg = model_config_from_hf(hf, spec, max_seq_len=max_seq_len)
    finally:
        if own_reader:
            reader.close()
    n_mtp = len({mtp_layer_of_key(k, cfg) for k in keys
                 if is_mtp_key(k, cfg) and not ignorable_key(k, cfg, spec)})
    # an export of a looped module records the K it was trained at, past its layers
    steps = int(hf.get(DRAFT_STEPS_KEY, n_mtp)) if n_mtp else 0
    mtp = MTPConfig(num_steps=steps, num_layers=max(n_mtp, 1), moe=cfg.num_experts > 0,
                    concat_order="emb_hidden", trunk_input=trunk_input_of(hf))
    if n_mtp and not any(k.startswith(f"model.layers.{cfg.num_layers}.mlp.experts.")
                         or k.startswith("mtp.layers.0.mlp.experts.") for k in keys):
        mtp.moe = False
    if n_mtp and spec.name == "qwen4_exp":  # whether depths 2..K reuse depth 1's QSA selection, as
        # the export records it and vLLM reads it (default off); it was left at Tandem's default on
        mtp.qsa_reuse_indices = bool(hf.get("index_share_for_mtp_iteration", False))
    for key, value in (mtp_overrides or {}).items():
        if not hasattr(mtp, key):
            raise KeyError(f"unknown MTPConfig field {key!r}")
        setattr(mtp, key, value)
    validate_model(cfg, mtp)
    tcfg = TandemConfig()
    tcfg.model, tcfg.mtp = cfg, mtp
    return tcfg, spec


def load_hf_model(path: str, mtp_overrides: Optional[dict] = None, *, trust_pickle: bool = False,
                  max_seq_len: Optional[int] = None, device: str = "cpu"):
    """Build a TandemModel from an HF directory's config.json (`hf_config`) and load its weights.
    Returns (model in eval mode, TandemConfig). `max_seq_len`: the longest sequence the model will
    run (its RoPE tables and decoding buffers are sized by it); None takes the checkpoint's
    `max_position_embeddings`, capped at 4096."""
    hf = read_config(path)
    # an unsupported architecture or option fails before any file is opened
    model_config_from_hf(hf, detect_family(hf), max_seq_len)
    reader = CheckpointReader(path, trust_pickle=trust_pickle)
    try:
        tcfg, spec = hf_config(path, mtp_overrides, max_seq_len=max_seq_len, reader=reader, hf=hf)
        cfg, mtp = tcfg.model, tcfg.mtp
        with torch.device("meta"):  # storage only for the loaded weights: no random init pass
            model = TandemModel(cfg, mtp)
        allocate(model, torch.device(device))
        report = load_hf_weights(model, path, spec=spec, cfg=cfg, mtp=mtp, reader=reader)
        # a fresh MTP module, when the checkpoint has none
        init_seeded(model, 0, skip=set(report.loaded))
        if report.fresh_mtp and mtp.num_steps:
            print(f"hf import: {path} has no MTP weights; the MTP module is freshly initialised",
                  file=sys.stderr)
    finally:
        reader.close()
    return model.to(device).eval(), tcfg


__all__ = ["load_hf_model", "load_hf_weights", "UnsupportedCheckpoint", "shard_index",
           "read_source", "LoadReport"]
