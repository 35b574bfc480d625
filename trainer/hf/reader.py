"""Reading a checkpoint directory's tensors and config.json: `CheckpointReader` (safetensors,
sharded index included, read slice by slice with plain reads of byte ranges; pickle only when
trusted), `read_config`, and the errors they raise (`CheckpointError`, `PickleCheckpointError`).
Knows nothing of model families or of which tensors a model needs: trainer/hf/importer.py maps
those, trainer/hf/export.py and init_from.py read through this too.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch


class CheckpointError(ValueError):
    """A checkpoint does not match the model (names, shapes, vocabulary) or cannot be read
    safely."""


class PickleCheckpointError(CheckpointError):
    """The checkpoint is stored as pickle and trust_pickle was not given."""


class CheckpointReader:
    """Lazy, slice-wise access to a local checkpoint directory's tensors."""

    def __init__(self, path: str, trust_pickle: bool = False):
        self.path = path
        self._files: Dict[str, str] = {}  # key -> file
        self._handles: Dict[str, object] = {}
        self._pickled: Dict[str, torch.Tensor] = {}
        index = os.path.join(path, "model.safetensors.index.json")
        files = os.path.join(glob.escape(path), "*")  # a directory name may hold [ ] * ?
        st_files = sorted(glob.glob(f"{files}.safetensors"))
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no \"weight_map\" object")
            # a shard is a file in the directory: an index naming `../x` or `/x` read weights from
            # elsewhere on the machine
            far = next((v for v in weight_map.values() if not isinstance(v, str)
                        or v in ("", ".", "..") or os.path.basename(v) != v), None)
            if far is not None:
                raise CheckpointError(f"{index} maps a tensor to {far!r}, which is not a file name "
                                      "in its directory")
            self._files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif st_files:
            for file in st_files:
                for key in self._header(file)[1]:
                    self._files[key] = file
        else:
            pickles = sorted(glob.glob(f"{files}.bin") + glob.glob(f"{files}.pt")
                             + glob.glob(f"{files}.pth"))
            if not pickles:
                raise CheckpointError("no *.safetensors (or model.safetensors.index.json) in "
                                      f"{path}")
            if not trust_pickle:
                names = ", ".join(os.path.basename(p) for p in pickles)
                raise PickleCheckpointError(
                    f"{path} holds a pickle checkpoint ({names}); unpickling can run arbitrary "
                    "code, so it is refused "
                    "unless you trust it: convert it to safetensors, or load it from Python with "
                    "load_hf_model(path, trust_pickle=True)")
            for file in pickles:
                state = torch.load(file, map_location="cpu", weights_only=False)
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        self._pickled[key] = value
                        self._files[key] = file

        self._check_files()
        # FP8 checkpoints (Qwen3's and DeepSeek-V3's releases): each quantized weight has a
        # `<name>_scale_inv` of one factor per block, and reads as the dequantized bf16 weight
        self._scales = {k[:-len(_SCALE)]: k for k in self._files
                        if k.endswith(_SCALE) and k[:-len(_SCALE)] in self._files}
        self._block = _fp8_block(path, bool(self._scales))
        self._check_scales()

    def _check_files(self) -> None:
        """A shard named by the index but absent, shorter than its header says (a partial copy or
        download) or without a tensor the index maps to it (a shard of another revision) fails
        here, naming the file, before any tensor is read."""
        for file in sorted(set(self._files.values()) - {f for k, f in self._files.items()
                                                        if k in self._pickled}):
            if not os.path.isfile(file):
                raise CheckpointError(f"checkpoint shard {file} is missing (named by "
                                      f"{self.path}/model.safetensors.index.json)")
            base, header = self._header(file)
            end = base + max((v["data_offsets"][1] for v in header.values()), default=0)
            size = os.path.getsize(file)
            if size < end:
                raise CheckpointError(f"checkpoint shard {file} is partial: {size} bytes, its "
                                      f"header describes {end}")
        lacking = sorted(k for k, file in self._files.items()
                         if k not in self._pickled and k not in self._header(file)[1])
        if lacking:
            raise CheckpointError(
                f"{self.path}/model.safetensors.index.json maps {len(lacking)} tensor(s) to "
                f"shards that do not hold them, first {lacking[0]} to "
                f"{os.path.basename(self._files[lacking[0]])} (a shard of another revision, or a "
                "partial copy?)")

    def _check_scales(self) -> None:
        """Every float8 weight has a scale, one per block of config.json's block size: a weight
        without one would load as its raw FP8 codes, a grid of another shape scale the wrong
        blocks. Headers only."""
        scales = set(self._scales.values())
        for key in sorted(set(self._files) - scales):
            if self._stored_dtype(key) in _FP8 and key not in self._scales:
                raise CheckpointError(
                    f"{self.path}: weight {key} is stored in float8 without its {key}{_SCALE}"
                    + ("" if self._block else " and config.json's quantization_config"))
            if key in self._scales:
                (b0, b1), shape, scale = self._block, self.shape(key), self.shape(self._scales[key])
                want = (-(-shape[0] // b0), -(-shape[1] // b1)) if len(shape) == 2 else None
                if want is None or scale != want:
                    raise CheckpointError(
                        f"{self.path}: {key}{_SCALE} has shape {list(scale)}; weight {key} "
                        f"{list(shape)} in blocks of {b0}x{b1} needs {list(want or [])}")

    def keys(self) -> List[str]:
        return sorted(set(self._files) - set(self._scales.values()))

    def _header(self, file: str) -> Tuple[int, dict]:
        if file not in self._handles:
            self._handles[file] = safetensors_header(file)
        return self._handles[file]

    def shape(self, key: str) -> Tuple[int, ...]:
        if key in self._pickled:
            return tuple(self._pickled[key].shape)
        return tuple(self._header(self._files[key])[1][key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        """What `read` returns: bf16 for an FP8 weight, else the stored dtype."""
        return torch.bfloat16 if key in self._scales else self._stored_dtype(key)

    def _stored_dtype(self, key: str) -> torch.dtype:
        if key in self._pickled:
            return self._pickled[key].dtype
        return _st_dtype(self._files[key], key, self._header(self._files[key])[1][key]["dtype"])

    def read(self, key: str, index: Tuple[slice, ...]) -> torch.Tensor:
        """tensor[index] of `key` (an FP8 weight dequantized, in bf16), reading only that slice from
        disk (safetensors). Plain reads, not a memory map: the pages of the rest of the file never
        count against this process."""
        if key not in self._scales:
            return self._read(key, index)
        index = tuple(index) + (slice(None),) * (2 - len(index))
        bounds = [sl.indices(n) for sl, n in zip(index, self.shape(key))]
        if len(index) != 2 or any(step != 1 for _, _, step in bounds):
            raise CheckpointError(f"{self.path}: FP8 weight {key} read as {index}: only 2-D "
                                  "contiguous slices are dequantized")
        (r0, r1, _), (c0, c1, _) = bounds
        (b0, b1), a0, a1 = self._block, r0 // self._block[0], c0 // self._block[1]
        scale = self._read(self._scales[key], (slice(a0, -(-r1 // b0)), slice(a1, -(-c1 // b1))))
        out, column_block = self._read(key, index).float(), torch.arange(c0, c1) // b1 - a1
        for j, row in enumerate(scale.float()):  # a block row at a time: no weight-sized grid
            lo, hi = max(r0, (a0 + j) * b0) - r0, min(r1, (a0 + j + 1) * b0) - r0
            out[lo:hi] *= row[column_block]
        return out.to(torch.bfloat16)

    def _read(self, key: str, index: Tuple[slice, ...]) -> torch.Tensor:
        """tensor[index] of `key` as stored."""
        if key in self._pickled:
            return self._pickled[key][index]
        file = self._files[key]
        base, header = self._header(file)
        info = header[key]
        shape, dtype = list(info["shape"]), _st_dtype(file, key, info["dtype"])
        start = base + info["data_offsets"][0]
        if not shape:
            return _pread(file, start, dtype.itemsize, dtype).reshape(())
        index = tuple(index) + tuple(slice(None) for _ in range(len(shape) - len(index)))
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
        r0, r1 = bounds[0]
        row_elems = 1
        for n in shape[1:]:
            row_elems *= n
        row_bytes = row_elems * dtype.itemsize
        rest = tuple(slice(a, b) for a, b in bounds[1:])
        whole_rows = all(a == 0 and b == n for (a, b), n in zip(bounds[1:], shape[1:]))
        out = torch.empty([b - a for a, b in bounds], dtype=dtype)
        if out.numel() == 0:
            return out
        # whole rows: one read; a column slice: blocks of rows (bounded memory), each cut to the
        # slice
        step = max(r1 - r0, 1) if whole_rows else max(1, _READ_BLOCK_BYTES // max(row_bytes, 1))
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            rows = _pread(file, start + a * row_bytes, (b - a) * row_bytes,
                          dtype).view([b - a] + shape[1:])
            out[a - r0: b - r0] = rows if whole_rows else rows[(slice(None),) + rest]
        return out

    def close(self) -> None:
        self._handles.clear()


ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_READ_BLOCK_BYTES = 64 << 20


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

_SCALE = "_scale_inv"
"""The suffix of an FP8 weight's block scales (`weight` -> `weight_scale_inv`)."""


def _fp8_block(path: str, scaled: bool) -> Optional[Tuple[int, int]]:
    """The (rows, columns) of one FP8 scale block that config.json's `quantization_config` names
    (None without one); any other quantization is refused by name, before a weight is read."""
    config = os.path.join(path, "config.json")
    quant = read_config(path).get("quantization_config") if os.path.isfile(config) else None
    if not quant and not scaled:
        return None
    method = (quant or {}).get("quant_method")
    block = (quant or {}).get("weight_block_size")
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2
                               and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{config}: quantization_config {quant!r} is not block-wise FP8 with weight_scale_inv "
            "(quant_method fp8, weight_block_size [rows, cols]), the one quantized form Tandem "
            "reads: use the checkpoint's bf16 release")
    return block[0], block[1]


def safetensors_header(file: str) -> Tuple[int, dict]:
    """(byte offset of the data section, the JSON header) of a safetensors file."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        # any other file's first 8 bytes read as a length are huge: check before reading that much
        if n > size - 8:
            raise CheckpointError(f"{file} is not a safetensors file, or is truncated (its header "
                                  f"length {n} exceeds the file's {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        raise CheckpointError(f"{file} is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    for key, info in header.items():
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                and isinstance(info.get("shape"), list)
                and isinstance(info.get("data_offsets"), list)
                and len(info["data_offsets"]) == 2):
            raise CheckpointError(f"{file} is not a safetensors file (tensor {key} has no "
                                  "dtype/shape/data_offsets in its header)")
    _check_spans(file, header)
    return 8 + n, header


def _check_spans(file: str, header: dict) -> None:
    """Each tensor's data_offsets span exactly its shape x dtype, without overlapping another's (the
    safetensors library's own checks; one past the file's end is a partial shard,
    CheckpointReader._check_files): a span a byte off read the neighbouring bytes as the tensor."""
    spans = []
    for key, info in header.items():
        start, end = info["data_offsets"]
        numel = 1
        for n in info["shape"]:
            numel *= int(n)
        need = numel * _st_dtype(file, key, info["dtype"]).itemsize
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise CheckpointError(f"{file}: tensor {key}'s data_offsets {info['data_offsets']} are "
                                  "not a byte range")
        if end - start != need:
            raise CheckpointError(f"{file}: tensor {key}'s data_offsets span {end - start} bytes, "
                                  f"its shape {info['shape']} and dtype {info['dtype']} need "
                                  f"{need}")
        spans.append((start, end, key))
    spans.sort()
    for (_, end, key), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise CheckpointError(f"{file}: tensors {key} and {other} overlap in its data section")


def _st_dtype(file: str, key: str, name: str) -> torch.dtype:
    if name not in ST_DTYPES:
        raise CheckpointError(f"{file}: tensor {key} has dtype {name}, which Tandem cannot read "
                              f"(readable: {', '.join(ST_DTYPES)})")
    return ST_DTYPES[name]


def _pread(file: str, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    buf = bytearray(nbytes)
    with open(file, "rb") as f:
        f.seek(offset)
        got = f.readinto(buf)
    if got != nbytes:
        raise CheckpointError(f"{file} is truncated: {nbytes} bytes wanted at offset {offset}, "
                              f"{got} there")
    return torch.frombuffer(buf, dtype=dtype)


def read_json(file: str) -> dict:
    """A JSON object file's contents; CheckpointError naming the file if it is not one."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    return data


def read_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    hf = read_json(cfg_file)
    hf = hf.get("text_config", hf) if "text_config" in hf and "hidden_size" not in hf else hf
    for key, value in hf.items():  # a number written as text ("4", "1e-6") read as one, or crashed
        if key in NUMERIC_FIELDS and value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{cfg_file}: {key}={json.dumps(value)[:40]} must be a number")
    return hf


NUMERIC_FIELDS = frozenset((
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "moe_intermediate_size", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers",
    "routed_scaling_factor", "n_group", "topk_group", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "partial_rotary_factor",
    "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "full_attention_interval"))
"""config.json fields Tandem reads as numbers."""


def stop_ids(eod_id: Optional[int], dirs: Sequence[str]) -> Optional[List[int]]:
    """The ids that end a response: the tokenizer's EOS (`eod_id`) and every `eos_token_id` the
    first Hugging Face directory among `dirs` lists (generation_config.json, else config.json).
    Chat models end a turn with more than their EOS (GLM-4.5 with <|user|> and <|observation|>),
    and transformers' and vLLM's generation stop at each. None when there is none."""
    ids = [] if eod_id is None else [int(eod_id)]
    for d in dirs:
        if not d or not os.path.isfile(os.path.join(d, "config.json")):
            continue
        for name in ("generation_config.json", "config.json"):
            path = os.path.join(d, name)
            value = read_json(path).get("eos_token_id") if os.path.isfile(path) else None
            if value is not None:
                ids += [value] if isinstance(value, int) else [int(v) for v in value]
                break
        break
    return list(dict.fromkeys(ids)) or None
