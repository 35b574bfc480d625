"""The vocabulary of checkpoint name mapping shared by every family: a family's spec, where one tensor
of this model lives in a checkpoint (`Src`), and the error for what a family cannot express."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


class UnsupportedCheckpoint(ValueError):
    """The checkpoint's architecture (or one of its options) cannot be represented by this model."""


@dataclass
class FamilySpec:
    name: str
    """One of FAMILIES (the trunk family; `qwen3_next_mtp` is a Qwen3 trunk with `mtp.*` weights)."""
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
    """keys are consecutive row blocks of dim 0 (transformers' `split_ngram_parts` PLE table shards)."""
    plus_one: bool = False
    """Zero-centred norm: ours = checkpoint + 1."""
    swap_halves: bool = False
    """eh_proj stored embedding-first while this model concatenates hidden-first: swap the two
    column halves."""


