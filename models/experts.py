"""The routed experts (`GroupedExperts`: SwiGLU weights stacked per expert) and their matmuls: every
expert's contiguous block of token copies in one grouped matmul per projection (`torch._grouped_mm`
behind the custom ops `tandem::grouped_mm` and its backward's `tandem::grouped_mm_raw`, so
`torch.compile` traces through it without a graph break), with the counts as a device tensor (no
host sync); where the grouped kernel is missing for the device and dtype, or the row strides are not
16-byte aligned, one matmul per expert over host-side counts (`model.expert_matmul`). `expert_paths`
says which path each layer takes, at a run's start."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .layers import InitRule, InitScales


def _base_aligned(t: torch.Tensor) -> torch.Tensor:
    # the grouped kernel needs 16-byte aligned base pointers; a view at an odd offset gets a fresh
    # copy
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _raw_no_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> Optional[torch.Tensor]:
    """`grouped_mm_raw`'s result when its groups hold no rows, else None."""
    if b.dim() == 3 and a.shape[0] == 0:
        return a.new_zeros(0, b.shape[-1])
    if b.dim() == 2 and b.shape[0] == 0:
        return a.new_zeros(offs.shape[0], a.shape[0], b.shape[-1])
    return None


def _no_rows(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> Optional[torch.Tensor]:
    """`grouped_mm`'s result when x has no rows, else None."""
    return x.new_zeros(0, w.shape[1]) if x.shape[0] == 0 else None


def _empty_rows_first(no_rows: Callable, kernel: Callable) -> Callable:
    """`kernel`, answering calls without rows itself: the kernels reject empty operands, and a
    compiled exact expert dispatch cannot branch around them on its data-dependent row count. Rows
    past the last group (a padded dispatch's padding) come back zero: the kernel leaves them
    unwritten, and their garbage went through the SiLU into NaN input gradients (harmless only
    while the dispatch discarded them; anomaly mode stopped on them)."""

    def run(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        empty = no_rows(a, b, offs)
        if empty is not None:
            return empty
        out = kernel(a, b, offs)
        if out.dim() == 2:  # row groups (not the weight gradient's [E, out, in])
            rows = torch.arange(out.shape[0], device=out.device).unsqueeze(1)
            out = out.masked_fill(rows >= offs[-1], 0)  # on the device: no sync
        return out

    return run


_torch_grouped_mm_raw = _empty_rows_first(
    _raw_no_rows, lambda a, b,
    offs: torch._grouped_mm(_base_aligned(a), _base_aligned(b), offs=offs))
_torch_grouped_mm = _empty_rows_first(
    _no_rows, lambda x, w,
    offs: torch._grouped_mm(_base_aligned(x), _base_aligned(w).transpose(-2, -1), offs=offs))


@torch.library.custom_op("tandem::grouped_mm_raw", mutates_args=())
def _grouped_mm_raw(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=offs)`: a [N, K] x b [E, K, M] -> [N, M] (row groups of a), or
    a [M, N] x b [N, K] -> [E, M, K] (groups along the shared dimension N)."""
    return _torch_grouped_mm_raw(a, b, offs)


@_grouped_mm_raw.register_fake
def _(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


@torch.library.custom_op("tandem::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row block e of x [N, in] (rows offs[e-1]:offs[e]) times w[e].T, w [E, out, in] -> [N,
    out]."""
    return _torch_grouped_mm(x, w, offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    # e.g. sum() hands in an expanded (stride-0) gradient, which the kernel rejects
    g = grad.contiguous()
    grad_x = _grouped_mm_raw(g, w, offs) if ctx.needs_input_grad[0] else None  # g_e @ w[e]
    # g_e.T @ x_e, per group
    grad_w = _grouped_mm_raw(g.t(), x, offs) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def register_grouped_mm_kernels(device_type: str, grouped_mm, grouped_mm_raw) -> None:
    """Device kernels for the two ops where `torch._grouped_mm` is not the one to use (Ascend NPUs:
    trainer/parallel/device.py registers torch_npu's grouped matmul). The autograd rule above, and
    with it the backward's use of `grouped_mm_raw`, stays the same on every device."""
    _grouped_mm_op.register_kernel(device_type)(_empty_rows_first(_no_rows, grouped_mm))
    _grouped_mm_raw.register_kernel(device_type)(_empty_rows_first(_raw_no_rows, grouped_mm_raw))
    for key in [k for k in _GROUPED_MM_WORKS if k[0] == device_type]:
        del _GROUPED_MM_WORKS[key]  # probe again with the new kernels


_GROUPED_MM_WORKS: Dict[Tuple[str, torch.dtype, int, int], bool] = {}
"""Probe results by (device type, dtype, hidden width, expert width)."""


def _constant_under_compile(fn: Callable) -> Callable:
    """`torch._dynamo.assume_constant_result`: torch.compile calls `fn` eagerly while tracing and
    keeps its result as a constant. Written out (it sets this one attribute) so that importing the
    model does not import dynamo, 0.6 s in every process, compiled or not;
    tests/unit/test_expert_path.py holds the two equal."""
    fn._dynamo_marked_constant = True
    return fn


# under torch.compile: probed eagerly while tracing, a constant after
@_constant_under_compile
def _grouped_mm_works(device: torch.device, dtype: torch.dtype, hidden: int = 8,
                      inter: int = 8) -> bool:
    """Whether the grouped kernel runs an expert layer of these widths (rows of `hidden` features,
    experts `inter` wide) forward and backward on this device type and dtype. Probed once per shape,
    at the layer's own widths, on three experts (one of them empty) of a few rows: every call the
    layer makes (x [n, hidden] x [E, inter, hidden], h [n, inter] x [E, hidden, inter], and
    backward's two forms of each). Kernels accept some shapes and not others (torch_npu's grouped
    matmul), so a tiny probe would speak for no real layer; CPU has the kernel in torch >= 2.9, CUDA
    on some architectures/dtypes."""
    key = (device.type, dtype, int(hidden), int(inter))
    if key not in _GROUPED_MM_WORKS:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                # also when first met in decoding, and apart from the caller's autograd: inside an
                # activation-checkpointed block, the block's saved-tensor hooks would take the
                # probe's tensors (its backward then recomputes the block mid-forward) and the
                # selective policy's dispatch mode would count its ops
                with torch.inference_mode(False), torch.enable_grad(), _disable_current_modes(), \
                        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    x = torch.ones(3, hidden, dtype=dtype, device=device, requires_grad=True)
                    up = torch.ones(3, inter, hidden, dtype=dtype, device=device,
                                    requires_grad=True)
                    down = torch.ones(3, hidden, inter, dtype=dtype, device=device,
                                      requires_grad=True)
                    offs = torch.tensor([1, 1, 3], dtype=torch.int32, device=device)
                    _grouped_mm(_grouped_mm(x, up, offs), down, offs).sum().backward()
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                ok = False
        _GROUPED_MM_WORKS[key] = ok
    return _GROUPED_MM_WORKS[key]


def _grouped_mm(x_nh: torch.Tensor, w_eoh: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row block e of x (rows offs[e-1]:offs[e]) times w[e].T: weights are stored [E, out, in]."""
    return _grouped_mm_op(x_nh, w_eoh, offs)


def _rows_aligned(t: torch.Tensor) -> bool:
    # the grouped kernel needs 16-byte aligned row strides (a shape property, so decidable while
    # tracing; base pointers are fixed up inside the op)
    return all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)


def expert_swiglu(x_nh: torch.Tensor, counts: torch.Tensor, gate_eih: torch.Tensor,
                  up_eih: torch.Tensor,
                  down_ehi: torch.Tensor, matmul: str = "auto") -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert (counts[e] rows for expert e, an int device
    tensor).

    `matmul`: `grouped` (raise if unsupported), `loop` or `auto` (see
    `ModelConfig.expert_matmul`)."""
    # the grouped ops take empty row groups (a compiled exact dispatch's count is symbolic)
    if matmul != "loop":
        # autocast has no rule for _grouped_mm: cast as it would for a matmul
        dev = x_nh.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else gate_eih.dtype
        x, gate, up, down = (t.to(dtype) for t in (x_nh, gate_eih, up_eih, down_ehi))
        if _grouped_mm_works(x.device, dtype, x.shape[-1], gate.shape[1]) and \
                all(_rows_aligned(t) for t in (x, gate, up, down)):
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(_grouped_mm(x, gate, offs)) * _grouped_mm(x, up, offs)
            return _grouped_mm(h, down, offs)
        if matmul == "grouped":
            raise RuntimeError(_grouped_unsupported(dev, dtype, x.shape[-1], gate.shape[1]))
    return _expert_loop(x_nh, counts.tolist(), gate_eih, up_eih, down_ehi)


def _grouped_unsupported(device_type: str, dtype: torch.dtype, hidden: int, inter: int) -> str:
    return (f"model.expert_matmul=grouped: the grouped matmul does not run on {device_type} in "
            f"{dtype} for hidden "
            f"{hidden} / expert width {inter} (16-byte aligned rows needed)")


def _local_widths(experts: nn.Module) -> Tuple[int, int]:
    """(hidden, expert width) a GroupedExperts layer computes with on this rank (a tensor-parallel
    shard's expert width; a DTensor parameter's local part)."""
    w = experts.gate_proj
    w = w.to_local() if hasattr(w, "to_local") else w
    return int(w.shape[2]), int(w.shape[1])


def expert_path(experts: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """`grouped` or `loop`: the path a GroupedExperts layer's forward takes on `device` computing in
    `dtype` (autocast's, else its weights'), decided as `expert_swiglu` decides it, at the layer's
    local widths. RuntimeError (one line) where `expert_matmul=grouped` cannot run."""
    if experts.matmul == "loop":
        return "loop"
    hidden, inter = _local_widths(experts)
    # contiguous rows: `_rows_aligned`
    aligned = all(n * dtype.itemsize % 16 == 0 for n in (hidden, inter))
    if aligned and _grouped_mm_works(device, dtype, hidden, inter):
        return "grouped"
    if experts.matmul == "grouped":
        raise RuntimeError(_grouped_unsupported(device.type, dtype, hidden, inter))
    return "loop"


def expert_paths(model: nn.Module, device: torch.device, autocast_dtype) -> Tuple[str, str]:
    """The routed experts' path in a run: (`moe/expert_path`'s value, a line for the run's start)
    over this rank's GroupedExperts layers of `model`, computing in `autocast_dtype` (None: the
    weights' dtype). The value is `grouped`, `loop` or `mixed` (some of each); ('', '') without MoE
    layers."""
    # chosen: layers on the loop by model.expert_matmul=loop
    grouped, rejected, chosen = 0, set(), 0
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            dtype = autocast_dtype or m.gate_proj.dtype
            if expert_path(m, device, dtype) == "grouped":
                grouped += 1
            elif m.matmul == "loop":
                chosen += 1
            else:
                rejected.add((*_local_widths(m), str(dtype).removeprefix("torch.")))
    loops = sum(1 for m in model.modules() if isinstance(m, GroupedExperts)) - grouped
    if grouped + loops == 0:
        return "", ""
    value = "mixed" if grouped and loops else "grouped" if grouped else "loop"
    line = f"MoE experts on {device.type}: grouped matmul in {grouped} of {grouped + loops} layers"
    if loops:
        why = ["model.expert_matmul=loop"] if chosen else []
        why += [f"the grouped kernel does not run hidden {h} x expert width {i} in {d}" for h, i,
                d in sorted(rejected)]
        line += f", per-expert loop (a host sync per layer) in {loops}: {'; '.join(why)}"
    return value, line


def _expert_loop(x: torch.Tensor, counts, gate, up, down) -> torch.Tensor:
    """The fallback: one matmul per expert (the counts on the host: a sync). Every expert computes,
    an empty one on no rows, so the loop never branches on a count: under train.compile the counts
    are symbolic sizes (trainer/parallel/compile.py) and one graph serves every routing, and every
    expert weight is in the graph (zero gradients for the unused ones, on every rank). Rows past the
    counts (a padded dispatch's padding) are not computed: their outputs are zeros, so the result
    has x's rows as the grouped kernel's does, and its caller never branches on which path ran."""
    valid = sum(counts)
    torch._check(valid <= x.shape[0])  # lets a compiled graph split off the padding without a guard
    *groups, _padding = torch.split(x, [*counts, x.shape[0] - valid])
    outputs = [(F.silu(xe @ gate[e].t()) * (xe @ up[e].t())) @ down[e].t() for e,
               xe in enumerate(groups)]
    return F.pad(torch.cat(outputs, dim=0), (0, 0, 0, x.shape[0] - valid))


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored stacked: gate/up [E, I, H], down [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 matmul: str = "auto"):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.matmul = matmul  # ModelConfig.expert_matmul

    def prepare(self, counts: torch.Tensor) -> None:
        """Called with the per-expert counts before the token copies are gathered, so a dispatcher
        (expert parallelism) can start exchanging them early. Nothing to do in one process."""

    def dispatch(self, x_sorted_nh: torch.Tensor, counts: torch.Tensor) -> None:
        """Called with the gathered token copies before `forward`, so a dispatcher (expert
        parallelism) can start sending them while the caller computes something else (the shared
        expert). Nothing to do in one process."""

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        return ("normal", scales.residual_std) if name == "down_proj" else None

    def forward(self, x_sorted_nh: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x rows are grouped by expert in order (counts[e] rows for expert e, an int64 tensor on
        x's device); returns the same layout."""
        return expert_swiglu(x_sorted_nh, counts, self.gate_proj, self.up_proj, self.down_proj,
                             self.matmul)
