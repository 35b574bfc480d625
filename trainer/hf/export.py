"""`tandem export --checkpoint DIR --out OUT [--family F]`: a Tandem checkpoint (or, from Python, a
model) as a Hugging Face directory: config.json, safetensors and the tokenizer.

Tensor names follow the target family (families.py): the trunk as transformers names it, the MTP
layers as the family's MTP layout (GLM-4.5: `model.layers.{N + j}.*`; Qwen3 family and qwen4_exp:
`mtp.*`); experts are written per expert, as transformers' save_pretrained writes them.

One path for both inputs. Every tensor has a source: its shape and dtype, and a function that reads
it (one `dcp.load` of that tensor alone from a checkpoint, a slice of the `model.init_from`
reference for a frozen trunk, or a model parameter, gathered when it is a DTensor). Shapes and
dtypes fix the safetensors headers before any data is read, so each file is written header first and
then tensor by tensor, read, converted to the family's layout and dropped: the process never holds
the model. The output is assembled in a temporary sibling directory and renamed into place, so OUT
is absent, the old export (without `overwrite`) or the whole new one. Before anything is read, an
OUT that overlaps the run it exports, or holds anything but an earlier export's files, is refused,
and so is a tokenizer that does not load or is larger than the model's vocabulary.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import struct
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from tandem.data_pipeline.tokenizer import saved_tokenizer, tokenizer_file
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig

from .. import safe_dcp
from ..checkpoint_dirs import resolve_checkpoint
from ..files import naming, parent_problem
from ..recipe import load_config
from .families import (
    DRAFT_STEPS_KEY,
    FAMILIES,
    UnsupportedCheckpoint,
    default_family,
    detect_family,
    hf_config,
    hf_name,
    meta_state,
)
from .importer import local_tensors, read_source
from .init_from import check_reference, is_hf_dir, read_reference, serving_origin
from .reader import ST_DTYPES, CheckpointReader, read_config
from .serving_files import check_tokenizer_file, source_serving_fields, write_tokenizer

_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


class _Source(NamedTuple):
    shape: Tuple[int, ...]
    dtype: torch.dtype
    """The dtype written (the checkpoint's, the parameter's; fp32 for a norm stored with an
    offset)."""
    load: Callable[[], torch.Tensor]


class _Entry(NamedTuple):
    """One output tensor: the Tandem tensor it comes from and which part (the expert of a stacked
    source, the row block of a concatenated one, or None: all of it)."""
    name: str
    key: str
    part: Optional[Union[int, slice]]
    shape: List[int]
    dtype: torch.dtype


# --- the command ----------------------------------------------------------------------------------
def export_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem export", description="Write a Hugging Face "
                                     "checkpoint (config.json + safetensors) of a Tandem one.")
    parser.add_argument("--checkpoint", required=True,
                        help="step_<N>/ directory or a run directory (newest checkpoint)")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--family", choices=FAMILIES, default=None, help="target layout; default "
                        "from the model's knobs (sigmoid router/shared experts -> glm4_moe)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or HF tokenizer "
                        "directory to copy (default: the run's)")
    parser.add_argument("--max-shard-mb", type=float, default=0,
                        help="split the safetensors into shards of this size")
    args = parser.parse_args(argv)
    if not 0 <= args.max_shard_mb < float("inf"):
        print(f"tandem export: error: --max-shard-mb {args.max_shard_mb} must be a finite number "
              ">= 0 (0: one file)", file=sys.stderr)
        return 2
    try:
        step = resolve_checkpoint(args.checkpoint)
        ref = read_reference(step)
        # before the frozen trunk's fingerprint is computed (check_reference hashes it)
        check_out(args.out, args.overwrite, _read_dirs(step))
        cfg = load_config(os.path.join(step, "config.yaml"))
        if ref is not None:
            check_reference(ref, step)
        family = export_hf_checkpoint(step, args.out, args.family, cfg=cfg.model, mtp=cfg.mtp,
                                      overwrite=args.overwrite,
                                      tokenizer=args.tokenizer or _tokenizer_for(cfg, step),
                                      max_shard_bytes=int(args.max_shard_mb * 2**20))
    except (OSError, UnsupportedCheckpoint, ValueError) as exc:
        # CheckpointError is a ValueError: a malformed tokenizer or reference lands here too; a
        # full disk or a read-only --out is an OSError
        print(f"tandem export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if cfg.mtp.num_steps and cfg.mtp.trunk_input == "pre_norm" and family in VLLM_NORMED:
        print(f"tandem export: note: its MTP module reads the trunk's pre-norm state "
              f"(mtp.trunk_input=pre_norm); vLLM's {family} proposer hands it the normed "
              "output, so vLLM drafts from another input than tandem eval does (docs/serving.md: "
              "train or fine-tune with mtp.trunk_input=final_norm to serve)", file=sys.stderr)
    print(json.dumps({"out": os.path.abspath(args.out), "family": family,
                      "mtp_layers": cfg.mtp.num_layers if cfg.mtp.num_steps else 0}))
    return 0


VLLM_NORMED = ("glm4_moe", "deepseek_v3")
"""Families whose vLLM MTP proposer feeds the drafter the trunk's final-normed hidden state."""


def _tokenizer_for(cfg, step_dir: str = "") -> Optional[str]:
    """The tokenizer the run trained with, when it can be found without rebuilding anything: the
    copy the checkpoint recorded, else the run's data config's."""
    recorded = saved_tokenizer(step_dir) if step_dir else None
    if recorded:
        return recorded
    if cfg.data.tokenizer and tokenizer_file(cfg.data.tokenizer):
        return cfg.data.tokenizer
    if cfg.data.source == "stdlib":
        ver = ".".join(map(str, sys.version_info[:3]))
        pattern = os.path.join(glob.escape(os.path.expanduser(cfg.data.cache_dir)),
                               f"stdlib-py{ver}-v{cfg.data.vocab_size}"
                               f"-cap{cfg.data.stdlib_max_bytes}-*",
                               "train.tokenizer.json")
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    for prefix in cfg.data.paths:
        for cand in (prefix + ".tokenizer.json",
                     os.path.join(os.path.dirname(prefix), "tokenizer.json")):
            if os.path.isfile(cand):
                return cand
    return None


# --- the two inputs -------------------------------------------------------------------------------
def export_hf(model: nn.Module, out: str, family: Optional[str] = None, *,
              cfg: Optional[ModelConfig] = None,
              mtp: Optional[MTPConfig] = None, overwrite: bool = False,
              tokenizer: Optional[str] = None, max_shard_bytes: int = 0) -> str:
    """Write `model` to `out` as a Hugging Face checkpoint of `family` (default: from the knobs).
    Returns the family used. Refuses to replace an existing `out` unless `overwrite`."""
    cfg = cfg or model.cfg
    mtp = mtp or model.mtp_cfg
    family = family or default_family(cfg)

    def fill(tmp: str) -> None:
        spec = hf_config(family, cfg, mtp)[1]
        sources = {}
        for name, t in local_tensors(model).items():
            src = hf_name(name, cfg, mtp, spec)
            dtype = torch.float32 if src is not None and src.plus_one else t.dtype
            sources[name] = _Source(tuple(t.shape), dtype, lambda t=t: _full(t))
        _write_hf(tmp, family, cfg, mtp, list(sources), sources, max_shard_bytes)

    _write_export_dir(out, overwrite, tokenizer, fill, cfg.vocab_size)
    return family


def export_hf_checkpoint(step_dir: str, out: str, family: Optional[str] = None, *, cfg: ModelConfig,
                         mtp: MTPConfig,
                         overwrite: bool = False, tokenizer: Optional[str] = None,
                         max_shard_bytes: int = 0) -> str:
    """`export_hf` of a Tandem checkpoint directory, without building the model; a frozen-trunk
    checkpoint's trunk comes from its (fingerprint-checked) `model.init_from` reference."""
    family = family or default_family(cfg)

    def fill(tmp: str) -> None:
        spec = hf_config(family, cfg, mtp)[1]
        names = list(meta_state(cfg, mtp))
        _write_hf(tmp, family, cfg, mtp, names,
                  _checkpoint_sources(step_dir, cfg, mtp, spec, names), max_shard_bytes,
                  frozen_trunk=read_reference(step_dir) is not None)

    _write_export_dir(out, overwrite, tokenizer, fill, cfg.vocab_size,
                      _read_dirs(step_dir))
    return family


def _checkpoint_sources(step_dir: str, cfg: ModelConfig, mtp: MTPConfig, spec,
                        names: List[str]) -> Dict[str, _Source]:
    """The checkpoint's tensors, and those it lacks from its `model.init_from` reference, which
    may itself be a frozen-trunk checkpoint (a fine-tune of a fine-tune: its own reference then
    holds the trunk), as training loads them (init_from.load_tandem_weights)."""
    sources = _dcp_sources(step_dir)
    for link, (holder, ref) in enumerate(_trunk_chain(step_dir)):
        if link:  # the first link is checked before the export starts
            check_reference(ref, holder)
        rest = [n for n in names if n not in sources]
        extra = (_hf_sources(ref["path"], cfg, mtp, rest) if is_hf_dir(ref["path"])
                 else _dcp_sources(ref["path"]))
        sources.update({n: extra[n] for n in rest if n in extra})
    # tensors the family has no name for (a softmax router's correction bias) need no source
    missing = [n for n in names if n not in sources and hf_name(n, cfg, mtp, spec) is not None]
    if missing:
        raise ValueError(f"checkpoint {step_dir} lacks tensors: {', '.join(missing[:8])}")
    return sources


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else t).detach().cpu()


def _dcp_sources(step_dir: str) -> Dict[str, _Source]:
    meta = safe_dcp.read_metadata(step_dir).state_dict_metadata
    out = {}
    for key, md in meta.items():
        if not key.startswith("model.") or not hasattr(md, "size"):
            continue
        name = key[len("model."):]

        def load(name=name, md=md):
            t = torch.empty(md.size, dtype=md.properties.dtype)
            safe_dcp.load({"model": {name: t}}, step_dir, allow_partial_load=True)
            return t

        out[name] = _Source(md.size, md.properties.dtype, load)
    return out


def _hf_sources(path: str, cfg, mtp, names) -> Dict[str, _Source]:
    reader = CheckpointReader(path)
    spec = detect_family(read_config(path), reader.keys())
    full, present = meta_state(cfg, mtp), set(reader.keys())
    out = {}
    for name in names:
        src = hf_name(name, cfg, mtp, spec)
        if src is None or any(k not in present for k in src.keys):
            continue
        shape = full[name]
        dtype = torch.float32 if src.plus_one else reader.dtype(src.keys[0])
        out[name] = _Source(shape, dtype, lambda src=src, shape=shape: read_source(
            reader, src, tuple(slice(0, s) for s in shape), shape))
    return out


# --- writing --------------------------------------------------------------------------------------
def _write_hf(out_dir: str, family: str, cfg: ModelConfig, mtp: MTPConfig, names: List[str],
              sources: Dict[str, _Source], max_shard_bytes: int,
              frozen_trunk: bool = False) -> None:
    """Write config.json and the weights of `names` (in this order) into the new, empty
    `out_dir`; `frozen_trunk`: the trunk is its `model.init_from` source's, whose context length
    it keeps (serving_files.source_serving_fields)."""
    config, spec = hf_config(family, cfg, mtp)
    for name in names:  # tensors the family has no name for must be zero
        if hf_name(name, cfg, mtp,
                   spec) is None and name in sources and sources[name].load().abs().max() > 0:
            raise UnsupportedCheckpoint(
                f"cannot export as {family}: {name} is non-zero and the family has no such tensor "
                "(a softmax router trained with aux-free balancing; export as glm4_moe needs a "
                "sigmoid router)")
    plan = _plan(names, sources, cfg, mtp, spec)
    files = _shard(plan, max_shard_bytes)
    fnames = (["model.safetensors"] if len(files) == 1 else
              [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    where = {i: fname for fname, idx in zip(fnames, files) for i in idx}
    handles = {fname: _open_safetensors(os.path.join(out_dir, fname), [plan[i] for i in idx])
               for fname, idx in zip(fnames, files)}
    try:
        i = 0
        while i < len(plan):
            name = plan[i].name
            value = _to_hf(sources[name].load(), hf_name(name, cfg, mtp, spec), sources[name].dtype)
            while i < len(plan) and plan[i].name == name:
                part = value[plan[i].part] if plan[i].part is not None else value
                handles[where[i]].write(part.contiguous().view(torch.uint8).reshape(-1).numpy().data)
                i += 1
            del value
    finally:
        for f in handles.values():
            f.close()
    if len(fnames) > 1:
        total = sum(_nbytes(e) for e in plan)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": {plan[i].key: where[i] for i in range(len(plan))}},
                      f, indent=1)
    config.update(source_serving_fields(serving_origin(cfg.init_from), cfg.max_seq_len, out_dir,
                                        frozen_trunk))
    # the dtype most bytes are in (a frozen bf16 trunk beside an fp32 MTP module); always float32
    # before, so transformers and vLLM (dtype auto) loaded a bf16 export at twice its memory
    written = collections.Counter()
    for e in plan:
        written[e.dtype] += _nbytes(e)
    config["dtype"] = str(written.most_common(1)[0][0]).removeprefix("torch.")
    if mtp is not None and mtp.num_steps:  # vLLM: its num_speculative_tokens
        config[DRAFT_STEPS_KEY] = mtp.num_steps
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _plan(names: List[str], sources: Dict[str, _Source], cfg, mtp, spec) -> List[_Entry]:
    """The output tensors in write order, each source's parts together."""
    plan = []
    for name in names:
        src = hf_name(name, cfg, mtp, spec)
        if src is None:
            continue
        shape, dtype, _ = sources[name]
        if src.stacked:
            plan += [_Entry(name, key, e, list(shape[1:]), dtype) for e, key in enumerate(src.keys)]
        elif src.concat:  # transformers' Chunk: torch.chunk's row blocks, one key each
            step = -(-shape[0] // len(src.keys))
            plan += [_Entry(name, key, slice(r, min(r + step, shape[0])), [min(r + step,
                                                                               shape[0]) - r]
                            + list(shape[1:]),
                            dtype) for key, r in zip(src.keys, range(0, shape[0], step))]
        else:
            plan.append(_Entry(name, src.keys[0], None, list(shape), dtype))
    return plan


def _nbytes(entry: _Entry) -> int:
    n = entry.dtype.itemsize
    for s in entry.shape:
        n *= s
    return n


def _shard(plan: List[_Entry], max_shard_bytes: int) -> List[List[int]]:
    """Indices of `plan` per output file: consecutive runs of at most `max_shard_bytes` (0: one
    file)."""
    files: List[List[int]] = [[]]
    size = 0
    for i, entry in enumerate(plan):
        if files[-1] and max_shard_bytes and size + _nbytes(entry) > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += _nbytes(entry)
    return files


def _open_safetensors(path: str, entries: List[_Entry]):
    """Create a safetensors file, write its header for `entries` (in this order) and return it open
    for their data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.key] = {"dtype": _ST_NAMES[e.dtype], "shape": e.shape,
                         "data_offsets": [offset, offset + _nbytes(e)]}
        offset += _nbytes(e)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f = open(path, "wb")
    f.write(struct.pack("<Q", len(raw)) + raw)
    return f


def _to_hf(value: torch.Tensor, src, dtype: torch.dtype) -> torch.Tensor:
    """A Tandem tensor as the family stores it (norm offsets, MTP input halves, Gated DeltaNet's qkv
    row order), in `dtype`."""
    if src.plus_one:
        value = (value.float() - 1.0).to(dtype)
    value = src.to_checkpoint_rows(value)
    if src.swap_halves:
        half = value.shape[1] // 2
        value = torch.cat([value[:, half:], value[:, :half]], dim=1)
    return value.to(dtype)


# what an export writes: --overwrite replaces a directory holding only these
_EXPORT_FILES = re.compile(r"config\.json|model(-\d+-of-\d+)?\.safetensors|"
                           r"model\.safetensors\.index\.json|tokenizer\.json|"
                           r"tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja|"
                           r"generation_config\.json")


def _trunk_chain(step_dir: str) -> List[Tuple[str, dict]]:
    """(checkpoint, its frozen-trunk reference) from `step_dir` on: a frozen trunk may be a
    frozen-trunk fine-tune again, whose own reference then holds the trunk; empty for a whole
    checkpoint."""
    chain, holder, ref = [], step_dir, read_reference(step_dir)
    while ref is not None:
        chain.append((holder, ref))
        holder = ref["path"]
        ref = None if is_hf_dir(holder) else read_reference(holder)
    return chain


def _read_dirs(step_dir: str) -> Dict[str, str]:
    """What exporting `step_dir` reads, by what it is: the run a `RUN/checkpoints/step_<N>` belongs
    to (a lone step directory: itself), and each frozen trunk's `model.init_from` on its way to
    the trunk."""
    step_dir = os.path.abspath(step_dir)
    parent = os.path.dirname(step_dir)
    found = ({"the checkpoint's run directory": os.path.dirname(parent)}
             if os.path.basename(parent) == "checkpoints" else {"the checkpoint": step_dir})
    for link, (_, ref) in enumerate(_trunk_chain(step_dir)):
        found[f"its frozen trunk (model.init_from){' of that' * link}"] = ref["path"]
    return found


def check_out(out: str, overwrite: bool, inputs: Optional[Dict[str, str]] = None) -> None:
    """Refuse an OUT whose replacement would lose data, before anything is read: one that is, holds
    or lies inside a directory the export reads (`inputs`: what it is -> path), an existing one
    without `overwrite`, and one holding anything an export does not write."""
    real = os.path.realpath(out)
    for label, src in (inputs or {}).items():
        src = os.path.realpath(src)
        common = os.path.commonpath([real, src])
        if common in (real, src):
            what = "is" if real == src else ("lies inside" if common == src else "holds")
            raise ValueError(f"--out {out} {what} {label} {src}; choose an --out outside it (an "
                             "export there could delete what it reads)")
    if not os.path.lexists(out):
        problem = parent_problem(out)
        if problem:
            raise ValueError(f"--out {out}: {problem}")
        return
    if not overwrite:
        raise FileExistsError(f"{os.path.abspath(out)} exists; pass --overwrite to replace it")
    if os.path.islink(out) or not os.path.isdir(out):
        raise FileExistsError(f"--out {out} is a file or a link, not a directory; --overwrite "
                              "replaces only an earlier export")
    other = sorted(n for n in os.listdir(out) if not (_EXPORT_FILES.fullmatch(n) and os.path.isfile(
        os.path.join(out, n))))
    if other:
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        raise FileExistsError(f"--out {out} holds {os.path.join(out, other[0])}{more}, which no "
                              "export writes; --overwrite replaces only an earlier export, so it "
                              "would be lost: move it or choose another --out")


def _write_export_dir(out: str, overwrite: bool, tokenizer: Optional[str],
                      fill: Callable[[str], None], vocab_size: int,
                      inputs: Optional[Dict[str, str]] = None) -> None:
    """Assemble an export in a temporary sibling directory (`fill(tmp)` writes weights and config)
    and rename it into place: OUT is absent, the old export or the whole new one. OUT is checked
    first (`check_out`, with `inputs`: what the export reads)."""
    check_out(out, overwrite, inputs)
    tok_src = check_tokenizer_file(tokenizer, vocab_size) if tokenizer else None
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp_export_{os.path.basename(out)}_{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        with naming(out):  # a full disk's error names no file: name the export it stopped
            fill(tmp)
            if tok_src:
                write_tokenizer(tokenizer, tmp)
        _put_in_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _put_in_place(tmp: str, out: str) -> None:
    """Rename the whole export `tmp` to `out`; an earlier export there is moved aside first, deleted
    once the new one is in place, and moved back if the new one cannot take its place (it was left
    hidden in `.tmp_export_*.old`)."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    old = tmp + ".old"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError as exc:
        os.rename(old, out)
        raise OSError(exc.errno, f"could not rename the new export into {out} ({exc.strerror}); "
                                 "the earlier export is back in place") from None
    shutil.rmtree(old, ignore_errors=True)
