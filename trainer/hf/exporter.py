"""Export a TandemModel to a Hugging Face directory: config.json + safetensors (+ tokenizer).

Tensor names follow the target family (see families): the trunk as transformers names it, the MTP
layers as the family's MTP layout (GLM-4.5: `model.layers.{N + j}.*`, so `Glm4MoeForCausalLM` loads
the trunk and `generate(..., use_mtp=True)` finds the MTP layers; Qwen3 family: `mtp.*`). Experts are
written per expert (`mlp.experts.{e}.gate_proj.weight`), as transformers' save_pretrained writes
them. The output is assembled in a temporary sibling directory and renamed into place, so OUT is
either absent, the old export (without `overwrite`) or the whole new one.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

import torch
from torch import nn

from tandem.models.config import MTPConfig, ModelConfig

from .families import UnsupportedCheckpoint, default_family, hf_config, hf_name


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else t).detach().cpu()


def hf_state_dict(model: nn.Module, family: str, cfg: ModelConfig, mtp: MTPConfig) -> Dict[str, torch.Tensor]:
    """This model's weights under `family`'s checkpoint names."""
    from .importer import local_tensors

    _, spec = hf_config(family, cfg, mtp)
    out: Dict[str, torch.Tensor] = {}
    for name, t in local_tensors(model).items():
        src = hf_name(name, cfg, mtp, spec)
        value = _full(t)
        if src is None:
            if value.abs().max() > 0:
                raise UnsupportedCheckpoint(
                    f"cannot export as {family}: {name} is non-zero and the family has no such tensor "
                    "(a softmax router trained with aux-free balancing; export as glm4_moe needs a sigmoid router)")
            continue
        if src.plus_one:
            value = value.float() - 1.0
        value = src.to_checkpoint_rows(value)
        if src.swap_halves:
            half = value.shape[1] // 2
            value = torch.cat([value[:, half:], value[:, :half]], dim=1)
        if src.stacked:
            for e, key in enumerate(src.keys):
                out[key] = value[e].contiguous()
        elif src.concat:  # transformers' Chunk: torch.chunk into len(keys) row blocks
            for key, block in zip(src.keys, torch.chunk(value, len(src.keys), dim=0)):
                out[key] = block.contiguous()
        else:
            out[src.keys[0]] = value.contiguous()
    return out


def _save_shards(state: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if current and max_shard_bytes and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = state[key]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def _copy_tokenizer(tokenizer: Optional[str], out_dir: str) -> bool:
    if not tokenizer:
        return False
    src = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    if not os.path.isfile(src):
        return False
    shutil.copyfile(src, os.path.join(out_dir, "tokenizer.json"))
    if os.path.isdir(tokenizer):
        for extra in ("tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(tokenizer, extra)):
                shutil.copyfile(os.path.join(tokenizer, extra), os.path.join(out_dir, extra))
    if not os.path.isfile(os.path.join(out_dir, "tokenizer_config.json")):
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return True


def export_hf(model: nn.Module, out: str, family: Optional[str] = None, *, cfg: Optional[ModelConfig] = None,
              mtp: Optional[MTPConfig] = None, overwrite: bool = False, tokenizer: Optional[str] = None,
              max_shard_bytes: int = 0) -> str:
    """Write `model` to `out` as a Hugging Face checkpoint of `family` (default: from the knobs).
    Returns the family used. Refuses to replace an existing `out` unless `overwrite`."""
    cfg = cfg or model.cfg
    mtp = mtp or model.mtp_cfg
    family = family or default_family(cfg)

    def fill(tmp: str) -> None:
        config, _ = hf_config(family, cfg, mtp)
        _save_shards(hf_state_dict(model, family, cfg, mtp), tmp, max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)

    write_export_dir(out, overwrite, tokenizer, fill)
    return family


def export_hf_checkpoint(step_dir: str, out: str, family: Optional[str] = None, *, cfg: ModelConfig, mtp: MTPConfig,
                         overwrite: bool = False, tokenizer: Optional[str] = None, max_shard_bytes: int = 0) -> str:
    """`export_hf` of a Tandem checkpoint directory, streamed tensor by tensor (stream_export.py)."""
    from .stream_export import export_checkpoint

    chosen = [family]
    write_export_dir(out, overwrite, tokenizer,
                     lambda tmp: chosen.__setitem__(0, export_checkpoint(step_dir, tmp, family, cfg, mtp, max_shard_bytes)))
    return chosen[0]


def write_export_dir(out: str, overwrite: bool, tokenizer: Optional[str], fill) -> None:
    """Assemble an export in a temporary sibling directory (`fill(tmp)` writes weights and config) and
    rename it into place: OUT is absent, the old export or the whole new one."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp_export_{os.path.basename(out)}_{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        fill(tmp)
        _copy_tokenizer(tokenizer, tmp)
        if os.path.exists(out):
            old = tmp + ".old"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
