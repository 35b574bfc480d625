"""The training loop.

One optimizer step (step.py's TrainStep) per iteration, then the bad-step guard's decision, the
step's record, evaluation, checkpointing and preemption. Data order, the learning rate and the MTP
loss schedule are pure functions of the consumed-sample count (DataPosition: the schedules read it
in steps of the run's first global batch), so a resume needs only it, the weights, the optimizer
and the RNG states, and continues at the next unconsumed sample under any global batch.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, FrozenSet, List, Optional, Tuple

import torch

from tandem.data_pipeline.batches import batch_indices, get_batch

from . import preemption
from .checkpoint import latest_checkpoint
from .config import TandemConfig
from .loss import depth_coefficients, lambda_at
from .metrics import MetricsLogger
from .optim import lr_at, set_lr
from .run import Run, build_run, release_run_dir


def train(cfg: TandemConfig, resume: bool = False,
          explicit: FrozenSet[str] = frozenset()) -> Optional[dict]:
    """Build the run and train it to train.max_steps: the last step's record (`explicit`:
    build_run's)."""
    try:
        return run_training(build_run(cfg, resume=resume, explicit=explicit))
    finally:
        release_run_dir(cfg.run.dir)


def micro_batches(run: Run, step: int) -> List[Dict[str, torch.Tensor]]:
    """This rank's micro-batches of the global batch at the data position (`step`: 0-based)."""
    t = run.cfg.train
    samples = run.data_position.step_samples()
    if run.data_position.stream_builds and samples[-1] >= len(run.train_ds):
        # past the samples the dataset was built with, get_batch would start its order again
        raise RuntimeError(f"the training data ends at sample {len(run.train_ds)}; step {step + 1} "
                           f"reads up to sample {samples[-1]} (rewinds passed over more batches "
                           "than the dataset was sized for)")
    out = []
    for micro in range(t.grad_accum_steps):
        idx = batch_indices(samples, micro, t.grad_accum_steps, run.pstate.dp_rank,
                            run.pstate.dp_size, t.micro_batch_size)
        batch = get_batch(run.train_ds, idx)
        _check_token_ids(run, batch["tokens"], idx)
        out.append({k: v.to(run.device.device) for k, v in batch.items()})
    return out


def _check_token_ids(run: Run, tokens: torch.Tensor, idx) -> None:
    """One line naming the data and the sample instead of an index error inside the embedding (a
    device-side assert on a GPU): data made without Tandem's meta.json (Megatron-LM's own
    preprocessing) is not checked against the tokenizer at start-up. On the host, before the
    copy."""
    if not tokens.numel():
        return
    low, top = (int(x) for x in torch.aminmax(tokens))  # one pass over the micro-batch
    vocab = run.cfg.model.vocab_size
    if top >= vocab or low < 0:
        bad = top if top >= vocab else low
        raise ValueError(f"data.paths={list(run.cfg.data.paths)}: sample {int(idx[0])}.. holds "
                         f"token id {bad}, outside model.vocab_size={vocab} (was the data "
                         "tokenized with another tokenizer?)")


def optimizer_step(run: Run, step: int) -> Tuple[int, Optional[dict]]:
    """Step `step` (0-based) as the guard allows it: (the next step, its record), or (the step to
    resume at, None) after a rewind."""
    cfg, t = run.cfg, run.cfg.train
    run.device.reset_peak_memory()
    # the LR and the MTP weight follow the samples seen (in steps of the run's first global batch),
    # so a resume under another global batch keeps them in step with the data
    schedule_step = run.data_position.schedule_step()
    lr = lr_at(t, schedule_step)
    set_lr(run.optimizer, lr)
    coefs = depth_coefficients(cfg.mtp, schedule_step)
    sums, counts, grad_norm = run.step(micro_batches(run, step), coefs, schedule_step)
    per_depth = (sums / counts.clamp(min=1)).tolist()
    record = {"step": step + 1, "loss": float(sum(c * v for c, v in zip(coefs, per_depth))),
              "loss/main": per_depth[0]}
    record.update({f"loss/mtp_{k}": per_depth[k] for k in range(1, cfg.mtp.num_steps + 1)})
    # The bad-step guard decides before the update touches weights or router biases.
    action = run.guard.inspect(step + 1, record, grad_norm)
    moe_metrics = (
        run.step.apply(schedule_step) if action == "ok" else run.step.discard_router_loads()
    )
    run.optimizer.zero_grad(set_to_none=True)
    if action == "halt":
        run.guard.halt(step, record)  # checkpoints the last good state, raises
    if action == "rewind":
        return run.guard.rewind(step), None  # reloads the last checkpoint, marks the batch skipped
    if action != "ok":
        record["skipped"] = 1.0
    run.device.synchronize()
    run.data_position.advance()
    expert_path = {"moe/expert_path": run.step.expert_path} if run.step.expert_path else {}
    record.update({"lr": lr, "grad_norm": grad_norm,
                   "mtp/lambda": lambda_at(cfg.mtp, schedule_step),
                   **moe_metrics, **run.step.indexers.metrics(), **expert_path,
                   **run.guard.metrics()})
    return step + 1, record


def throughput(run: Run, seconds: float, logged: bool) -> dict:
    """The step's speed, utilisation and data position figures, and on a step that is `logged`
    (the same on every rank) the peak memory of the rank that used most (pipeline stages and expert
    shards differ): a collective, which the other steps skip."""
    tokens_per_s = run.global_batch * run.cfg.data.seq_len / seconds
    out = {"tokens_per_s": tokens_per_s, "consumed_samples": run.data_position.consumed_samples,
           "consumed_tokens": run.data_position.consumed_tokens}
    if logged:
        out["mem/peak_gb"] = run.pstate.max_over_ranks(run.device.peak_memory_gb())
    if run.peak_flops:
        per_flop = tokens_per_s / (run.pstate.world_size * run.peak_flops)
        out.update({"mfu": run.flops_per_token * per_flop,
                    "hfu": run.hardware_flops_per_token * per_flop})
    return out


def run_training(run: Run) -> Optional[dict]:
    """Train from run.start_step to train.max_steps: the last step's record."""
    cfg, t = run.cfg, run.cfg.train
    logger = MetricsLogger(cfg, run.pstate.is_main, run.start_step, t.max_steps)
    previous_handlers = preemption.install_preemption_handler()
    run.model.train()
    last_record, step = None, run.start_step
    try:
        while step < t.max_steps:
            started = time.perf_counter()
            step, record = optimizer_step(run, step)
            if record is None:  # rewound to the checkpoint of `step`
                logger.rewind(step)
                continue
            evaluates = run.evaluator is not None and (step % cfg.eval.interval == 0
                                                       or step == t.max_steps)
            # a step the guard dropped is always logged: its record is where it is found
            logged = step % t.log_interval == 0 or step == t.max_steps or "skipped" in record
            seconds = time.perf_counter() - started
            if evaluates:
                # the precision it trains in (FSDP may hold bf16 parameters)
                with run.step.autocast():
                    record.update(run.evaluator.run(step))
                logger.log_samples(step, run.evaluator.last_samples)
            # after the evaluation: an evaluation step's memory peak holds its decoding caches
            record.update(throughput(run, seconds, logged or evaluates))
            if logged or any(k.startswith("eval/") for k in record):
                logger.log(record)
            logger.progress(step, record)
            last_record = record
            if (
                cfg.checkpoint.interval
                and step % cfg.checkpoint.interval == 0
                and step < t.max_steps
            ):
                run.save(step)
            run.checkpoints.publish_written()
            level = preemption.agree_preemption() if step < t.max_steps else 0  # finished: ends
            if level:
                _preempt(run, step, requeue=level == preemption.REQUEUE)
                return last_record
        _save_final(run, step)
    finally:
        preemption.restore_signal_handlers(previous_handlers)
        logger.close()
    return last_record


def _saved_step(run: Run) -> int:
    """The step of the newest checkpoint, saved or being saved (0: none)."""
    pending = run.checkpoints.pending
    if pending:
        return pending[1]
    return (latest_checkpoint(run.cfg.run.dir, report=False) or (0, ""))[0]


def _preempt(run: Run, step: int, requeue: bool) -> None:
    """Checkpoint `step`, then ask Slurm to requeue the job (SIGUSR1, its time-limit warning) or
    stop (SIGTERM: scancel, the scheduler's preemption; preemption.REQUEUE / STOP)."""
    if _saved_step(run) < step:  # not when the interval has just saved it
        run.save(step, wait=True)
    run.checkpoints.finish()
    requeued = requeue and preemption.requeue_current_job()
    job = os.environ.get("SLURM_JOB_ID")
    if not run.pstate.is_main:
        return
    if not requeue:
        print(f"stopped by SIGTERM: checkpointed step {step}; `tandem train ... --resume` with "
              f"run.dir={run.cfg.run.dir} continues from it (a scheduler that requeues the jobs it "
              "preempts runs this one again, and it resumes there)", file=sys.stderr)
    elif requeued:
        print(f"preempted: checkpointed step {step}; Slurm requeued job {job}, which resumes from "
              "it", file=sys.stderr)
    elif job:  # the job would end COMPLETED with its training unfinished
        raise preemption.RequeueRefused(
            f"preempted: checkpointed step {step}, but the requeue of Slurm job {job} failed (the "
            f"log says why): submit it again with run.dir={run.cfg.run.dir} (the job resumes from "
            "that checkpoint)")
    else:
        print(f"preempted: checkpointed step {step}; `tandem train ... --resume` with "
              f"run.dir={run.cfg.run.dir} continues from it", file=sys.stderr)


def _save_final(run: Run, step: int) -> None:
    """The last step's checkpoint (checkpoint.save_final), unless it is saved already."""
    if run.cfg.checkpoint.save_final and run.cfg.train.max_steps > 0 and _saved_step(run) < step:
        run.save(step)
    run.checkpoints.finish()
