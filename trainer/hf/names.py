"""The vocabulary of checkpoint name mapping shared by every family: a family's spec, where one
tensor of this model lives in a checkpoint (`Src`), and the error for what a family cannot
express."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from tandem.models.gated_deltanet import qkv_rows_from_hf


class UnsupportedCheckpoint(ValueError):
    """The checkpoint's architecture (or one of its options) cannot be represented by this model."""


def required_field(hf: dict, family: str, key: str):
    """config.json's `key`, which this family's checkpoints must hold: UnsupportedCheckpoint naming
    it when it is missing (a bare KeyError said nothing about the file)."""
    if hf.get(key) is None:
        raise UnsupportedCheckpoint(f"{family}: config.json lacks {key!r}")
    return hf[key]


@dataclass
class FamilySpec:
    name: str
    """One of FAMILIES (the trunk family; `qwen3_next_mtp` is a Qwen3 trunk with `mtp.*`
    weights)."""
    mtp_layout: str = "glm"
    """`glm` (model.layers.{N+j}.*) or `qwen3_next` (mtp.*)."""
    zero_centered_norm: bool = False
    """Checkpoint RMSNorm weights are stored as w - 1 (Qwen3-Next)."""
    router_bias: bool = False
    """The checkpoint carries `mlp.gate.e_score_correction_bias` (GLM, DeepSeek)."""
    num_mtp_layers: int = 0
    """MTP layers the checkpoint declares."""
    extra: dict = field(default_factory=dict)


@dataclass
class Src:
    """Where one tensor of this model lives in the checkpoint."""

    keys: List[str]
    stacked: bool = False
    """keys[e] is row e of dim 0 (per-expert tensors of a grouped expert weight)."""
    concat: bool = False
    """keys are consecutive row blocks of dim 0 (transformers' `split_ngram_parts` PLE table
    shards)."""
    plus_one: bool = False
    """Zero-centred norm: ours = checkpoint + 1."""
    swap_halves: bool = False
    """eh_proj stored embedding-first while this model concatenates hidden-first: swap the two
    column halves."""
    qkv_groups: Optional[Tuple[int, int, int, int]] = None
    """Gated DeltaNet's in_proj_qkv / conv1d: (num_k_heads, num_v_heads, head_k_dim, head_v_dim).
    The checkpoint stores rows [q | k | v], this model by key-head group (`qkv_rows_from_hf`)."""
    interleaved_rope: Optional[Tuple[int, int, int]] = None
    """MLA's query and latent-key projections: (block, first, width): in each block of `block`
    rows, rows first .. first + width - 1 are rotary channels the checkpoint interleaves in pairs
    (DeepSeek's `rope_interleave`); this model holds them [even | odd]
    (models/latent_attention.py)."""

    @property
    def permutes_rows(self) -> bool:
        """Whether the tensor's rows are reordered on the way in and out (such tensors are small
        enough to read whole, then permute)."""
        return self.qkv_groups is not None or self.interleaved_rope is not None

    def _row_order(self, rows: int) -> torch.Tensor:
        """p with ours = theirs[p]."""
        if self.qkv_groups is not None:
            return qkv_rows_from_hf(*self.qkv_groups)
        block, first, width = self.interleaved_rope
        order = torch.arange(rows).view(-1, block)
        rope = order[:, first:first + width].clone()
        order[:, first:first + width] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
        return order.flatten()

    def to_model_rows(self, value):
        """Checkpoint row order -> this model's."""
        if not self.permutes_rows:
            return value
        return value[self._row_order(value.shape[0])]

    def to_checkpoint_rows(self, value):
        """This model's row order -> the checkpoint's."""
        if not self.permutes_rows:
            return value
        out = value.clone()
        out[self._row_order(value.shape[0])] = value
        return out
