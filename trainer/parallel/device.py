"""The device layer: the one place that knows about cuda / npu / cpu and nccl / hccl / gloo.

Nothing else in Tandem calls `torch.cuda` (or `torch.npu`) directly; it asks this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
from dataclasses import dataclass

import torch

from tandem.models.experts import register_grouped_mm_kernels

from ..config_checks import ConfigError

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H800 PCIe", 756.0), ("H100 NVL", 835.0),
                    ("H200 NVL", 835.0), ("H200", 989.0), ("H100", 989.0), ("H800", 989.0),
                    ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
                    ("L40S", 362.0), ("910B3", 313.0))
"""Dense bf16 peak TFLOP/s per device, for MFU: the first key the device's name contains (the
PCIe and NVL forms of a card before its SXM form, whose figure is higher). A card not here (or a
910B other than the B3) gets 0, and its MFU is left out unless logging.peak_tflops names its peak:
a near figure would report a wrong MFU."""


@dataclass(frozen=True)
class Device:
    type: str
    """`cuda`, `npu` or `cpu`."""
    backend: str
    """Process-group backend: `nccl`, `hccl` or `gloo`."""
    device: torch.device
    """This process's device."""

    @property
    def is_accelerator(self) -> bool:
        return self.type != "cpu"

    @property
    def process_group_backend(self) -> str:
        """The default process group's backend: on accelerators a device-to-backend mapping that
        adds gloo for CPU tensors (`cpu:gloo,cuda:nccl`, `cpu:gloo,npu:hccl`), which DCP's
        async_save needs (torch 2.13 refuses a group without a CPU backend); `gloo` on CPU."""
        return f"cpu:gloo,{self.type}:{self.backend}" if self.is_accelerator else self.backend

    @property
    def module(self):
        """torch.cuda / torch.npu, or None on CPU."""
        return getattr(torch, self.type) if self.is_accelerator else None

    def synchronize(self) -> None:
        if self.is_accelerator:
            self.module.synchronize()

    def reset_peak_memory(self) -> None:
        if self.is_accelerator:
            self.module.reset_peak_memory_stats(self.device)

    def peak_memory_gb(self) -> float:
        """Peak allocated device memory; on CPU the process's peak resident set size."""
        if self.is_accelerator:
            return self.module.max_memory_allocated(self.device) / 2**30
        # ru_maxrss is KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def peak_tflops(self) -> float:
        """Known dense bf16 peak of this accelerator (0 when unknown, and on CPU)."""
        if not self.is_accelerator:
            return 0.0
        name = self.module.get_device_name(self.device)
        return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), 0.0)

    def supports_bf16(self) -> bool:
        """bf16 compute: CPU autocast always; CUDA from Ampere on; NPUs as torch_npu reports."""
        if not self.is_accelerator:
            return True
        check = getattr(self.module, "is_bf16_supported", None)
        if check is None:
            return True
        # torch counts emulation by default: a V100 or T4 "has" bf16, many times slower than fp32
        return bool(check(including_emulation=False) if self.type == "cuda" else check())

    def native_bf16(self) -> bool:
        """bf16 at full speed: accelerators that support it, CPUs with bf16 instructions
        (`cpu_native_bf16`). CPU autocast runs bf16 anywhere, but emulated it is many times slower
        than fp32."""
        return self.supports_bf16() if self.is_accelerator else cpu_native_bf16()

    def autocast_dtype(self, requested: str):
        """bf16 autocast under `bf16`, and under `auto` where bf16 is native (`native_bf16`); None
        (fp32, no autocast) otherwise. `check_dtype` has already refused `bf16` where it is
        unsupported."""
        if requested == "bf16" or (requested == "auto" and self.native_bf16()):
            return torch.bfloat16
        return None

    def check_dtype(self, requested: str) -> None:
        """Refuse `train.dtype=bf16` on hardware without bf16 (one line naming the key)."""
        if requested == "bf16" and not self.supports_bf16():
            name = self.module.get_device_name(self.device)
            raise ConfigError(f"config key 'train.dtype'='bf16' but this {self.type} device "
                              f"({name}) has no native bf16; use train.dtype=fp32")


# torch.cpu.get_capabilities() keys for native bf16 arithmetic: x86 AVX512-BF16 and AMX-BF16, Arm's
# BF16 extension (NEON and SVE).
_CPU_BF16_FEATURES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def cpu_native_bf16() -> bool:
    """Whether this CPU has bf16 instructions, as torch's cpuinfo reports them. Without them (e.g.
    an AVX2 EPYC) a 256x256 bf16 matmul took 26.8 ms against fp32's 0.42 ms, so `train.dtype=auto`
    keeps fp32."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:  # torch >= 2.13
        found = caps()
        return any(bool(found.get(key, False)) for key in _CPU_BF16_FEATURES)
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported",
                                                          "_is_amx_tile_supported")]
    return any(bool(probe()) for probe in probes if probe is not None)


M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
FINETUNE_MMAP_THRESHOLD = 65536


def set_malloc_mmap_threshold(threshold: int) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (`mallopt`): blocks at least that large are
    mmapped and go back to the system when freed. glibc's default threshold is dynamic: each freed
    mmapped block raises it (up to 32 MiB), so later blocks of that size come from the heap and stay
    resident once freed. MTP fine-tuning of a 446M-parameter checkpoint peaked at 0.64 x the fp32
    model per rank (2 FSDP ranks) that way instead of 0.49 (bench/finetune_memory.py). Returns
    whether it was set: not off glibc Linux, nor when the user set MALLOC_MMAP_THRESHOLD_ (glibc
    applied theirs at start)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # glibc only (musl, macOS: ValueError / None)
            return False
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (ValueError, OSError, AttributeError):
        return False


def frozen_dtype(cfg, device: "Device") -> torch.dtype:
    """The dtype a frozen trunk is kept in (train.frozen_dtype; `auto` = the compute dtype)."""
    choice = cfg.train.frozen_dtype
    if choice == "auto":
        return device.autocast_dtype(cfg.train.dtype) or torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]


def autocast_context(device_type: str, dtype):
    """The forward's precision context: autocast to `dtype` on `device_type`, or nothing (fp32) for
    None. Master weights, gradients and optimizer state stay fp32 either way."""
    return torch.autocast(device_type,
                          dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers the `npu` device with torch)
    except ImportError:
        return False
    return torch.npu.is_available()


def npu_grouped_mm_kernels(gmm):
    """The MoE's grouped-matmul ops (models/moe.py `tandem::grouped_mm`, `tandem::grouped_mm_raw`)
    on torch_npu's `npu_grouped_matmul` (`gmm`; list in, list out). Groups come as the cumulative
    row offsets the ops already carry (group_list_type=0, int64); `split_item` 2 / 3 return one
    tensor.
      grouped_mm(x [N, in], w [E, out, in]) -> [N, out]: row groups of x (group_type=0) times
      w[e].T; grouped_mm_raw(a [N, K], b [E, K, M]) -> [N, M]: row groups of a times b[e] (the input
      gradient); grouped_mm_raw(a [M, N], b [N, K]) -> [E, M, K]: groups along the shared dimension
      N
        (group_type=2), a_e @ b_e per group (the weight gradient)."""

    def grouped_mm(x, w, offs):
        return gmm([x], [w.transpose(-2, -1)], group_list=offs.to(torch.int64), split_item=2,
                   group_type=0, group_list_type=0)[0]

    def grouped_mm_raw(a, b, offs):
        if b.dim() == 3:
            return gmm([a], [b], group_list=offs.to(torch.int64), split_item=2, group_type=0,
                       group_list_type=0)[0]
        return gmm([a], [b], group_list=offs.to(torch.int64), split_item=3, group_type=2,
                   group_list_type=0)[0]

    return grouped_mm, grouped_mm_raw


def _use_npu_grouped_mm() -> None:
    import torch_npu

    if hasattr(torch_npu, "npu_grouped_matmul"):  # older torch_npu: the MoE's per-expert loop
        register_grouped_mm_kernels("npu", *npu_grouped_mm_kernels(torch_npu.npu_grouped_matmul))


def _device_count(kind: str) -> int:
    """Visible devices of `kind` (cuda / npu); ConfigError naming `device` when there are none."""
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.device_count()
    if kind == "npu" and _npu_available():
        return torch.npu.device_count()
    raise ConfigError({"cuda": "config key 'device'='cuda' but no CUDA device is visible",
                       "npu": "config key 'device'='npu' but torch_npu is not installed or no NPU "
                              "is visible"}[kind])


def resolve_device(requested: str = "auto", local_rank: int | None = None,
                   dtype: str = "fp32") -> Device:
    """Pick the device and collective backend; `requested` is the config's `device` key, `dtype` the
    config's `train.dtype` (checked against the device). Raises ConfigError (one line naming the
    key) when the device is not there or cannot compute in that dtype."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    kind = requested
    if kind == "auto":
        if torch.cuda.is_available():
            kind = "cuda"
        elif _npu_available():
            kind = "npu"
        else:
            kind = "cpu"
    visible = _device_count(kind) if kind in ("cuda", "npu") else 0
    if kind in ("cuda", "npu") and local_rank >= visible:
        raise ConfigError(f"config key 'device'={requested!r}: this process is local rank "
                          f"{local_rank}, but {visible} {kind} device(s) are visible here; start "
                          "at most that many processes per node")
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = Device("cuda", "nccl", torch.device("cuda", local_rank))
    elif kind == "npu":
        torch.npu.set_device(local_rank)
        device = Device("npu", "hccl", torch.device("npu", local_rank))
        _use_npu_grouped_mm()
    elif kind == "cpu":
        device = Device("cpu", "gloo", torch.device("cpu"))
    else:
        raise ConfigError(f"config key 'device'={requested!r} must be auto, cpu, cuda or npu")
    device.check_dtype(dtype)
    return device
