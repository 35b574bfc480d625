"""The vocabulary of checkpoint name mapping shared by every family: a family's spec, where one
tensor of this model lives in a checkpoint (`Src`), and the error for what a family cannot
express."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from tandem.models.gated_deltanet import qkv_rows_from_hf


class UnsupportedCheckpoint(ValueError):
    """The checkpoint's architecture (or one of its options) cannot be represented by this model."""


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
    The checkpoint stores rows [q | k | v], this model by key-head group (`qkv_rows_from_hf`); the
    tensor is small, so it is read whole and permuted."""

    def to_model_rows(self, value):
        """Checkpoint row order -> this model's (identity unless `qkv_groups`)."""
        if self.qkv_groups is None:
            return value

        return value[qkv_rows_from_hf(*self.qkv_groups)]

    def to_checkpoint_rows(self, value):
        """This model's row order -> the checkpoint's."""
        if self.qkv_groups is None:
            return value

        out = value.clone()
        out[qkv_rows_from_hf(*self.qkv_groups)] = value
        return out


