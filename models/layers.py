"""Small building blocks: RMSNorm, rotary embeddings, SwiGLU MLP, attention over a decoding
cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

STEP_COUNTERS = ("tokens_per_expert", "indexer_loss_sum", "aux_loss_sum")
"""Buffers a training forward adds to and the trainer reads and zeroes once per step (fp32, not
checkpointed): the routers' expert loads and the [sum, forwards] pairs behind the logged
`loss/indexer` and `moe/aux_loss`. An activation checkpoint's recomputation puts them back as they
were (trainer/parallel/activation_checkpoint.py), so each forward counts once."""


def loss_counter() -> torch.Tensor:
    """A [sum, forwards] pair of STEP_COUNTERS."""
    return torch.zeros(2, dtype=torch.float32)


@torch.no_grad()
def count_loss(counter: torch.Tensor, loss: torch.Tensor) -> None:
    """Add one forward's loss (detached) to a `loss_counter`."""
    counter += torch.stack([loss.detach().float(), loss.new_ones((), dtype=torch.float32)])

InitRule = Tuple[str, float]
"""How a parameter starts: ("ones" | "zeros" | "normal" | "a_log", std). `a_log` is Gated DeltaNet's
decay rate log(uniform(0.01, 16)), as transformers initialises it."""


@dataclass(frozen=True)
class InitScales:
    """The model-wide scales a module's `param_init` draws from."""

    std: float
    """Every weight no module names otherwise: normal(0, model.init_std)."""
    residual_std: float
    """Residual output projections (attention and linear attention outputs, MLP and expert down
    projections): init_std / sqrt(2 x layers), GPT-2 style, so the residual stream does not grow
    with depth."""


@torch.no_grad()
def draw_init(p: torch.Tensor, rule: InitRule) -> None:
    """Draw `p` in place from the global RNG as `rule` says (a no-op on the meta device); the
    trainer draws the same rules shard by shard from per-parameter seeds
    (trainer/parallel/sharded_params.py)."""
    kind, std = rule
    if kind == "ones":
        p.fill_(1.0)
    elif kind == "zeros":
        p.zero_()
    elif kind == "a_log":
        p.uniform_(0.01, 16.0).log_()
    else:
        p.normal_(0.0, std)


def _rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
                   group_size: int):
    """(RMSNorm's output, rstd): x normalised in fp32 (as Llama/Qwen/GLM do) over its last dimension
    or over groups of `group_size` channels, rstd [..., groups, 1] the fp32 reciprocal RMS. The
    arithmetic is transformers' (pow, mean, rsqrt, then the weight in its own dtype), so outputs
    match it bit for bit."""
    x32 = x.float()
    if group_size:
        x32 = x32.unflatten(-1, (-1, group_size))
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x32 * rstd
    if group_size:
        x_hat = x_hat.flatten(-2)
    if zero_centered:
        return x_hat.mul_(1.0 + weight.float()).to(x.dtype), rstd
    x_hat = x_hat.to(x.dtype)
    if x_hat.dtype == torch.promote_types(x_hat.dtype, weight.dtype):
        # a product is exact either way round; no second [.., dim] buffer
        return x_hat.mul_(weight), rstd
    return weight * x_hat, rstd


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a hand-written backward. Autograd's backward of the decomposed forward (pow,
    mean, rsqrt, two products, casts) makes about a dozen passes over [tokens x dim], each into a
    fresh buffer, and keeps fp32 x and x_hat alive from forward. On a CPU these passes run at memory
    speed: fwd + bwd of a 2048 x 256 fp32 norm took 2.6-3.0 ms, 1.7-1.9 ms this way, and
    bench/throughput.py's step runs 17 of them. This keeps x (its own dtype) and rstd, and takes
    both gradients from the one product g * x (two reductions over it), then writes d x in place
    over g * w: three full-size buffers. Gradients are summed in fp32; the weight's arrives in its
    own dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool, group_size: int):
        out, rstd = _rms_normalize(x, weight, eps, zero_centered, group_size)
        # [..., groups, 1]
        ctx.save_for_backward(x, weight, rstd if group_size else rstd.unsqueeze(-2))
        ctx.zero_centered, ctx.group_size = zero_centered, group_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for an fp64 run
        gs = ctx.group_size or x.shape[-1]
        # [groups, group]
        w = (weight.to(acc) + 1.0 if ctx.zero_centered else weight.to(acc)).view(-1, gs)
        x3 = x.to(acc).reshape(-1, w.shape[0], gs)  # [rows, groups, group]
        g3 = grad_out.to(acc).reshape(x3.shape)
        r = rstd.to(acc).reshape(x3.shape[:2])
        # With x_hat = x r and out = w x_hat: d weight = sum over rows of g x r, and
        # d x = r g w - x r^3 (sum of g w x over the group) / group; both from the one product g x
        g_x = g3 * x3
        grad_w = (torch.einsum("ngi,ng->gi", g_x, r).reshape(weight.shape).to(weight.dtype)
                  if ctx.needs_input_grad[1] else None)
        grad_x = None
        if ctx.needs_input_grad[0]:
            coef = torch.einsum("ngi,gi->ng", g_x, w).mul_(r.pow(3)).div_(gs).unsqueeze(-1)
            grad_x = (g3 * w).mul_(r.unsqueeze(-1)).addcmul_(x3, coef,
                                                             value=-1.0).view(x.shape).to(x.dtype)
        return grad_x, grad_w, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             group_size: int = 0) -> torch.Tensor:
    """RMSNorm of x (see `RMSNorm`), through `_RMSNormFunction` where a gradient is wanted."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps, zero_centered, group_size)
    return _rms_normalize(x, weight, eps, zero_centered, group_size)[0]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, or over groups of `group_size` channels (one norm per
    hyper-connection stream). `zero_centered` (Qwen3-Next / Qwen3.5 / Qwen4-Exp) stores w - 1: the
    output is x_hat * (1 + w), computed in fp32 before the cast back, and w starts at 0."""

    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False,
                 group_size: int = 0):
        super().__init__()
        if group_size and dim % group_size:
            raise ValueError(
                f"RMSNorm width {dim} is not a multiple of its group size {group_size}"
            )
        self.eps, self.zero_centered, self.group_size = eps, zero_centered, group_size
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered, self.group_size)

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        """The scale starts at 1 (stored as 0 when zero-centred)."""
        return ("zeros" if self.zero_centered else "ones"), 0.0


@dataclass(frozen=True)
class Yarn:
    """YaRN's RoPE parameters (model.rope_* keys; their docstrings say what each does)."""

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def magnitude(factor: float, m: float = 1.0) -> float:
        """YaRN's mscale: 0.1 m ln(factor) + 1 (1 when not stretched)."""
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.mscale and self.mscale_all_dim:
            return self.magnitude(self.factor, self.mscale) / self.magnitude(self.factor,
                                                                             self.mscale_all_dim)
        return self.magnitude(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What MLA's softmax scale is multiplied by (DeepSeek-V3 scales q.k, not only the rotated
        channels)."""
        return self.magnitude(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, rotary_dim: int, theta: float) -> torch.Tensor:
        """Each pair's frequency: the original's for the fast-turning pairs (more than beta_fast
        turns over the original context), divided by `factor` for the slow ones (under beta_slow),
        blended linearly between."""
        def pair(turns):  # the (fractional) pair index that turns `turns` times
            return rotary_dim * math.log(self.original_max_len / (turns * 2 * math.pi)) / (
                2 * math.log(theta))

        low = max(math.floor(pair(self.beta_fast)), 0)
        high = min(math.ceil(pair(self.beta_slow)), rotary_dim - 1)
        base = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low)
                / max(high - low, 0.001)).clamp(0, 1)
        return (1.0 / (self.factor * base)) * ramp + (1.0 / base) * (1 - ramp)


def plain_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Each rotated pair's frequency in plain RoPE: theta^(-2i / rotary_dim)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's RoPE scaling (model.rope_scaling=llama3; the model.rope_* keys): pairs that turn
    fewer than `low_freq_factor` times over the original context have their frequency divided by
    `factor`, those turning more than `high_freq_factor` times keep it, and the turns between blend
    the two linearly. No attention factor."""

    factor: float
    original_max_len: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    attention_factor = 1.0
    softmax_factor = 1.0

    def inv_freq(self, rotary_dim: int, theta: float) -> torch.Tensor:
        inv = plain_inv_freq(rotary_dim, theta)
        turns = self.original_max_len * inv / (2 * math.pi)  # over the original context
        kept = ((turns - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor)).clamp(0, 1)
        return inv / self.factor * (1 - kept) + inv * kept


class RotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` channels of each head (partial rotary when < head_dim).

    Uses the half-split (rotate_half) convention of Llama/Qwen/GLM-4.5-MoE in `transformers`.
    Positions are explicit per token, so cached decoding with ragged sequence lengths just works.
    """

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_seq_len: int,
                 scaling: Optional[Yarn | Llama3Rope] = None):
        super().__init__()
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        self.register_buffer("cos", torch.empty(max_seq_len, rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, rotary_dim), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Fill the cos/sin tables (again after `to_empty`: non-persistent buffers are not
        loaded)."""
        if self.cos.is_meta:
            return
        r = self.rotary_dim
        inv_freq = (plain_inv_freq(r, self.theta) if self.scaling is None
                    else self.scaling.inv_freq(r, self.theta))
        angles = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float32), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        scale = 1.0 if self.scaling is None else self.scaling.attention_factor
        self.cos.copy_(emb.cos() * scale)
        self.sin.copy_(emb.sin() * scale)

    def forward(self, x_bnsd: torch.Tensor, positions_bs: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions_bs].unsqueeze(1).to(x_bnsd.dtype)  # [B,1,S,R]
        sin = self.sin[positions_bs].unsqueeze(1).to(x_bnsd.dtype)
        if torch.is_grad_enabled() and x_bnsd.requires_grad:
            return _RotaryFunction.apply(x_bnsd, cos, sin)
        return rotate(x_bnsd, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           transpose: bool = False) -> torch.Tensor:
    """x with its first R = cos.shape[-1] channels rotated: x cos + rotate_half(x) sin,
    rotate_half(x) = [-x_b, x_a] for the halves x_a, x_b (the rest passes through); `transpose`
    applies the transposed rotation, g cos + [g_b, -g_a] sin, which is its backward. Written into
    one output of x's layout with no concatenated or negated copies; the same roundings as the
    concatenating form (a - b = a + (-b))."""
    r = cos.shape[-1]
    h = r // 2
    if r == x.shape[-1]:
        out = x * cos
    # the rest passes through (no `out=` into a strided slice: torch.compile would break its graph
    # there)
    else:
        out = x.clone()
        out[..., :r].mul_(cos)
    if transpose:
        out[..., :h].add_(x[..., h:r] * sin[..., h:])
        out[..., h:r].sub_(x[..., :h] * sin[..., :h])
    else:
        out[..., :h].sub_(x[..., h:r] * sin[..., :h])
        out[..., h:r].add_(x[..., :h] * sin[..., h:])
    return out


def cached_attention(q_bhsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor,
                     mask_bts: torch.Tensor, scale: Optional[float] = None,
                     fold: bool = False) -> torch.Tensor:
    """Decoding's attention of a few new queries per row over a cache prefix: queries [B, Hq, T,
    D], keys and values [B, Hk, S, D] (any dtype; read in the queries'), `mask_bts` [B, T, S] True
    where a query attends. On CPU the kernel behind `enable_gqa=True` is up to several times slower
    at batched decoding's shapes than `folded_attention`'s layout, which then runs instead (the same
    values; `folds_query_heads` says where, bench/decode_attention.py measures both). `scale`: the
    softmax scale, None for 1 / sqrt(D). `fold`: fold wherever (MLA's one latent key for every
    head, which the unfolded kernels copy once per head)."""
    if fold or folds_query_heads(q_bhsd, k_bksd):
        return folded_attention(q_bhsd, k_bksd, v_bksd, mask_bts, scale)
    return F.scaled_dot_product_attention(q_bhsd, k_bksd.to(q_bhsd.dtype), v_bksd.to(q_bhsd.dtype),
                                          attn_mask=mask_bts[:, None], scale=scale,
                                          enable_gqa=q_bhsd.shape[1] > k_bksd.shape[1])


def folds_query_heads(q_bhsd: torch.Tensor, k_bksd: torch.Tensor) -> bool:
    """Whether `cached_attention` runs `folded_attention`: grouped heads and several rows on CPU,
    in bf16 / fp16, or in fp32 with several queries per row (fp32's one-query kernel is faster
    as it is, and so is one row's; on accelerators the fused kernels' own grouping is kept)."""
    b, hq, t = q_bhsd.shape[:3]
    return (hq > k_bksd.shape[1] and b > 1 and q_bhsd.device.type == "cpu"
            and (t > 1 or q_bhsd.dtype != torch.float32))


def folded_attention(q_bhsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor,
                     mask_bts: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """`cached_attention` with the Hq / Hk query heads that share a key head folded into the query
    length ([B, Hk, Hq / Hk x T, D]): each row reads its key head once, none is expanded per query
    head."""
    b, hq, t, d = q_bhsd.shape
    hk = k_bksd.shape[1]
    groups = hq // hk
    out = F.scaled_dot_product_attention(q_bhsd.reshape(b, hk, groups * t, d),
                                         k_bksd.to(q_bhsd.dtype), v_bksd.to(q_bhsd.dtype),
                                         attn_mask=mask_bts[:, None].repeat(1, 1, groups, 1),
                                         scale=scale)
    return out.view(b, hq, t, -1)


class _RotaryFunction(torch.autograd.Function):
    """`rotate` with its backward written out (the transposed rotation): autograd's backward of the
    sliced, negated and concatenated form zero-fills and copies each slice's gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, sin, transpose=True), None, None


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); also the shared expert of MoE layers."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        return ("normal", scales.residual_std) if name == "down_proj.weight" else None
