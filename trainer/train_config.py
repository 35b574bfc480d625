"""`TrainConfig`, the `train` section of the config tree: steps and batch, optimizer and LR
schedule, precision, distillation, the bad-step guard. Kept apart from trainer/config.py, which
assembles the sections into `TandemConfig`; `validate` gets that whole tree as `cfg` (typed Any:
this module cannot import the one that imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config_checks import require


@dataclass
class TrainConfig:
    max_steps: int = 300
    """Optimizer steps to run. A resume under another global batch still stops at this step count
    (so after another number of tokens), while the LR schedule stays max_steps x the run's first
    global batch samples long (see warmup_steps)."""
    seed: int = 1234
    """Seed for weights, data order and dropout; runs are deterministic on CPU."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one data-parallel rank."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (per data-parallel rank)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 30
    """Linear warm-up steps to lr: schedule step i (0-based) runs at lr x (i + 1) / warmup_steps, so
    the first step at lr / warmup_steps and step warmup_steps at lr; then the cosine decay from lr,
    which reaches min_lr at schedule step warmup_steps + decay_steps (with decay_steps 0, at
    max_steps: the last step of a short run stays above min_lr). The LR schedule follows consumed
    samples, not steps: its
    step counts (warmup_steps, decay_steps, max_steps) are steps of the run's first global batch,
    kept in checkpoints, so a resume under another global batch (layout, micro-batch, accumulation)
    keeps the LR in step with the tokens seen; while the global batch is unchanged a schedule step
    is a step. A warm-up as long as the run (>= max_steps: a recipe shortened with train.max_steps)
    never decays, and reaches lr only at the last step when the two are equal; the run starts with
    a warning saying so."""
    decay_steps: int = 0
    """Cosine decay length after warm-up (steps of the first global batch, as warmup_steps); 0
    decays over the rest of max_steps, so a resume with another max_steps re-plans the decay (the
    LR of an annealed run rises again; the resume line says so): set it to keep a schedule while
    max_steps changes."""
    weight_decay: float = 0.1
    """AdamW weight decay, decoupled, on every tensor of 2 or more dimensions: the matrices, the
    experts, the embedding and head (as Megatron-LM and nanoGPT decay them) and the PLE n-gram
    tables, whose rows a batch rarely hashes to shrink by exp(-lr x weight_decay) each step with
    no gradient to hold them; not on norms, biases, Gated DeltaNet's A_log / dt_bias (1-D) or the
    router biases (buffers)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer_kernel: str = "auto"
    """AdamW's kernel: `fused` (one kernel per parameter list updates weights, moments and step on
    the device: on CPU 2.5x faster than `foreach` in a training step, ~1 ulp apart from it),
    `foreach` (torch's multi-tensor path) or `auto`: fused on CPU and CUDA, foreach elsewhere
    (torch_npu releases differ in whether they have the fused kernel; set `fused` where yours
    does)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    dtype: str = "auto"
    """Compute dtype: `auto` (bf16 autocast on a GPU/NPU with bf16 and on a CPU with bf16
    instructions, else fp32), `bf16` (refused on accelerators without it; CPU autocast has it,
    emulated where not native) or `fp32`. Keep `auto`; pin `bf16` in cluster recipes (fail rather
    than silently train 2x slower in fp32 on a card without it) and `fp32` for exact comparisons and
    the CPU tests."""
    log_interval: int = 1
    """Write a training record to metrics.jsonl every this many steps."""
    resume: bool = False
    """Resume from the newest complete checkpoint in run.dir (also `tandem train --resume`)."""
    freeze_trunk: bool = False
    """Train only the MTP module: the trunk gets no gradients and no optimizer state, runs under
    no_grad, and checkpoints hold only the MTP module (+ optimizer) and a fingerprinted reference to
    `model.init_from`, which resume, `tandem eval` and `tandem export` read the trunk from. Use it
    to add or improve a drafter on a released checkpoint without changing its outputs
    (recipes/finetune_mtp.yaml; memory stays near inference); false trains trunk and MTP jointly
    (pretraining). Without model.init_from the frozen trunk is its random initialisation (layout
    tests use that); the run warns."""
    frozen_dtype: str = "auto"
    """dtype a frozen trunk (train.freeze_trunk) is stored in: `auto` = the compute dtype (bf16 when
    training bf16, fp32 otherwise), `bf16` or `fp32`. It never trains, so it needs no fp32 master.
    Keep `auto`; set one explicitly only to compare a bf16-stored trunk against an fp32 one."""
    malloc_mmap_threshold: int = -1
    """glibc's mmap threshold (bytes) the trainer sets at start-up (mallopt; a no-op off glibc Linux
    and when MALLOC_MMAP_THRESHOLD_ is set): -1 (auto) = 65536 when fine-tuning a checkpoint
    (model.init_from), else glibc's default; 0 = glibc's default (a dynamic threshold that climbs to
    32 MiB as large blocks are freed, leaving later freed read and all-gather buffers resident); > 0
    that threshold. A small one costs page faults on every large host allocation (CPU training: the
    tiny recipe's steps 12x the faults)."""
    distill: str = "none"
    """MTP targets: `none` (data labels), `argmax` or `soft` (self-distillation: the trunk's own
    next-token argmax / distribution at the target position, soft = chunked soft cross-entropy).
    `none` for pretraining and whenever the data is what the model will generate; `soft` when
    fine-tuning a drafter for a frozen trunk (train.freeze_trunk) on data it did not generate: the
    drafter learns to predict the trunk, which is what acceptance measures (soft won sampled
    acceptance in bench/mtp_objectives.py); `argmax` (the trunk's greedy choices as hard labels)
    when the drafter will serve greedy decoding. Not with parallel.tp > 1 yet."""
    bad_step_policy: str = "skip"
    """On a non-finite loss/grad norm or a loss spike: `skip` (drop the update), `halt` (checkpoint
    the last good state and exit non-zero) or `rewind` (reload the last checkpoint, skip the batch).
    `skip` for unattended runs with rare bad batches; `rewind` when a bad step may already have
    corrupted state the skip cannot undo (optimizer moments after a spike); `halt` to investigate by
    hand (debugging, ablations where any instability invalidates the run). A rewind before the
    first checkpoint (or with checkpoint.interval=0) has nothing to reload: it drops the update and
    skips the batch, as `skip` does, and says so."""
    spike_factor: float = 0.0
    """A step whose losses summed over the depths (weight 1 each, so a lambda schedule does not
    move it) exceed this factor times their running mean is bad (0 disables); judged once
    min(5, spike_window) good steps are in the mean (a resume brings the checkpoint's)."""
    spike_window: int = 20
    """Steps in the running mean that spike detection compares against."""
    max_skips: int = 5
    """More bad steps than this within `skip_window` steps halts the run."""
    skip_window: int = 100
    """Window (in steps) over which bad steps are counted."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward, per transformer block (trunk and MTP layers): `none`,
    `full` (keep only each block's input) or `selective` (keep matmul and attention outputs;
    recompute norms, activations, rotary and routing). `none` when activations fit (fastest);
    `selective` first when they do not (less peak memory for a little recompute); `full` when that
    is still too much (about one more forward per step). docs/results.md measures both."""
    compile: bool = False
    """`torch.compile` each transformer block's training forward (trunk and MTP layers; regional, as
    torchtitan does) under every parallel layout (TP/SP blocks with their DTensor parameters
    included) and activation checkpointing mode (which wraps the compiled forward). Decoding and
    evaluation run eager. On for long runs on accelerators (the cluster recipes): compiled steps
    took 0.67-0.81 of the eager time in miniature, for tens of seconds to minutes of compilation per
    process; off for short runs, debugging and the CPU tests."""
    grad_reduce_dtype: str = "fp32"
    """Dtype of the data-parallel gradient reduction under bf16 training: `fp32` (default; exact
    sums of the bf16-computed gradients) or `bf16` (half the traffic: when the gradient reduction,
    not compute, bounds the step, e.g. many data-parallel ranks over a slow inter-node network).
    Master weights, optimizer state and the sum over a step's micro-batches stay fp32 (with
    parallel.reshard_after_microbatch=false the fp32 sums are cast to bf16 for the one
    reduce-scatter; dp_mode=allreduce then all-reduces them in fp32)."""

    def validate(self, cfg: Any) -> None:
        require("train", self, [
            ("max_steps", self.max_steps >= 0, "must be >= 0"),
            ("seed", 0 <= self.seed < 2**32, "must be in [0, 2**32)"),
            ("micro_batch_size", self.micro_batch_size > 0, "must be positive"),
            ("grad_accum_steps", self.grad_accum_steps > 0, "must be positive"),
            ("lr", self.lr > 0, "must be positive"),
            ("min_lr", 0 <= self.min_lr <= self.lr, "must be in [0, train.lr]"),
            ("beta1", 0 <= self.beta1 < 1, "must be in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "must be in [0, 1)"),
            ("eps", self.eps > 0, "must be positive"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("decay_steps", self.decay_steps >= 0, "must be >= 0 (0: the rest of max_steps)"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("optimizer_kernel", self.optimizer_kernel in ("auto", "fused", "foreach"),
             "must be auto, fused or foreach"),
            ("dtype", self.dtype in ("auto", "bf16", "fp32"), "must be auto, bf16 or fp32"),
            ("grad_reduce_dtype", self.grad_reduce_dtype in ("fp32", "bf16"),
             "must be fp32 or bf16"),
            ("log_interval", self.log_interval > 0, "must be positive"),
            ("frozen_dtype", self.frozen_dtype in ("auto", "bf16", "fp32"),
             "must be auto, bf16 or fp32"),
            ("malloc_mmap_threshold", self.malloc_mmap_threshold >= -1,
             "must be -1 (auto), 0 or a size in bytes"),
            ("distill", self.distill in ("none", "argmax", "soft"), "must be none, argmax or soft"),
            ("distill", self.distill == "none" or cfg.mtp.loss.objective == "ce",
             "must be none with mtp.loss.objective=acceptance (its teacher is already the trunk)"),
            ("activation_checkpointing",
             self.activation_checkpointing in ("none", "full", "selective"),
             "must be none, full or selective"),
            ("bad_step_policy", self.bad_step_policy in ("skip", "halt", "rewind"),
             "must be skip, halt or rewind"),
            ("spike_factor", self.spike_factor == 0 or self.spike_factor > 1,
             "must be 0 (off) or > 1"),
            ("spike_window", self.spike_window > 0, "must be positive"),
            ("max_skips", self.max_skips >= 0, "must be >= 0"),
            ("skip_window", self.skip_window > 0, "must be positive"),
        ])
