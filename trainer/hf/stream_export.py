"""`tandem export` of a Tandem checkpoint without building the model: tensor by tensor.

The DCP checkpoint's metadata names every tensor with its shape and dtype, so the safetensors headers
(names, dtypes, shapes, offsets) are known before any data is read. Each output file is written
header first, then each tensor as it is read from the checkpoint (one `dcp.load` of that tensor
alone), renamed to the family's names, and dropped: the process holds one model tensor at a time,
never the model, and keeps the checkpoint's dtype. A frozen-trunk checkpoint's trunk tensors are read
from its (fingerprint-checked) `model.init_from` reference, a Hugging Face directory slice-reader or
another DCP checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .families import UnsupportedCheckpoint, default_family, detect_family, hf_config, hf_name, meta_state
from .importer import _ST_DTYPES, CheckpointReader, read_config, read_source

_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _dcp_sources(step_dir: str) -> Dict[str, Tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    meta = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    out = {}
    for key, md in meta.items():
        if not key.startswith("model.") or not hasattr(md, "size"):
            continue
        name = key[len("model."):]

        def load(name=name, md=md):
            t = torch.empty(md.size, dtype=md.properties.dtype)
            dcp.load({"model": {name: t}}, checkpoint_id=step_dir, planner=DefaultLoadPlanner(allow_partial_load=True))
            return t

        out[name] = (md.size, md.properties.dtype, load)
    return out


def _hf_sources(path: str, cfg, mtp, names) -> Dict[str, Tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]]:
    reader = CheckpointReader(path)
    spec = detect_family(read_config(path), reader.keys())
    full = meta_state(cfg, mtp)
    out = {}
    for name in names:
        src = hf_name(name, cfg, mtp, spec)
        if src is None or any(k not in reader._files for k in src.keys):
            continue
        shape = full[name]
        dtype = torch.float32 if src.plus_one else reader.dtype(src.keys[0])
        out[name] = (shape, dtype, lambda src=src, shape=shape: read_source(
            reader, src, tuple(slice(0, s) for s in shape), shape))
    return out


def export_checkpoint(step_dir: str, out_dir: str, family: Optional[str], cfg, mtp, max_shard_bytes: int = 0) -> str:
    """Write the HF weights of checkpoint `step_dir` into the (new, empty) directory `out_dir`;
    return the family. Tensors stream from disk to disk."""
    from .init_from import is_hf_dir, read_reference

    family = family or default_family(cfg)
    config, spec = hf_config(family, cfg, mtp)
    names = list(meta_state(cfg, mtp))
    sources = _dcp_sources(step_dir)
    ref = read_reference(step_dir)
    if ref is not None:
        rest = [n for n in names if n not in sources]
        extra = (_hf_sources(ref["path"], cfg, mtp, rest) if is_hf_dir(ref["path"])
                 else _dcp_sources(ref["path"]))
        sources.update({n: extra[n] for n in rest if n in extra})
    # tensors the family has no name for (a softmax router's correction bias) need no source
    missing = [n for n in names if n not in sources and hf_name(n, cfg, mtp, spec) is not None]
    if missing:
        raise ValueError(f"checkpoint {step_dir} lacks tensors: {', '.join(missing[:8])}")
    # plan: output keys per file, in write order
    # (name, key, part: the expert row of a stacked source or the row block of a concatenated one, shape, dtype)
    plan: List[Tuple[str, str, Optional[Union[int, slice]], List[int], torch.dtype]] = []
    for name in names:
        src = hf_name(name, cfg, mtp, spec)
        if src is None:
            continue
        shape, dtype, _ = sources[name]
        if src.stacked:
            plan += [(name, key, e, list(shape[1:]), dtype) for e, key in enumerate(src.keys)]
        elif src.concat:  # transformers' Chunk: torch.chunk's row blocks, one key each
            step = -(-shape[0] // len(src.keys))
            plan += [(name, key, slice(r, min(r + step, shape[0])), [min(r + step, shape[0]) - r] + list(shape[1:]), dtype)
                     for key, r in zip(src.keys, range(0, shape[0], step))]
        else:
            plan.append((name, src.keys[0], None, list(shape), dtype))
    files: List[List[int]] = [[]]
    size = 0
    for i, (_, _, _, shape, dtype) in enumerate(plan):
        nbytes = _numel(shape) * dtype.itemsize
        if files[-1] and max_shard_bytes and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    fnames = (["model.safetensors"] if len(files) == 1 else
              [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    handles, where = [], {}
    for fname, idx in zip(fnames, files):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in idx:
            _, key, _, shape, dtype = plan[i]
            n = _numel(shape) * dtype.itemsize
            header[key] = {"dtype": _ST_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
            where[i] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f = open(os.path.join(out_dir, fname), "wb")
        f.write(struct.pack("<Q", len(raw)) + raw)
        handles.append(f)
    by_file = dict(zip(fnames, handles))
    try:
        i = 0
        while i < len(plan):
            name = plan[i][0]
            _, dtype, load = sources[name]
            value = _to_hf(load(), hf_name(name, cfg, mtp, spec), dtype)
            while i < len(plan) and plan[i][0] == name:
                _, key, index, _, _ = plan[i]
                part = value[index] if index is not None else value
                by_file[where[i]].write(part.contiguous().view(torch.uint8).reshape(-1).numpy().data)
                i += 1
            del value
        for name, (_, _, load) in sources.items():  # tensors the family has no name for must be zero
            if name in names and hf_name(name, cfg, mtp, spec) is None and load().abs().max() > 0:
                raise UnsupportedCheckpoint(
                    f"cannot export as {family}: {name} is non-zero and the family has no such tensor "
                    "(a softmax router trained with aux-free balancing; export as glm4_moe needs a sigmoid router)")
    finally:
        for f in handles:
            f.close()
    if len(fnames) > 1:
        total = sum(_numel(p[3]) * p[4].itemsize for p in plan)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": {plan[i][1]: where[i] for i in range(len(plan))}},
                      f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return family


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _to_hf(value: torch.Tensor, src, dtype: torch.dtype) -> torch.Tensor:
    """A Tandem tensor as the family stores it (norm offsets, MTP input halves, Gated DeltaNet's qkv row
    order), in `dtype`."""
    if src.plus_one:
        value = (value.float() - 1.0).to(dtype)
    value = src.to_checkpoint_rows(value)
    if src.swap_halves:
        half = value.shape[1] // 2
        value = torch.cat([value[:, half:], value[:, :half]], dim=1)
    return value.to(dtype)
