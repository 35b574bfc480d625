"""Hyper-connections: a residual stream widened to `hc_count` parallel streams (Qwen4-Exp).

Instead of one residual vector of width H per token, the trunk carries hc_count of them side by
side, flattened to one [B, S, hc*H] tensor (stream c occupies channels c*H .. (c+1)*H - 1). The
embedding enters as hc_count identical copies. Around every block (token mixer, then MLP/MoE) a
HyperConnection

1. *mixes*: normalises each stream on its own (grouped zero-centred RMSNorm), computes per-channel
   weights in (0, 1) for every stream from all streams together through a low-rank bottleneck
   (hc*H -> lowrank -> hc*H, silu then sigmoid), and averages the weighted streams into the block's
   single H-wide input;
2. *injects*: the block's H-wide output is written back into every stream, scaled per token and per
   stream by a weight in (0, 2) (twice a sigmoid, so 1 at zero logits) computed from the same
   normalised streams. The streams themselves are carried un-normalised (the residual).

Both logits are divided by hc_count before their nonlinearity, as Qwen4-Exp does, which keeps them
in the same range whatever the number of streams. The trunk's last mixer has no inject half (combine
False): it stands where a final norm would and yields the H-wide hidden state the LM head reads.

Precision: under mixed precision (autocast) the streams are fp32 whatever dtype reaches the mixer,
on every layout: one process's autocast leaves the embedding and the residual adds in fp32, and
FSDP's bf16 policy would otherwise have carried them in bf16 from its gathered embedding on
(trainer/parallel/ data.py). The norm, the gates' nonlinearities, the mixing and the injection run
in that dtype; the three gate projections are matmuls in autocast's dtype (as transformers and vLLM
run them), with fp32 accumulation, from the same bf16 rounding of their weights on every layout. The
mixed block input is handed to the sublayer in autocast's dtype: its first use is a projection or
the router's fp32 cast, and the sequence-parallel gathers and the expert dispatch then move bf16,
not fp32 (one process rounds it the same way, so the layouts still agree).

Tensor parallelism: transformers shards `input_mix_weight_down` row-wise (its input channels split,
partial sums reduced). These matrices are small, so Tandem keeps them replicated
(trainer/parallel/tensor_hybrid.py): each rank mixes and injects its own copy of the streams (its
sequence shard under sequence parallelism, where their gradients are then summed over tp).
"""

from __future__ import annotations

from typing import Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RMSNorm


def stream_dtype(x: torch.Tensor) -> torch.dtype:
    """The hyper-connection streams' dtype: under autocast fp32 (fp64 for an fp64 run) whatever
    reached the mixer; without autocast the dtype the streams arrive in (fp32, or bf16 for a model
    held and run wholly in bf16, whose projections take bf16 inputs)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.promote_types(x.dtype, torch.float32)
    return x.dtype


class HyperConnection(nn.Module):
    """Mix hc_count residual streams into one block input; inject the block output back.

    forward(x_bsX) -> (mixed_bsh, inject_bsc) with combine, else mixed_bsh (X = hc_count *
    hidden_size). inject(x_bsX, out_bsh, inject_bsc) -> the updated streams [B, S, X].
    """

    def __init__(self, hidden_size: int, hc_count: int, lowrank: int, eps: float = 1e-6,
                 combine: bool = True):
        super().__init__()
        self.hidden_size, self.hc_count, self.lowrank = (
            int(hidden_size),
            int(hc_count),
            int(lowrank),
        )
        width = self.hc_count * self.hidden_size
        self.hc_norm = RMSNorm(width, eps, zero_centered=True, group_size=self.hidden_size)
        self.input_mix_weight_down = nn.Linear(width, self.lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(self.lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, self.hc_count, bias=False) if combine else None

    @property
    def combine(self) -> bool:
        return self.block_inject_weight is not None

    def forward(self, x_bsX: torch.Tensor) -> Union[torch.Tensor,
                                                    Tuple[torch.Tensor, torch.Tensor]]:
        hc, h = self.hc_count, self.hidden_size
        if x_bsX.shape[-1] != hc * h:
            raise ValueError(f"HyperConnection expects {hc} x {h} = {hc * h} channels, got "
                             f"{x_bsX.shape[-1]}")
        acc = stream_dtype(x_bsX)
        normed_bsX = self.hc_norm(x_bsX.to(acc))
        # Per-stream, per-channel mixing weights from all streams through a low-rank bottleneck: the
        # projections in the compute dtype, the gates from their logits in the streams' dtype.
        weight_bsr = F.silu(self.input_mix_weight_down(normed_bsX).to(acc) / hc)
        weight_bsch = torch.sigmoid(self.input_mix_weight_up(weight_bsr).to(acc)).unflatten(-1,
                                                                                            (hc, h))
        mixed_bsh = (weight_bsch * normed_bsX.unflatten(-1, (hc, h))).mean(dim=-2)
        kind = x_bsX.device.type
        # the sublayer's input, as its first matmul would round it
        if torch.is_autocast_enabled(kind):
            mixed_bsh = mixed_bsh.to(torch.get_autocast_dtype(kind))
        if self.block_inject_weight is None:
            return mixed_bsh
        inject_bsc = 2 * torch.sigmoid(self.block_inject_weight(normed_bsX).to(acc) / hc)
        return mixed_bsh, inject_bsc

    def mix(self, x_bsX: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """The same as calling the module (goes through __call__, so FSDP/TP hooks still run)."""
        return self(x_bsX)

    @staticmethod
    def inject(x_bsX: torch.Tensor, out_bsh: torch.Tensor,
               inject_bsc: torch.Tensor) -> torch.Tensor:
        """Residual update: stream c gains out * inject[..., c] (the un-normalised streams are the
        residual), in the streams' dtype (`stream_dtype`: fp32 under bf16 compute)."""
        acc = stream_dtype(x_bsX)
        return x_bsX.to(acc) + (out_bsh.to(acc).unsqueeze(-2)
                                * inject_bsc.to(acc).unsqueeze(-1)).flatten(-2)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, hc_count={self.hc_count}, "
                f"lowrank={self.lowrank}, "
                f"combine={self.combine}")
