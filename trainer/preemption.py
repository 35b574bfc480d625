"""Checkpoint-and-requeue on Slurm's pre-timeout signal; checkpoint-and-stop on SIGTERM.

The functions, used by the training loop like this::

    install_preemption_handler()              # once, at start, from the main thread
    for step in ...:
        ...                                    # one optimizer step
        level = agree_preemption()             # every rank, every step (a collective)
        if level:
            save_checkpoint(step)              # every rank; must be complete when it returns
            if level == REQUEUE:               # SIGUSR1; STOP (SIGTERM) just ends
                requeue_current_job()          # every rank; only global rank 0 talks to Slurm
            sys.exit(0)

`install_preemption_handler(signals=(SIGUSR1, SIGTERM)) -> previous handlers`
    Clears the flag and installs a handler that only sets it (no I/O, no collectives, nothing that
    could deadlock or corrupt state when it interrupts the step). Must be called from the main
    thread. `restore_signal_handlers(previous)` puts the earlier handlers back when training ends;
    `ignore_preemption_signals()` ignores the signals from then until the process exits (what
    `tandem train` does, so that a late signal cannot fail a finished job).
`preemption_requested() -> bool`
    This process's flag: a signal arrived since installation.
`agree_preemption(group=None) -> int`
    The flag agreed over the process group: an all-reduce MAX of the local level (0 none, REQUEUE
    for SIGUSR1, STOP for SIGTERM), so if any rank was signalled, every rank returns the same level
    at the same step and they all checkpoint the same step.
    Without an initialised torch.distributed it is the local level. The tensor lives
    on the CPU for gloo and on the current accelerator (torch.accelerator) for NCCL/HCCL.
`requeue_current_job() -> bool`
    On global rank 0, when SLURM_JOB_ID is set, runs `scontrol requeue $SLURM_JOB_ID` and logs the
    outcome; returns True when the requeue was accepted. Other ranks and non-Slurm runs return
    False. The requeue makes Slurm end this allocation (SIGTERM to every process, which the handler
    turns into the flag, then SIGKILL after KillWait, or torchrun's after its --shutdown-timeout),
    so call it only after the checkpoint is complete on all ranks, and exit promptly. The job must
    be requeueable (`#SBATCH --requeue`, which the launcher sets).

How the signal arrives under `tandem launch slurm`: see slurm/train.sbatch.tmpl. In short, slurmctld
sends SIGUSR1 (`--signal=USR1@N`) to every process of the job step on every node; torchrun ignores
it (the step starts torchrun with SIGUSR1 set to SIG_IGN) and each trainer rank catches it here.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Iterable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

REQUEUE, STOP = 1, 2
"""What a signal asks for, the higher winning: SIGUSR1, Slurm's warning before the time limit
(`--signal=USR1@N`): checkpoint and requeue the job; SIGTERM (`scancel`, the scheduler preempting
the job, a time limit without the warning): checkpoint and stop. A SIGTERM requeued the job too,
so a plain `scancel` put it back in the queue, and a scheduler that requeues preempted jobs itself
was asked twice."""
_LEVELS = {signal.SIGUSR1: REQUEUE, signal.SIGTERM: STOP}

_requested = 0
_signal_name: Optional[str] = None


def _handler(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _requested, _signal_name
    level = _LEVELS.get(signum, STOP)
    if level >= _requested:
        _requested, _signal_name = level, signal.Signals(signum).name


def install_preemption_handler(signals: Iterable[signal.Signals] = PREEMPTION_SIGNALS) -> dict:
    """Route `signals` to a handler that only records that preemption was requested.

    A training run starts un-preempted, so this clears the flag, unless the signals were routed here
    already (the `tandem train` process installs the handler before it builds the run, and a signal
    that came during the build must still preempt the run). Returns the previous handlers for
    `restore_signal_handlers` (an in-process caller such as a test or notebook gets its own SIGTERM
    behaviour back when training ends)."""
    global _requested, _signal_name
    previous = {sig: signal.signal(sig, _handler) for sig in signals}
    if not all(handler is _handler for handler in previous.values()):
        _requested, _signal_name = 0, None
    return previous


def restore_signal_handlers(previous: dict) -> None:
    """Put back the handlers `install_preemption_handler` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def ignore_preemption_signals(signals: Iterable[signal.Signals] = PREEMPTION_SIGNALS) -> None:
    """Training is over: ignore `signals` until the process exits.

    A signal that arrives now has nothing left to checkpoint, and its default action would turn a
    finished (or already checkpointed and requeued) job into a failed one. A Python handler does not
    cover the whole exit: interpreter finalisation puts SIG_DFL back for every signal with a Python
    handler, but leaves SIG_IGN in place. Only for a process's own entry point (`tandem train`)."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def preemption_requested() -> bool:
    """True once one of the installed signals has reached this process."""
    return bool(_requested)


def _global_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - torch without distributed
        pass
    return int(os.environ.get("RANK", "0"))


def agree_preemption(group=None) -> int:
    """All-reduce MAX of the local level (0, REQUEUE or STOP) over `group` (default: world); every
    rank gets the same answer."""

    if not (dist.is_available() and dist.is_initialized()):
        return _requested
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend and "nccl" not in backend and "hccl" not in backend:
        device = torch.device("cpu")
    else:
        acc = torch.accelerator.current_accelerator()
        device = (
            torch.device(acc.type, torch.accelerator.current_device_index())
            if acc is not None
            else torch.device("cpu")
        )
    flag = torch.tensor([_requested], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    agreed = int(flag.item())
    if agreed and _global_rank() == 0:
        logger.warning("preemption: %s received (by this or another rank); checkpointing and %s",
                       _signal_name or "a signal",
                       "requeueing" if agreed == REQUEUE else "stopping")
    return agreed


class RequeueRefused(RuntimeError):
    """Slurm refused to requeue a preempted job, which stopped at a checkpoint: the message says
    which, and how to go on."""


def requeue_current_job() -> bool:
    """On global rank 0 of a Slurm job, `scontrol requeue $SLURM_JOB_ID`; log and return whether it
    worked."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or _global_rank() != 0:
        return False
    try:
        res = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.error("preemption: scontrol requeue %s failed: %s", job_id, exc)
        return False
    if res.returncode != 0:
        logger.error("preemption: scontrol requeue %s failed (exit %d): "
                     "%s", job_id, res.returncode, " ".join(res.stderr.split()))
        return False
    logger.warning("preemption: requeued Slurm job %s; it resumes from the checkpoint when "
                   "rescheduled", job_id)
    return True
