"""Mixture-of-experts MLP: top-k router, grouped experts, optional shared experts.

Routing follows DeepSeek-V3 / GLM-4.5 (sigmoid scores, a selection-only correction bias, optional
group-limited routing, routed scaling) and Qwen3-MoE / Mixtral (softmax scores). Experts run grouped:
token copies are sorted by expert, and one `torch._grouped_mm` per projection computes every expert's
contiguous block from the per-expert counts as a device tensor, so a one-process MoE forward never
waits for the host (no `.tolist()`/`.item()`; counts come from `scatter_add_`, not `bincount`, which
syncs on CUDA). The kernel sits behind two custom ops (`tandem::grouped_mm` and its backward's
`tandem::grouped_mm_raw`), so `torch.compile` (`train.compile`) traces a block through it without a
graph break. Where the grouped kernel is missing for the device/dtype (or the row strides are not
16-byte aligned) the experts fall back to one matmul per expert over host-side counts
(`model.expert_matmul`). Expert parallelism replaces `GroupedExperts` by a dispatching module built
from it with the same parameters (trainer/parallel/tensor.py `ParallelExperts`, whose `prepare` and
`dispatch` start the exchanges); the model itself holds no process groups.

Auxiliary losses (load balance, z-loss) never travel through return values: `AuxLossGrad` attaches
their gradient to the layer's output during backward (Megatron's approach), so pipeline stages and
the loss code need not know about them. Their values are kept for logging in `last_aux_loss` (a
detached tensor: converting it to a Python float here would be a host sync per layer per micro-batch).

Precision: routing (logits, scores, top-k, the correction-bias comparison and the aux/z-losses)
always computes in fp32, with autocast disabled locally, as Megatron and the reference
implementations do; the experts compute in whatever precision autocast (or the parameters) give;
each token's weighted sum of its top-k expert outputs accumulates in fp32 in slot order
(`combine_expert_outputs`), not by a scatter-add in bf16, so it is bitwise reproducible.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .config import ModelConfig
from .layers import SwiGLU


class AuxLossGrad(torch.autograd.Function):
    """Identity on `output`; in backward, feeds d(aux_loss) = scale into aux_loss's graph."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def expert_counts(flat_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token copies per expert as an int64 device tensor, without a host sync (CUDA's `bincount`
    reads the maximum back to size its output)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_indices.device)
    return counts.scatter_add_(0, flat_indices, torch.ones_like(flat_indices))


# `torch._grouped_mm` behind custom ops: torch.compile then treats the grouped matmul as one opaque
# call (its own fake implementation of the aten op accepts bf16 only, and the 16-byte base-pointer
# check reads `data_ptr()`, which a graph cannot), while eager runs the same kernel as before.
def _base_aligned(t: torch.Tensor) -> torch.Tensor:
    # the grouped kernel needs 16-byte aligned base pointers; a view at an odd offset gets a fresh copy
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
    """`kernel`, answering calls without rows itself: the kernels reject empty operands, and a compiled
    exact expert dispatch cannot branch around them on its data-dependent row count."""

    def run(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        empty = no_rows(a, b, offs)
        return empty if empty is not None else kernel(a, b, offs)

    return run


_torch_grouped_mm_raw = _empty_rows_first(
    _raw_no_rows, lambda a, b, offs: torch._grouped_mm(_base_aligned(a), _base_aligned(b), offs=offs))
_torch_grouped_mm = _empty_rows_first(
    _no_rows, lambda x, w, offs: torch._grouped_mm(_base_aligned(x), _base_aligned(w).transpose(-2, -1), offs=offs))


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
    """Row block e of x [N, in] (rows offs[e-1]:offs[e]) times w[e].T, w [E, out, in] -> [N, out]."""
    return _torch_grouped_mm(x, w, offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    g = grad.contiguous()  # e.g. sum() hands in an expanded (stride-0) gradient, which the kernel rejects
    grad_x = _grouped_mm_raw(g, w, offs) if ctx.needs_input_grad[0] else None  # g_e @ w[e]
    grad_w = _grouped_mm_raw(g.t(), x, offs) if ctx.needs_input_grad[1] else None  # g_e.T @ x_e, per group
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def register_grouped_mm_kernels(device_type: str, grouped_mm, grouped_mm_raw) -> None:
    """Device kernels for the two ops where `torch._grouped_mm` is not the one to use (Ascend NPUs:
    trainer/parallel/device.py registers torch_npu's grouped matmul). The autograd rule above, and with
    it the backward's use of `grouped_mm_raw`, stays the same on every device."""
    _grouped_mm_op.register_kernel(device_type)(_empty_rows_first(_no_rows, grouped_mm))
    _grouped_mm_raw.register_kernel(device_type)(_empty_rows_first(_raw_no_rows, grouped_mm_raw))
    for key in [k for k in _GROUPED_MM_WORKS if k[0] == device_type]:
        del _GROUPED_MM_WORKS[key]  # probe again with the new kernels


_GROUPED_MM_WORKS: Dict[Tuple[str, torch.dtype, int, int], bool] = {}
"""Probe results by (device type, dtype, hidden width, expert width)."""


@torch._dynamo.assume_constant_result  # under torch.compile: probed eagerly while tracing, a constant after
def _grouped_mm_works(device: torch.device, dtype: torch.dtype, hidden: int = 8, inter: int = 8) -> bool:
    """Whether the grouped kernel runs an expert layer of these widths (rows of `hidden` features, experts
    `inter` wide) forward and backward on this device type and dtype. Probed once per shape, at the
    layer's own widths, on three experts (one of them empty) of a few rows: every call the layer makes
    (x [n, hidden] x [E, inter, hidden], h [n, inter] x [E, hidden, inter], and backward's two forms of
    each). Kernels accept some shapes and not others (torch_npu's grouped matmul), so a tiny probe
    would speak for no real layer; CPU has the kernel in torch >= 2.9, CUDA on some architectures/dtypes."""
    key = (device.type, dtype, int(hidden), int(inter))
    if key not in _GROUPED_MM_WORKS:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                # also when first met in decoding, and apart from the caller's autograd: inside an
                # activation-checkpointed block, the block's saved-tensor hooks would take the probe's
                # tensors (its backward then recomputes the block mid-forward) and the selective
                # policy's dispatch mode would count its ops
                with torch.inference_mode(False), torch.enable_grad(), _disable_current_modes(), \
                        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    x = torch.ones(3, hidden, dtype=dtype, device=device, requires_grad=True)
                    up = torch.ones(3, inter, hidden, dtype=dtype, device=device, requires_grad=True)
                    down = torch.ones(3, hidden, inter, dtype=dtype, device=device, requires_grad=True)
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
    # the grouped kernel needs 16-byte aligned row strides (a shape property, so decidable while tracing;
    # base pointers are fixed up inside the op)
    return all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)


def expert_swiglu(x_nh: torch.Tensor, counts: torch.Tensor, gate_eih: torch.Tensor, up_eih: torch.Tensor,
                  down_ehi: torch.Tensor, matmul: str = "auto") -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert (counts[e] rows for expert e, an int device tensor).

    `matmul`: `grouped` (raise if unsupported), `loop` or `auto` (see `ModelConfig.expert_matmul`)."""
    if matmul != "loop":  # the grouped ops take empty row groups (a compiled exact dispatch's count is symbolic)
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
    return (f"model.expert_matmul=grouped: the grouped matmul does not run on {device_type} in {dtype} for hidden "
            f"{hidden} / expert width {inter} (16-byte aligned rows needed)")


def _local_widths(experts: nn.Module) -> Tuple[int, int]:
    """(hidden, expert width) a GroupedExperts layer computes with on this rank (a tensor-parallel
    shard's expert width; a DTensor parameter's local part)."""
    w = experts.gate_proj
    w = w.to_local() if hasattr(w, "to_local") else w
    return int(w.shape[2]), int(w.shape[1])


def expert_path(experts: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """`grouped` or `loop`: the path a GroupedExperts layer's forward takes on `device` computing in
    `dtype` (autocast's, else its weights'), decided as `expert_swiglu` decides it, at the layer's local
    widths. RuntimeError (one line) where `expert_matmul=grouped` cannot run."""
    if experts.matmul == "loop":
        return "loop"
    hidden, inter = _local_widths(experts)
    aligned = all(n * dtype.itemsize % 16 == 0 for n in (hidden, inter))  # contiguous rows: `_rows_aligned`
    if aligned and _grouped_mm_works(device, dtype, hidden, inter):
        return "grouped"
    if experts.matmul == "grouped":
        raise RuntimeError(_grouped_unsupported(device.type, dtype, hidden, inter))
    return "loop"


def expert_paths(model: nn.Module, device: torch.device, autocast_dtype) -> Tuple[str, str]:
    """The routed experts' path in a run: (`moe/expert_path`'s value, a line for the run's start) over
    this rank's GroupedExperts layers of `model`, computing in `autocast_dtype` (None: the weights'
    dtype). The value is `grouped`, `loop` or `mixed` (some of each); ('', '') without MoE layers."""
    grouped, rejected, chosen = 0, set(), 0  # chosen: layers on the loop by model.expert_matmul=loop
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
        why += [f"the grouped kernel does not run hidden {h} x expert width {i} in {d}" for h, i, d in sorted(rejected)]
        line += f", per-expert loop (a host sync per layer) in {loops}: {'; '.join(why)}"
    return value, line


def _expert_loop(x: torch.Tensor, counts, gate, up, down) -> torch.Tensor:
    """The fallback: one matmul per expert (the counts on the host: a sync). Every expert computes,
    an empty one on no rows, so the loop never branches on a count: under train.compile the counts are
    symbolic sizes (trainer/parallel/compile.py) and one graph serves every routing, and every expert
    weight is in the graph (zero gradients for the unused ones, on every rank). Rows past the counts
    (a padded dispatch's padding) are not computed: their outputs are zeros, so the result has x's rows
    as the grouped kernel's does, and its caller never branches on which path ran."""
    valid = sum(counts)
    torch._check(valid <= x.shape[0])  # lets a compiled graph split off the padding without a guard
    *groups, _padding = torch.split(x, [*counts, x.shape[0] - valid])
    outputs = [(F.silu(xe @ gate[e].t()) * (xe @ up[e].t())) @ down[e].t() for e, xe in enumerate(groups)]
    return F.pad(torch.cat(outputs, dim=0), (0, 0, 0, x.shape[0] - valid))


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i (a scatter of distinct indices: no accumulation, deterministic)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum over j = 0..k-1, in that order, of w[t, j] * y[pos[t, j]], accumulated in fp32 and
    cast once to y's dtype. A scatter-add (`index_add_`) would sum the copies in y's dtype (bf16 under
    autocast: a rounding per copy) and, on CUDA, in whatever order its atomics land (runs that differ
    bit for bit). Written as a Function so that backward keeps only y in its own dtype (as the product
    `y * w` did) and the fp32 products stay one [T, H] slice at a time, never [T, k, H]."""

    @staticmethod
    def forward(ctx, y_nh: torch.Tensor, w_tk: torch.Tensor, pos_tk: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_nh, w_tk, pos_tk)
        acc = ctx.acc = torch.promote_types(y_nh.dtype, torch.float32)  # fp32, or fp64 for an fp64 run
        w = w_tk.to(acc)
        out = torch.zeros(w.shape[0], y_nh.shape[1], dtype=acc, device=y_nh.device)
        for j in range(w.shape[1]):
            out.addcmul_(y_nh.index_select(0, pos_tk[:, j]).to(acc), w[:, j : j + 1])
        return out.to(y_nh.dtype)

    @staticmethod
    def backward(ctx, grad_th: torch.Tensor):
        y_nh, w_tk, pos_tk = ctx.saved_tensors
        g, w = grad_th.to(ctx.acc), w_tk.to(ctx.acc)
        grad_y = torch.empty_like(y_nh) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for j in range(w.shape[1]):
            if grad_y is not None:  # each copy's position is written once: no accumulation
                grad_y.index_copy_(0, pos_tk[:, j], (g * w[:, j : j + 1]).to(y_nh.dtype))
            if grad_w is not None:
                grad_w[:, j] = (g * y_nh.index_select(0, pos_tk[:, j]).to(ctx.acc)).sum(-1)
        return grad_y, grad_w.to(w_tk.dtype) if grad_w is not None else None, None


def copy_positions(order: torch.Tensor, k: int) -> torch.Tensor:
    """pos [T, k]: the expert-sorted row of token t's j-th copy (order[pos[t, j]] = t * k + j), which
    both `token_copies`' backward and `combine_expert_outputs` gather by; computed once per layer."""
    return inverse_permutation(order).view(-1, k)


class _TokenCopies(torch.autograd.Function):
    """x[order // k]: every token's k copies in expert-sorted order (copy (t, j) is row pos[t, j]).
    Backward sums each token's k copy gradients in a fixed order (j = 0..k-1) in fp32 and casts once,
    like `combine_expert_outputs`: bitwise reproducible on every device, where indexing's backward (an
    accumulating index_put; index_select's index_add_ uses atomics on CUDA) sums them in the copies'
    dtype, and about 7x faster on CPU than the accumulating index_put."""

    @staticmethod
    def forward(ctx, x_th: torch.Tensor, order: torch.Tensor, pos_tk: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pos_tk)
        return x_th.index_select(0, order // pos_tk.shape[1])

    @staticmethod
    def backward(ctx, grad_nh: torch.Tensor):
        (pos,) = ctx.saved_tensors
        grad = grad_nh.index_select(0, pos[:, 0]).to(torch.promote_types(grad_nh.dtype, torch.float32))
        for j in range(1, pos.shape[1]):
            grad.add_(grad_nh.index_select(0, pos[:, j]))
        return grad.to(grad_nh.dtype), None, None


def token_copies(x_th: torch.Tensor, order: torch.Tensor, pos_tk: torch.Tensor) -> torch.Tensor:
    """Each token's k copies, sorted by expert: row i is token order[i] // k; `pos_tk` is
    `copy_positions(order, k)` (see `_TokenCopies`)."""
    return _TokenCopies.apply(x_th, order, pos_tk)


def combine_expert_outputs(y_sorted_nh: torch.Tensor, pos_tk: torch.Tensor, weights_tk: torch.Tensor) -> torch.Tensor:
    """Each token's routed output, sum_j weights[t, j] * (its j-th copy's expert output), from the
    copies' outputs in expert-sorted order (copy (t, j) is row pos[t, j] of y, `copy_positions`).
    fp32 accumulation in a fixed order (j = 0..k-1, whatever the experts): bitwise reproducible on
    every device, and one bf16 rounding per output instead of one per copy. Returns y's dtype."""
    return _WeightedCombine.apply(y_sorted_nh, weights_tk, pos_tk)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Selection-only bias of aux-loss-free balancing (DeepSeek-V3 `e_score_correction_bias`).
        # A buffer: it is updated by the load rule, never by gradients, and is checkpointed.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        # Routed token copies per expert since the last bias update (load-balance metrics, aux-free rule).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=False)

    def forward(self, x_th: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (weights [T,k], expert indices [T,k], router logits [T,E] in fp32)."""
        # Autocast would turn the fp32 linear back into a bf16 one (and the ops after it follow).
        with torch.autocast(x_th.device.type, enabled=False):
            return self._route(x_th.float(), self.weight.float())

    def _route(self, x_th: torch.Tensor, weight_eh: torch.Tensor):
        cfg = self.cfg
        logits = F.linear(x_th, weight_eh)
        scores = logits.sigmoid() if cfg.router_score == "sigmoid" else logits.softmax(dim=-1)
        choice = scores.detach() + self.e_score_correction_bias
        if cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, self.num_experts // cfg.n_group)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep_groups = group_score.topk(cfg.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_score).scatter_(1, keep_groups, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
            choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        indices = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        with torch.no_grad():
            self.tokens_per_expert += expert_counts(indices.flatten(), self.num_experts).float()
        return weights, indices, logits

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-free balancing step: raise the bias of under-loaded experts, lower over-loaded ones."""
        load = tokens_per_expert.float()
        self.e_score_correction_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored stacked: gate/up [E, I, H], down [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, matmul: str = "auto"):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.matmul = matmul  # ModelConfig.expert_matmul

    def prepare(self, counts: torch.Tensor) -> None:
        """Called with the per-expert counts before the token copies are gathered, so a dispatcher
        (expert parallelism) can start exchanging them early. Nothing to do in one process."""

    def dispatch(self, x_sorted_nh: torch.Tensor, counts: torch.Tensor) -> None:
        """Called with the gathered token copies before `forward`, so a dispatcher (expert parallelism)
        can start sending them while the caller computes something else (the shared expert). Nothing
        to do in one process."""

    def forward(self, x_sorted_nh: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x rows are grouped by expert in order (counts[e] rows for expert e, an int64 tensor on
        x's device); returns the same layout."""
        return expert_swiglu(x_sorted_nh, counts, self.gate_proj, self.up_proj, self.down_proj, self.matmul)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.expert_matmul)
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.resolved_shared_expert_size) if cfg.num_shared_experts > 0 else None
        )
        # Qwen3-Next / Qwen4-Exp scale the shared expert per token by sigmoid(gate(x)).
        self.shared_expert_gate = (nn.Linear(cfg.hidden_size, 1, bias=False)
                                   if cfg.shared_expert_gate and self.shared_experts is not None else None)
        # Gradient scale of the auxiliary losses per forward; the trainer sets 1/micro-batches.
        self.aux_grad_scale = 1.0
        # The last micro-batch's aux + z loss (detached tensor, None until one is computed).
        self.last_aux_loss = None

    def route_and_compute(self, x_th: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sort token copies by expert, run the experts grouped, combine each token's weighted outputs
        (`combine_expert_outputs`: fp32, fixed order), and add the shared expert's output on `x_th`.
        The shared expert runs between `dispatch` and the routed experts: under expert parallelism its
        matmuls are issued while the token copies are in flight (the all-to-all is asynchronous until
        the experts read its output)."""
        k = indices.shape[1]
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, self.cfg.num_experts)  # stays on the device
        self.experts.prepare(counts)
        pos = copy_positions(order, k)
        x_sorted = token_copies(x_th, order, pos)
        self.experts.dispatch(x_sorted, counts)
        shared = self.shared_output(x_th) if self.shared_experts is not None else None
        out = combine_expert_outputs(self.experts(x_sorted, counts), pos, weights)
        return out if shared is None else out + shared

    def shared_output(self, x_th: torch.Tensor) -> torch.Tensor:
        """The shared expert's output (scaled by its gate where there is one)."""
        shared = self.shared_mlp(x_th)
        if self.shared_expert_gate is not None:
            # under tp the replicated gate scales a partial output: its gradient is partial over tp
            shared = torch.sigmoid(self.shared_expert_gate(x_th)) * shared
        return shared

    def shared_mlp(self, x_th: torch.Tensor) -> torch.Tensor:
        """The shared expert's MLP (tensor parallelism computes it on its shards instead)."""
        return self.shared_experts(x_th)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        shape = x_bsh.shape
        x = x_bsh.reshape(-1, shape[-1])
        weights, indices, logits = self.router(x)
        out = self.route_and_compute(x, weights, indices)
        aux = self._aux_loss(logits, indices) if self.training and torch.is_grad_enabled() else None
        if aux is not None:
            self.last_aux_loss = aux.detach()
            out = AuxLossGrad.apply(out, aux, self.aux_grad_scale)
        return out.view(shape)

    def _aux_loss(self, logits: torch.Tensor, indices: torch.Tensor):
        """Balance + z loss of one micro-batch from the fp32 router logits, computed in fp32."""
        with torch.autocast(logits.device.type, enabled=False):
            return self._aux_terms(logits.float(), indices)

    def _aux_terms(self, logits: torch.Tensor, indices: torch.Tensor):
        cfg = self.cfg
        terms = []
        if cfg.balance == "aux_loss" and cfg.aux_loss_coef > 0:
            # Switch/DeepSeek balance loss: E * sum_i f_i * P_i, f_i the routed fraction (x E/k), P_i mean prob.
            probs = logits.sigmoid() if cfg.router_score == "sigmoid" else logits.softmax(-1)
            probs = probs / probs.sum(-1, keepdim=True)
            frac = expert_counts(indices.flatten(), cfg.num_experts).float() / indices.numel()
            terms.append(cfg.aux_loss_coef * cfg.num_experts * (frac * probs.mean(0)).sum())
        if cfg.z_loss_coef > 0:
            terms.append(cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean())
        return sum(terms) if terms else None
