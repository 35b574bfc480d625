"""Small building blocks: RMSNorm, rotary embeddings, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, or over groups of `group_size` channels (one norm per
    hyper-connection stream). `zero_centered` (Qwen3-Next / Qwen3.5 / Qwen4-Exp) stores w - 1: the
    output is x_hat * (1 + w), computed in fp32 before the cast back, and w starts at 0."""

    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False, group_size: int = 0):
        super().__init__()
        if group_size and dim % group_size:
            raise ValueError(f"RMSNorm width {dim} is not a multiple of its group size {group_size}")
        self.eps, self.zero_centered, self.group_size = eps, zero_centered, group_size
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Llama/Qwen/GLM do) and cast back.
        x32 = x.float()
        if self.group_size:
            x32 = x32.unflatten(-1, (-1, self.group_size))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group_size:
            x32 = x32.flatten(-2)
        if self.zero_centered:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` channels of each head (partial rotary when < head_dim).

    Uses the half-split (rotate_half) convention of Llama/Qwen/GLM-4.5-MoE in `transformers`.
    Positions are explicit per token, so cached decoding with ragged sequence lengths just works.
    """

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_seq_len: int):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        self.register_buffer("cos", torch.empty(max_seq_len, rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, rotary_dim), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Fill the cos/sin tables (again after `to_empty`: non-persistent buffers are not loaded)."""
        if self.cos.is_meta:
            return
        r = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        angles = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float32), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, x_bnsd: torch.Tensor, positions_bs: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions_bs].unsqueeze(1).to(x_bnsd.dtype)  # [B,1,S,R]
        sin = self.sin[positions_bs].unsqueeze(1).to(x_bnsd.dtype)
        rot, rest = x_bnsd[..., : self.rotary_dim], x_bnsd[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat([out, rest], dim=-1) if rest.numel() else out


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); also the shared expert of MoE layers."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
