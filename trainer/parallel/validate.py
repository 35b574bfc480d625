"""Layout validation: pure arithmetic on the config, callable without torch.distributed.

`load_config` checks the parallel section's own values (`ParallelConfig.validate` in
trainer/config.py); what this module checks needs the world size and the model's final shape (which
`model.init_from` may still change after the config loads). `init_parallel` calls `validate_layout`
before it creates any process group, and `tandem launch slurm` before it writes a script, so an
impossible layout fails in one line naming the keys, not deep inside a collective.
"""

from __future__ import annotations

from typing import Sequence

from ..config import TandemConfig
from ..config_checks import ConfigError
from .pipeline_plan import PipelinePlan


def microbatches_held(cfg: TandemConfig, rank: int) -> float:
    """How many pipeline micro-batches' activations pp rank `rank` holds at its peak, in units of
    all of its layers', as torch's schedules run: GPipe holds every one; 1F1B pp - rank; interleaved
    1F1B runs (v - 1) pp + 2 (pp - 1 - rank) forward chunks (1/v of its layers each) before its
    first backward, and holds one more. `activations_held` with equal chunks."""
    v = cfg.parallel.pp_virtual_stages if cfg.parallel.pp_schedule == "interleaved_1f1b" else 1
    return activations_held(cfg, rank, [1] * v) / v


def activations_held(cfg: TandemConfig, rank: int, chunk_units: Sequence[float]) -> float:
    """The peak of the activations pp rank `rank` holds as torch's schedules run, in the units of
    `chunk_units` (what one micro-batch leaves in each of the rank's stages, in stage order): GPipe
    holds every micro-batch, 1F1B pp - rank. Interleaved 1F1B (torch's ScheduleInterleaved1F1B)
    runs (v - 1) pp + 2 (pp - 1 - rank) forwards before its first backward, then one forward and
    one backward at a time; forward k runs chunk (k // pp) % v and backward k chunk
    v - 1 - (k // pp) % v, so chunks of unequal size (a balanced or explicit pp_layout, the MTP
    depths on the last) peak where the running sum does, not at the mean chunk's count."""
    p = cfg.parallel
    if p.pp <= 1:
        return sum(chunk_units)
    n = pipeline_microbatches(cfg)
    if p.pp_schedule == "gpipe":
        return n * sum(chunk_units)
    if p.pp_schedule != "interleaved_1f1b":
        return min(p.pp - rank, n) * sum(chunk_units)
    v, per_round = len(chunk_units), n // max(1, n // p.pp)  # torch's microbatches_per_round
    total = n * v
    warmup = min((v - 1) * per_round + 2 * (p.pp - 1 - rank), total)
    held = peak = sum(chunk_units[(k // per_round) % v] for k in range(warmup))
    for k in range(total - warmup):
        held += chunk_units[((warmup + k) // per_round) % v]
        peak = max(peak, held)
        held -= chunk_units[v - 1 - (k // per_round) % v]
    return peak


def microbatch_sequences(cfg: TandemConfig) -> int:
    """Sequences in one forward of a rank: train.micro_batch_size, or under a pipeline its step's
    sequences over the pipeline micro-batches (`pipeline_microbatches`), which the memory and
    communication estimates size each micro-batch's activations by."""
    if cfg.parallel.pp <= 1:
        return cfg.train.micro_batch_size
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps // pipeline_microbatches(cfg)


def pipeline_microbatches(cfg: TandemConfig) -> int:
    """Pipeline micro-batches per step on one data-parallel rank (the schedule splits the rank's
    train.micro_batch_size * train.grad_accum_steps sequences into this many equal chunks).

    `parallel.pp_microbatches` when set; otherwise train.grad_accum_steps when that already fills
    the pipeline, else the smallest divisor of the step's sequences that is >= parallel.pp and >=
    grad_accum_steps (a multiple of pp for the interleaved schedule), so that no micro-batch holds
    more than train.micro_batch_size sequences. Raises ConfigError (one line naming the keys and
    the fix) when the sequences cannot be split so."""
    p, t = cfg.parallel, cfg.train
    total = t.micro_batch_size * t.grad_accum_steps
    interleaved = p.pp_schedule == "interleaved_1f1b"
    if p.pp_microbatches:
        n = p.pp_microbatches
        if n < p.pp:
            raise ConfigError(f"parallel.pp_microbatches={n} pipeline micro-batches is below the "
                              "pipeline depth "
                              f"parallel.pp={p.pp}")
        if total % n:
            raise ConfigError(f"parallel.pp_microbatches={n} does not divide the {total} samples "
                              "per step per "
                              "data-parallel rank")
        if interleaved and n % p.pp:
            raise ConfigError(f"interleaved 1F1B needs the micro-batch count {n} divisible by "
                              f"parallel.pp={p.pp}")
        return n
    ok = lambda n: n >= p.pp and total % n == 0 and not (interleaved and n % p.pp)  # noqa: E731
    if p.pp <= 1 or ok(t.grad_accum_steps):
        return t.grad_accum_steps
    # no fewer than grad_accum_steps: a micro-batch is then at most train.micro_batch_size sequences
    # (the memory the run was sized for); interleaving with 3 of 2 at pp=2 ran 2 of 3
    for n in range(max(p.pp, t.grad_accum_steps), total + 1):
        if ok(n):
            return n
    need = "a multiple of" if interleaved else "at least"
    raise ConfigError("train.micro_batch_size*train.grad_accum_steps = "
                      f"{t.micro_batch_size}*{t.grad_accum_steps} = "
                      f"{total} sequences per step per data-parallel rank cannot be split into "
                      f"parallel.pp={p.pp} "
                      f"pipeline micro-batches; make it {need} {p.pp} (raise "
                      "train.micro_batch_size or "
                      "train.grad_accum_steps)")


def layout_dp(cfg: TandemConfig, world_size: int) -> int:
    """The data-parallel degree of the parallel section at `world_size`, which needs no model
    shape; ConfigError when the degrees do not make up the world size."""
    p = cfg.parallel
    # the section's own values, as load_config checked them (a config edited since included)
    p.validate(cfg)
    model_parallel = p.tp * p.pp * p.cp * p.ep
    if p.dp:
        if p.dp * model_parallel != world_size:
            raise ConfigError(f"parallel.tp*pp*cp*ep*dp = {p.tp}*{p.pp}*{p.cp}*{p.ep}*{p.dp} = "
                              f"{p.dp * model_parallel} "
                              f"does not equal the world size {world_size}")
        return p.dp
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.tp*pp*cp*ep = "
                          f"{p.tp}*{p.pp}*{p.cp}*{p.ep} = {model_parallel}")
    return world_size // model_parallel


def validate_layout(cfg: TandemConfig, world_size: int) -> int:
    """Check the parallel layout against the model, the batch and the world size; return dp.

    Raises ConfigError (one line) for: world size not the product tp*pp*cp*ep*dp, heads / kv heads
    (attention and QSA) or Gated DeltaNet key / value heads not divisible by tp, experts not
    divisible by ep, too few layers (or a bad pp_layout) for the pipeline stages, a stage placement
    (pp_layout, pp_depth_stages, pp_balance) without a pipeline, fewer pipeline
    micro-batches than the pipeline depth, sequence parallelism with data.seq_len not divisible by
    tp, and tensor-parallel widths (vocab, MLP, shared expert) not divisible by tp.
    """
    p, m = cfg.parallel, cfg.model
    dp = layout_dp(cfg, world_size)
    if p.cp > 1:
        validate_context_parallel(cfg)
    if p.tp > 1:
        _validate_tensor_parallel(cfg, p.tp)
    if p.sequence_parallel and cfg.data.seq_len % (p.tp * p.cp):
        raise ConfigError(f"parallel.sequence_parallel needs data.seq_len={cfg.data.seq_len} "
                          "divisible by "
                          f"parallel.tp*cp={p.tp * p.cp}")
    if p.ep > 1:
        if m.num_experts <= 0:
            raise ConfigError(f"parallel.ep={p.ep} needs an MoE model "
                              f"(model.num_experts={m.num_experts})")
        if m.num_experts % p.ep:
            raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by "
                              f"parallel.ep={p.ep}")
    placement = [key for key in ("pp_layout", "pp_depth_stages", "pp_balance")
                 if getattr(p, key)]
    if p.pp == 1 and placement:
        raise ConfigError(f"parallel.{placement[0]}={getattr(p, placement[0])!r} places pipeline "
                          "stages, but parallel.pp=1 has one; set parallel.pp or drop it")
    if p.pp > 1:
        PipelinePlan(cfg).check(cfg)
        pipeline_microbatches(cfg)  # raises when the step's sequences cannot be split
    return dp


def _validate_tensor_parallel(cfg: TandemConfig, tp: int) -> None:
    """Every width tensor parallelism splits must divide by tp."""
    m = cfg.model
    if cfg.train.distill != "none":
        raise ConfigError(f"train.distill={cfg.train.distill!r} is not supported with "
                          f"parallel.tp={tp} yet "
                          "(the teacher reads the whole output head); use tp=1 with ep/pp/dp")
    if m.num_heads % tp:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by parallel.tp={tp}")
    if m.num_kv_heads % tp:
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} is not divisible by "
                          f"parallel.tp={tp}")
    if any(m.layer_type(i) == "linear_attention" for i in range(m.num_layers)):
        # Gated DeltaNet shards whole key-head groups (q_g, k_g and the value heads g serves)
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(m, key) % tp:
                raise ConfigError(f"model.{key}={getattr(m, key)} is not divisible by "
                                  f"parallel.tp={tp} "
                                  "(Gated DeltaNet heads are split over tp)")
    if m.num_experts > 0 and m.num_shared_experts > 0 and m.resolved_shared_expert_size % tp:
        # named as the user set it: unset, the width is moe_intermediate_size x num_shared_experts
        given = (f"model.shared_expert_intermediate_size={m.shared_expert_intermediate_size}"
                 if m.shared_expert_intermediate_size else
                 f"model.moe_intermediate_size={m.moe_intermediate_size} x "
                 f"model.num_shared_experts={m.num_shared_experts}")
        raise ConfigError(f"{given} (the shared expert's width, {m.resolved_shared_expert_size}) "
                          f"is not divisible by parallel.tp={tp}")
    if m.vocab_size % tp:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={tp} "
                          "(vocab-parallel "
                          "head)")
    if m.intermediate_size % tp or m.moe_intermediate_size % tp:
        raise ConfigError(f"model.intermediate_size={m.intermediate_size} / moe_intermediate_size="
                          f"{m.moe_intermediate_size} must be divisible by parallel.tp={tp}")
    if m.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true is not supported with parallel.tp > 1")


def context_chunk(cfg: TandemConfig) -> int:
    """Tokens per context-parallel chunk: data.seq_len over cp chunks (contiguous) or 2 x cp
    (zigzag)."""
    p = cfg.parallel
    return cfg.data.seq_len // (p.cp * (2 if p.cp_sharding == "zigzag" else 1))


def validate_context_parallel(cfg: TandemConfig) -> None:
    """parallel.cp > 1: the sequence splits into equal chunks, each a whole number of QSA blocks."""
    p, m = cfg.parallel, cfg.model
    pieces = p.cp * (2 if p.cp_sharding == "zigzag" else 1)
    if cfg.data.seq_len % pieces:
        raise ConfigError(f"parallel.cp={p.cp} with parallel.cp_sharding={p.cp_sharding} cuts "
                          "data.seq_len="
                          f"{cfg.data.seq_len} into {pieces} equal chunks; make data.seq_len a "
                          f"multiple of {pieces}")
    chunk = context_chunk(cfg)
    if m.uses_qsa and chunk % m.indexer_compress_ratio:
        raise ConfigError(f"parallel.cp={p.cp}: each context chunk of {chunk} tokens must hold "
                          "whole QSA blocks "
                          f"(model.indexer_compress_ratio={m.indexer_compress_ratio}); make "
                          "data.seq_len a multiple "
                          f"of {pieces * m.indexer_compress_ratio}")
