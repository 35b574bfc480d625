"""The MTP module's configuration (`MTPConfig`, with its weighted loss `MTPLossConfig`) and
`validate_model`, which checks a trunk and its MTP module together.

Separate from models/config.py (the trunk's `ModelConfig`) so each file holds one section; the
trainer embeds this one in its omegaconf tree as `mtp`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from .config import ModelConfig


@dataclass
class MTPLossConfig:
    weights: List[float] = field(default_factory=list)
    """Explicit per-depth weights w_1..w_K; empty means geometric: w_k = decay**(k-1)."""
    decay: float = 1.0
    """Geometric decay of the per-depth weights when `weights` is empty."""
    normalize: bool = True
    """Divide the weights by their sum, so lambda scales the mean MTP loss (DeepSeek-V3)."""
    lambda_: float = 0.3
    """MTP loss weight lambda at step 0 (written `mtp.loss.lambda` in recipes and overrides)."""
    lambda_after: Dict[int, float] = field(default_factory=dict)
    """Piecewise-constant schedule: from step s on, lambda = value (DeepSeek-V3: 0.3 then 0.1).
    Steps are 0-based (the value first shows in the metrics record of step s + 1) and count samples
    seen in units of the run's first global batch, as the LR schedule's do, so a resume under
    another global batch keeps the milestone at the same point of the data."""
    objective: str = "ce"
    """Per-depth MTP loss: `ce` (cross-entropy on the data, or on the trunk's targets under
    train.distill) or `acceptance` (-log sum_v min(p_v, q_v): the probability that speculative
    sampling accepts the depth's draft q against the trunk's detached distribution p at the position
    whose token it drafts). Use `ce` for pretraining and greedy decoding (it won greedy acceptance
    and held-out loss per depth in bench/mtp_objectives.py, and it shapes the trunk usefully); try
    `acceptance` when fine-tuning a drafter for sampled decoding (it tied `ce` at T=1). Not with
    train.distill (its teacher is already the trunk)."""
    acceptance_ce_weight: float = 0.0
    """With objective=acceptance: add this weight times the data cross-entropy to each depth's
    loss."""

    def validate(self, num_steps: int) -> None:
        """Raise ValueError naming the offending `mtp.loss.*` key (`num_steps`: mtp.num_steps,
        K)."""
        if self.objective not in ("ce", "acceptance"):
            raise ValueError(f"mtp.loss.objective={self.objective!r} must be ce or acceptance")
        if not self.acceptance_ce_weight >= 0:  # `not >=`: NaN fails it too
            raise ValueError(f"mtp.loss.acceptance_ce_weight={self.acceptance_ce_weight} must be "
                             ">= 0")
        if self.weights and len(self.weights) != num_steps:
            raise ValueError(f"mtp.loss.weights has {len(self.weights)} entries but "
                             f"mtp.num_steps={num_steps}")
        if not all(w >= 0 for w in self.weights):
            raise ValueError("mtp.loss.weights must be non-negative")
        if not 0 < self.decay < float("inf"):
            raise ValueError(f"mtp.loss.decay must be positive and finite, got {self.decay}")
        weights = [("mtp.loss.lambda", self.lambda_)] + [
            (f"mtp.loss.lambda_after[{step}]", value) for step, value in self.lambda_after.items()]
        for key, value in weights:  # a negative weight trains the MTP module to predict worse
            if not value >= 0:
                raise ValueError(f"{key} must be >= 0, got {value}")
        for step in self.lambda_after:
            if step < 0:
                raise ValueError(f"mtp.loss.lambda_after[{step}]: a step must be >= 0")


@dataclass
class MTPConfig:
    num_steps: int = 3
    """K: tokens predicted beyond the next one; 0 gives a plain LM with no MTP module (and no
    in-loop evaluation: the evaluator measures drafting)."""
    num_layers: int = 1
    """L: physical MTP transformer layers; step k uses layer (k-1) % L."""
    style: str = "looped"
    """`looped` (DeepSeek-V3 / Qwen3-Next chained module: depth k reads depth k-1's state and the
    embedding of token t+k; what vLLM/SGLang serve as an MTP drafter, hence the default) or
    `parallel` (Gloeckle et al.: K independent heads on the trunk's state, num_layers = num_steps;
    an ablation baseline: serving stacks' MTP proposers run the looped form; not with
    hyper-connections)."""
    moe: bool = True
    """MTP layers use the trunk's MoE MLP (DeepSeek-V3, GLM-4.5, Qwen4-Exp: true, to load or export
    their MTP weights) rather than a dense SwiGLU of model.intermediate_size (false: a cheaper
    drafter layer)."""
    combine: str = "auto"
    """How a looped MTP layer combines the previous depth's state with the next token's embedding:
    `concat_proj` (DeepSeek-V3 / GLM-4.5 / Qwen3-Next: eh_proj(cat(enorm(emb), hnorm(h)))),
    `qwen4_exp` (Qwen4-Exp's drafter: fc_embedding plus an fc_hidden shared by the hyper-connection
    streams) or `auto` (qwen4_exp with hyper-connections, else concat_proj)."""
    qsa_reuse_indices: bool = True
    """With QSA MTP layers: depth 1 runs the MTP indexer and depths 2..K reuse its selection of past
    positions (training and drafting alike, as Qwen4-Exp is served), instead of selecting again.
    Keep true to match serving (vLLM's set_skip_topk) and save the later depths' indexer work; false
    only to measure what reuse costs in acceptance (bench/qsa_reuse.py)."""
    concat_order: str = "emb_hidden"
    """Order in proj(cat(...)): `emb_hidden` (DeepSeek-V3, GLM-4.5, Qwen3-Next: keep it, serving
    stacks assume it) or `hidden_emb` (only to load a checkpoint trained that way)."""
    loss: MTPLossConfig = field(default_factory=MTPLossConfig)
    """The weighted multi-step loss."""
    detach_trunk: bool = False
    """Stop MTP gradients from reaching the trunk's blocks (the shared embedding and head still get
    them): the MTP module learns without pulling the trunk's representations toward drafting. A
    frozen trunk (train.freeze_trunk) needs no detach: it runs without autograd."""
    loss_chunk_tokens: int = 2048
    """Tokens per chunk of the memory-bounded cross-entropy (never a full [tokens x vocab]
    logits)."""
    loss_head_backward: str = "fused"
    """How the head's cross-entropy (trunk and `ce` MTP depths, one chunked pass) gets its
    gradients: `fused` (default, one-device and vocab-parallel head alike: each chunk's gradients
    computed in forward, one head matmul and one softmax fewer per chunk; all depths share one fp32
    [vocab/tp x hidden] weight-gradient buffer, pre-scaled by the loss gradients the trainer
    promises) or `recompute` (each chunk's logits recomputed in backward: memory one chunk of
    logits). Keep `fused` (fewer FLOPs); use `recompute` where that buffer does not fit (`--check`
    counts it: 2.3 GiB at vocabulary 151k x hidden 4096, tp=1)."""
    trunk_input: str = "pre_norm"
    """Trunk state MTP step 1 reads: `pre_norm` (before the final norm; required by
    combine=qwen4_exp, whose drafter reads the streams before the final mixer) or `final_norm`
    (after it, as DeepSeek-V3 / GLM-4.5 / Qwen3-Next MTP weights expect in vLLM, SGLang, Megatron
    and transformers: use it for a concat_proj drafter you will serve, as recipes/finetune_mtp.yaml
    does)."""
    init_from_last_layer: bool = False
    """Fine-tuning a checkpoint without MTP weights: initialise each MTP block from the last trunk
    layer."""
    init_from: str = ""
    """A Tandem checkpoint (step_<N>/ or run directory) or a Hugging Face directory (a released
    model's, with its MTP weights) whose MTP module (its MTP weights only) replaces this run's after
    the trunk is loaded from model.init_from: an MTP refresh puts the drafter of an earlier
    checkpoint on a trunk fine-tuned without it (recipes/mtp_refresh.yaml). Empty: none."""

    def resolved_combine(self, model: "ModelConfig") -> str:
        if self.combine != "auto":
            return self.combine
        return "qwen4_exp" if model.hc_count > 1 else "concat_proj"

    def layer_for_step(self, step: int) -> int:
        """Physical MTP layer used by draft step `step` (1-based)."""
        return (step - 1) % self.num_layers

    def validate(self, model: "ModelConfig") -> None:
        """Raise ValueError naming the offending `mtp.*` key, for this module on top of trunk
        `model`."""
        if self.num_steps < 0:
            raise ValueError(f"mtp.num_steps must be >= 0, got {self.num_steps}")
        if self.num_steps > 0 and self.num_layers <= 0:
            raise ValueError(f"mtp.num_layers must be positive when mtp.num_steps={self.num_steps} "
                             "> 0, got "
                             f"{self.num_layers}")
        if self.style not in ("looped", "parallel"):
            raise ValueError(f"mtp.style must be 'looped' or 'parallel', got {self.style!r}")
        if self.style == "parallel" and self.num_steps and self.num_layers != self.num_steps:
            raise ValueError(f"mtp.num_layers={self.num_layers} must equal "
                             f"mtp.num_steps={self.num_steps} for "
                             "mtp.style=parallel (one independent head per step)")
        if self.combine not in ("auto", "concat_proj", "qwen4_exp"):
            raise ValueError("mtp.combine must be 'auto', 'concat_proj' or 'qwen4_exp', got "
                             f"{self.combine!r}")
        if self.num_steps and self.style == "looped":
            combine = self.resolved_combine(model)
            if combine == "concat_proj" and model.hc_count > 1:
                raise ValueError(f"mtp.combine=concat_proj cannot read the {model.hc_count} "
                                 "hyper-connection streams "
                                 "(model.hc_count > 1): use mtp.combine=qwen4_exp")
            if combine == "qwen4_exp" and model.hc_count == 1:
                raise ValueError("mtp.combine=qwen4_exp needs hyper-connection streams "
                                 "(model.hc_count > 1)")
            if combine == "qwen4_exp" and self.trunk_input != "pre_norm":
                raise ValueError("mtp.trunk_input must be pre_norm with mtp.combine=qwen4_exp (the "
                                 "drafter reads the "
                                 "trunk's streams before the final stream mixer)")
        if self.style == "parallel" and self.num_steps and model.hc_count > 1:
            raise ValueError("mtp.style=parallel is not supported with hyper-connections "
                             "(model.hc_count > 1)")
        if self.concat_order not in ("emb_hidden", "hidden_emb"):
            raise ValueError("mtp.concat_order must be 'emb_hidden' or 'hidden_emb', got "
                             f"{self.concat_order!r}")
        if self.init_from and not self.num_steps:
            raise ValueError("mtp.init_from needs an MTP module to load into (mtp.num_steps > 0)")
        if self.trunk_input not in ("pre_norm", "final_norm"):
            raise ValueError("mtp.trunk_input must be 'pre_norm' or 'final_norm', got "
                             f"{self.trunk_input!r}")
        self.loss.validate(self.num_steps)
        if self.loss_head_backward not in ("recompute", "fused"):
            raise ValueError("mtp.loss_head_backward must be 'recompute' or 'fused', got "
                             f"{self.loss_head_backward!r}")
        if self.loss_chunk_tokens <= 0:
            raise ValueError(
                f"mtp.loss_chunk_tokens must be positive, got {self.loss_chunk_tokens}"
            )


def validate_model(model: ModelConfig, mtp: MTPConfig) -> None:
    """Raise ValueError naming the offending key for impossible model shapes: the trunk's checks
    (`ModelConfig.validate`), then the MTP module's against it (`MTPConfig.validate`)."""
    model.validate()
    mtp.validate(model)
