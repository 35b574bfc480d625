"""Building a training run: device, parallel state, data, model, train step, checkpoints, evaluator.

`build_run` does every check that can fail (run directory, tokenizer, checkpoint compatibility)
before the model is built, and writes the run's config.yaml only once all of them have passed, so a
failed start leaves an earlier run's files as they were. The loop (loop.py) then only steps.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, fields
from typing import Any, FrozenSet, Optional

from torch import nn

from tandem.data_pipeline.batches import DataPosition, StreamBuilds
from tandem.data_pipeline.dataset import build_datasets, follow_checkpoint_tokenizer
from tandem.data_pipeline.tokenizer import checkpoint_tokenizer
from tandem.eval.in_loop import InLoopEvaluator

from .checkpoint import (
    CheckpointWriter,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    pinned_init_from,
    read_trainer_state,
    saved_section,
)
from .checkpoint_dirs import (
    list_checkpoints,
    remove_unfinished_saves,
    settle_saves,
    settled_path,
)
from .config import TandemConfig
from .config_checks import ConfigError
from .cost import hardware_flops_per_token, teacher_head_passes, training_flops_per_token
from .files import naming, write_replacing
from .guard import BadStepGuard, rewind_headroom
from .hf.importer import check_hf_weights
from .hf.init_from import (
    adopt_checkpoint_config,
    check_reference,
    is_hf_dir,
    make_reference,
    read_reference,
    resolve_init_from,
    serving_origin,
)
from .hf.reader import stop_ids
from .materialize import adopt_mtp_init_from, build_sharded_model
from .optim import apply_settings, schedule_note, stage_note
from .parallel import ParallelState, init_parallel
from .parallel.device import (
    FINETUNE_MMAP_THRESHOLD,
    resolve_device,
    set_malloc_mmap_threshold,
)
from .parallel.layout import decided_on_rank0
from .parallel.pipeline_decode import parallel_decoding
from .recipe import to_yaml
from .step import TrainStep


@dataclass
class Run:
    """Everything one rank's training run holds."""

    cfg: TandemConfig
    config_yaml: str
    """The resolved config, as written to config.yaml and every checkpoint."""
    pstate: ParallelState
    data_position: DataPosition
    """Where the data continues (consumed samples, skipped ranges): the schedules follow it."""
    global_batch: int
    """Samples per optimizer step over every data-parallel replica."""
    train_ds: Any
    valid_ds: Any
    tokenizer: Any
    step: TrainStep
    checkpoints: CheckpointWriter
    guard: BadStepGuard
    evaluator: Optional[Any]
    """The in-loop speculative-decoding evaluator (None without MTP or with eval.interval=0)."""
    start_step: int = 0
    flops_per_token: float = 0.0
    """Model FLOPs per token (3x the forward): the numerator of `mfu`."""
    hardware_flops_per_token: float = 0.0
    """FLOPs the step executes per token (recomputation too): the numerator of `hfu`."""
    peak_flops: float = 0.0
    """One device's peak FLOP/s (logging.peak_tflops or the device's table; 0: unknown)."""

    @property
    def model(self) -> nn.Module:
        return self.step.model

    @property
    def optimizer(self):
        return self.step.optimizer

    @property
    def device(self):
        return self.pstate.device

    def save(self, step: int, wait: bool = False) -> None:
        """Checkpoint `step` (in the background with checkpoint.async_save unless `wait`)."""
        self.checkpoints.save(step, self.model, self.optimizer, self.config_yaml,
                              {**self.data_position.state(), **self.guard.state()})
        if wait:
            self.checkpoints.finish()

    def restore_latest(self) -> Optional[dict]:
        """Finish a save in flight, then load the newest complete checkpoint into the model and the
        optimizer: its trainer state, or None when there is none."""
        self.checkpoints.finish()  # a save still in flight is the newest good state
        found = latest_checkpoint(self.cfg.run.dir, report=False)
        return None if found is None else self.load(found[1])

    def load(self, step_dir: str) -> dict:
        """The checkpoint at `step_dir` into the model and the optimizer, whose settings stay the
        run's config (optim.apply_settings); its trainer state."""
        state = load_checkpoint(step_dir, self.model, self.optimizer)
        apply_settings(self.optimizer, self.cfg.train)
        return state


def prepare_run_dir(run_dir: str) -> None:
    """Fail early (before any expensive work) if the run directory cannot be written."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        # a name no other rank takes: pids repeat across the nodes of a containerised job
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=run_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(
            f"config key 'run.dir'={run_dir!r} is not writable: {exc.strerror or exc}"
        ) from None


_HELD_RUN_DIRS: dict = {}
"""run.dir (real path) -> the open lock file this process holds for the rest of its life."""


def lock_run_dir(run_dir: str) -> None:
    """Take `run_dir/.tandem.lock` for this process (the launch's rank 0), or refuse a run.dir that
    another running process trains in: two runs in one directory replaced each other's metrics
    and config.yaml. The lock goes with the process (an ended or killed job frees it); a file
    system without flock (some Lustre mounts) runs unlocked."""
    key = os.path.realpath(run_dir)
    if key in _HELD_RUN_DIRS:
        return
    f = open(os.path.join(run_dir, ".tandem.lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"config key 'run.dir'={run_dir!r} is in use by a running run "
                          f"({holder}): wait for it to end or choose another run.dir") from None
    except OSError:
        pass  # no flock on this file system
    with naming(f.name):
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
    _HELD_RUN_DIRS[key] = f


def release_run_dir(run_dir: str) -> None:
    """Give up this process's lock on `run_dir` (the run ended), if it holds it."""
    f = _HELD_RUN_DIRS.pop(os.path.realpath(run_dir), None)
    if f is not None:
        f.close()


def past_max_steps(found, max_steps: int) -> Optional[str]:
    """Why a resume from the checkpoint `found` ((step, path) or None) would train nothing and
    rewrite config.yaml: its step is past train.max_steps (None when it is not)."""
    if found is None or found[0] <= max_steps:
        return None
    return (f"config key 'train.max_steps'={max_steps} is below the step of the checkpoint to "
            f"resume, {found[1]}")


def earlier_run_files(run_dir: str) -> list:
    """What an earlier run left in `run_dir` without a complete checkpoint: its config.yaml,
    metrics and incomplete checkpoints (relative paths; empty when there are none)."""
    files = [name for name in ("config.yaml", "metrics.jsonl")
             if os.path.exists(os.path.join(run_dir, name))]
    return files + [f"{os.path.relpath(path, run_dir)} (incomplete)"
                    for path in list_checkpoints(run_dir)[1]]


def _refuse_an_earlier_run(run_dir: str) -> None:
    """A fresh run would replace an earlier run's config.yaml and metrics and write checkpoints
    beside ones it did not write (which a later resume would then mix up): one line, before
    anything is changed. An earlier run is any of them, whether or not it saved a complete
    checkpoint."""
    complete = list_checkpoints(run_dir)[0]
    if complete:
        held = f"newest checkpoint {os.path.basename(complete[-1][1])}"
        how = "pass --resume to continue it"
    else:
        files = earlier_run_files(run_dir)
        if not files:
            return
        held = f"{', '.join(files)}; no complete checkpoint"
        how = "pass --resume to start it again from step 0"
    raise ConfigError(f"config key 'run.dir'={run_dir!r} holds an earlier run ({held}); {how} or "
                      "choose another run.dir")


def write_config(run_dir: str, config_yaml: str) -> None:
    # synced before the rename: a power loss left a torn config.yaml
    write_replacing(os.path.join(run_dir, "config.yaml"), lambda f: f.write(config_yaml))


def build_model(cfg: TandemConfig, pstate: ParallelState) -> nn.Module:
    """This rank's part of the model: built on the meta device, parallelized, then only its shards
    materialised, seeded so every layout starts from identical weights, or read from
    `model.init_from` (trainer/materialize.py)."""
    return build_sharded_model(cfg, pstate)


def check_frozen_reference(step_dir: str, reference: Optional[dict]) -> None:
    """A frozen-trunk checkpoint resumes only on the very trunk it was trained on, and a checkpoint
    that holds its trunk only unfrozen."""
    saved = read_reference(step_dir)
    if saved is None:
        if reference is not None:
            # the checkpoint's trained trunk would load, and every later checkpoint would record
            # only the MTP module on model.init_from's trunk, which is not the one it trained on
            raise ConfigError(f"checkpoint {step_dir} holds its own trained trunk, so it resumes "
                              "only with train.freeze_trunk=false; to fine-tune the MTP module "
                              f"on that trunk, start a new run with model.init_from={step_dir}")
        return
    check_reference(saved, step_dir)
    if reference is None or reference["path"] != saved["path"]:
        mine = reference["path"] if reference else "unset (or train.freeze_trunk=false)"
        raise ConfigError(f"checkpoint {step_dir} was trained on the frozen trunk {saved['path']}, "
                          f"but this run's model.init_from is {mine}")


def adopt_init_from(cfg: TandemConfig, explicit: FrozenSet[str]) -> None:
    """What a fine-tuning run takes from the checkpoints it starts from, before anything is built:
    model.init_from's concrete step, tokenizer and shape, and the MTP wiring of mtp.init_from
    (`explicit`: adopt_checkpoint_config's). `tandem launch slurm` takes the same to check the
    job's layout."""
    if cfg.model.init_from:
        # the concrete step (a run directory's newest checkpoint moves on): config.yaml records it,
        # and a resume reads it again (checkpoint.pinned_init_from)
        source = cfg.model.init_from = resolve_init_from(cfg.model.init_from)
        adopted = follow_checkpoint_tokenizer(cfg.data, source, checkpoint_tokenizer(source))
        if adopted and int(os.environ.get("RANK", "0")) == 0:
            print(f"init_from: data.tokenizer={adopted} (the checkpoint's tokenizer)",
                  file=sys.stderr)
        adopt_checkpoint_config(cfg, explicit)
        if is_hf_dir(source):  # each tensor's name and shape, before the data and the model
            check_hf_weights(source, cfg.model, cfg.mtp)
    adopt_mtp_init_from(cfg)  # after the trunk's: the MTP module's wiring is mtp.init_from's


def _adopt_init_from(cfg: TandemConfig, explicit: FrozenSet[str]) -> Optional[dict]:
    """Fine-tuning (`adopt_init_from`), and the host-memory setting it runs with. Returns the frozen
    trunk's reference (checkpoints point at it), or None."""
    # Host memory of fine-tuning: a fixed mmap threshold hands freed read / all-gather buffers back.
    threshold = cfg.train.malloc_mmap_threshold
    if threshold < 0:
        threshold = FINETUNE_MMAP_THRESHOLD if cfg.model.init_from else 0
    if threshold > 0:
        set_malloc_mmap_threshold(threshold)
    adopt_init_from(cfg, explicit)
    if cfg.model.init_from and cfg.train.freeze_trunk:
        return make_reference(cfg.model.init_from)
    return None


def _build_data(cfg: TandemConfig, pstate: ParallelState, saved: dict):
    """(data position, global batch, train, valid, tokenizer), the position at the checkpoint's
    consumed samples whatever global batch it ran with.

    The training dataset is built with the samples the run needs (`_samples_needed`) and keeps that
    number across resumes (`DataPosition.stream_builds`): megatron-core orders the samples by the
    number asked for, so another number would be another order, and the samples after the
    checkpoint would not be the ones the run had yet to read. A resume that needs more samples than
    the builds hold (a larger `train.max_steps` or global batch) appends a build for the rest,
    seeded `train.seed` + its index: the samples of the builds before keep their order (asking the
    first build for more re-shuffled every epoch, those already read among them)."""
    t = cfg.train
    global_batch = t.micro_batch_size * t.grad_accum_steps * pstate.dp_size
    position = DataPosition(global_batch, cfg.data.seq_len)
    if saved:
        position.load_state(saved)
    needed = _samples_needed(position, max(t.max_steps - int(saved.get("step", 0)), 1), t,
                             int(saved.get("bad_steps_total", 0)))

    def build(samples: int, index: int):
        return build_datasets(
            cfg.data, cfg.data.seq_len, t.seed + index, num_train_samples=samples,
            num_valid_samples=max(cfg.eval.loss_batches * t.micro_batch_size,
                                  cfg.eval.num_prompts, 1),
            model_vocab_size=cfg.model.vocab_size)

    builds = list(position.stream_builds) or [needed]
    parts = [build(n, i)[0] for i, n in enumerate(builds[1:], 1)]
    train_ds, valid_ds, tokenizer = build(builds[0], 0)  # the first build's validation split
    held = len(train_ds) + sum(len(part) for part in parts)
    if cfg.data.source == "jsonl":
        builds = []  # chat windows: a fixed set that later steps read again (get_batch wraps)
    elif held < needed:
        if pstate.is_main:
            print(f"data: the rest of the run reads up to sample {needed}, its dataset holds "
                  f"{held} (train.max_steps or the global batch grew); samples {held} on come "
                  f"from a build of {needed - held} more, seeded train.seed + {len(builds)}",
                  file=sys.stderr)
        parts.append(build(needed - held, len(builds))[0])
        builds.append(needed - held)
    position.stream_builds = builds
    if parts:
        train_ds = StreamBuilds([train_ds, *parts])
    check_ple_end_of_document(cfg, tokenizer)
    return position, global_batch, train_ds, valid_ds, tokenizer


DATA_ORDER_KEYS = (("train", "seed"), ("data", "source"), ("data", "paths"), ("data", "split"),
                   ("data", "valid_paths"))
"""The keys the order of the training samples follows (megatron-core shuffles data.split's share of
data.paths with train.seed; chat records are split and shuffled with it too)."""


def data_order_note(step_dir: str, cfg: TandemConfig, next_sample: int) -> str:
    """What a resume from `step_dir` changes about the order of the samples, for its start-up line
    (empty: nothing). The data position counts samples, so under other DATA_ORDER_KEYS the run goes
    on at the same count of another order: samples it read may come again, others not at all (a
    change of blend between stages is often meant: said, not refused)."""
    changed = []
    for section, key in DATA_ORDER_KEYS:
        saved, now = saved_section(step_dir, section), getattr(getattr(cfg, section), key)
        now = list(now) if isinstance(now, (list, tuple)) else now
        if key in saved and saved[key] != now:
            changed.append(f"{section}.{key} {saved[key]!r} -> {now!r}")
    if not changed:
        return ""
    split = any(c.startswith(("data.split", "data.valid_paths")) for c in changed)
    return (f"; the data order changed ({', '.join(changed)}): the run goes on at sample "
            f"{next_sample} of another order, so samples it read may come again and others not at "
            "all" + ("; documents move between training and validation" if split else ""))


def check_ple_end_of_document(cfg: TandemConfig, tokenizer) -> None:
    """ConfigError when the model has PLE layers and model.eos_token_id is not `tokenizer`'s
    end-of-document id: PLE's n-grams stop at it, and a wrong one silently mixes documents."""
    eod = getattr(tokenizer, "eod_id", None)
    if cfg.model.ple_layers and eod is not None and cfg.model.eos_token_id != eod:
        raise ConfigError(f"config key 'model.eos_token_id'={cfg.model.eos_token_id} is not the "
                          f"end-of-document token of {tokenizer.path} (id {eod}); PLE's n-grams "
                          "must stop at it")


def _hardware_flops(cfg: TandemConfig) -> float:
    """HFU's FLOPs per token for this run's objective (cost.hardware_flops_per_token)."""
    t = cfg.train
    teacher = teacher_head_passes(t.distill, cfg.mtp.loss.objective, cfg.mtp)
    return hardware_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len,
                                    t.activation_checkpointing, t.freeze_trunk, teacher)


def _samples_needed(position: DataPosition, steps_left: int, t, bad_steps: int) -> int:
    """One past the last sample the rest of the run can read: its remaining steps, and as many
    global batches as the rewinds still allowed after `bad_steps` can pass over."""
    rewinds_left = max(rewind_headroom(t, t.max_steps) - bad_steps, 0)
    return position.end_sample(steps_left) + rewinds_left * position.global_batch


def build_evaluator(cfg: TandemConfig, model: nn.Module, valid_ds, tokenizer,
                    pstate: ParallelState):
    """The in-loop evaluator, or None when the run has no MTP module or eval.interval=0."""
    if cfg.eval.interval <= 0:
        return None
    if cfg.mtp.num_steps <= 0:
        if pstate.is_main:  # the evaluator measures drafting: without a drafter it has nothing
            print(f"eval.interval={cfg.eval.interval} with mtp.num_steps=0: no MTP module to "
                  "evaluate, so no eval/* records", file=sys.stderr)
        return None

    decoding = parallel_decoding(cfg, model, pstate)  # how the evaluator decodes on this layout
    stops = stop_ids(getattr(tokenizer, "eod_id", None), [serving_origin(cfg.model.init_from)])
    return InLoopEvaluator(cfg, model, valid_ds, tokenizer, pstate, decoding, stops)


def _sources(cfg: TandemConfig, resume: bool, explicit: FrozenSet[str]):
    """(the checkpoint to resume or None, the frozen trunk's reference or None), with
    model.init_from and mtp.init_from set to the step directories they read (a run directory's
    newest checkpoint moves on while that run trains)."""
    # a save a crash left whole but uncommitted counts: committed once the checks pass
    found = latest_checkpoint(cfg.run.dir, whole_saves=True) if resume else None
    if found is not None:
        pin_init_from(cfg, found[1])
    return found, _adopt_init_from(cfg, explicit)


def pin_init_from(cfg: TandemConfig, resumed: str) -> None:
    """model.init_from and mtp.init_from set to the step directories the run being resumed from
    the checkpoint at `resumed` started from (checkpoint.pinned_init_from), as a resume reads them;
    `tandem launch slurm`, whose job resumes, pins them the same way to check that job."""
    for section, key in ((cfg.model, "model.init_from"), (cfg.mtp, "mtp.init_from")):
        given = section.init_from
        if not given:
            continue
        section.init_from = pinned_init_from(resumed, given, key)
        if given != section.init_from and int(os.environ.get("RANK", "0")) == 0:
            print(f"resume: {key}={given} is read at {section.init_from}, the checkpoint this run "
                  "started from", file=sys.stderr)


def _checked_resume(cfg: TandemConfig, resume: bool, found, reference, config_yaml: str):
    """Every check on the checkpoint to resume, before the data and the model; then (a refused
    resume leaves run.dir as it was) the saves a crash interrupted settled and the unfinished ones
    removed. `found` as it is named once settled."""
    if found is not None:
        past = past_max_steps(found, cfg.train.max_steps)
        if past:
            raise ConfigError(f"{past}: raise it, or choose another run.dir")
        check_compatible(found[1], config_yaml)
        check_frozen_reference(found[1], reference)
    if resume:
        decided_on_rank0(lambda: (settle_saves(cfg.run.dir), remove_unfinished_saves(cfg.run.dir)))
    return None if found is None else (found[0], settled_path(found[1]))


def build_run(cfg: TandemConfig, resume: bool = False,
              explicit: FrozenSet[str] = frozenset()) -> Run:
    """Make this rank's run. A torchrun restart (--max-restarts) of a failed job resumes from the
    last checkpoint, as `resume` and train.resume do. `explicit`: the keys the recipe and the
    overrides set (recipe.explicit_keys), which model.init_from leaves as set where a later stage
    may change them."""
    resume = resume or cfg.train.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                              "0")) > 0
    prepare_run_dir(cfg.run.dir)
    cfg.eval.check_decoding_fits(cfg)
    found, reference = _sources(cfg, resume, explicit)
    pstate = init_parallel(cfg, resolve_device(cfg.device, dtype=cfg.train.dtype))
    decided_on_rank0(lambda: lock_run_dir(cfg.run.dir))
    # Every rank runs with what rank 0 found: a checkpoint published between rank 0's look and
    # another rank's made the ranks resume or start from different steps.
    found, reference, agreed = decided_on_rank0(lambda: (found, reference, cfg))
    for section in fields(cfg):
        setattr(cfg, section.name, getattr(agreed, section.name))
    config_yaml = to_yaml(cfg)
    found = _checked_resume(cfg, resume, found, reference, config_yaml)
    saved = read_trainer_state(found[1]) if found is not None else {}
    position, global_batch, train_ds, valid_ds, tokenizer = _build_data(cfg, pstate, saved)
    if not resume:  # the last check before the model is built
        decided_on_rank0(lambda: _refuse_an_earlier_run(cfg.run.dir))
    step = TrainStep(cfg, build_model(cfg, pstate), pstate)
    if cfg.train.dtype == "auto" and pstate.is_main:  # config.yaml keeps `auto`: say what it chose
        print(f"train.dtype=auto: {'bf16' if step.autocast_dtype else 'fp32'} on "
              f"{pstate.device.device.type}", file=sys.stderr)
    checkpoints = CheckpointWriter(cfg.run.dir, cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
                                   reference, tokenizer=tokenizer)
    run = Run(cfg, config_yaml, pstate, position, global_batch, train_ds, valid_ds, tokenizer, step,
              checkpoints, guard=None, evaluator=None,
              flops_per_token=training_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len,
                                                       cfg.train.freeze_trunk),
              hardware_flops_per_token=_hardware_flops(cfg),
              peak_flops=(cfg.logging.peak_tflops or pstate.device.peak_tflops()) * 1e12)
    run.guard = BadStepGuard(cfg.train, pstate.is_main, position,
                             save=lambda s: run.save(s, wait=True), restore=run.restore_latest)
    if found is not None:
        state = run.load(found[1])
        run.start_step = int(state["step"])
        run.guard.load_state(state)
        if pstate.is_main:
            last = (position.consumed_samples + (cfg.train.max_steps - run.start_step - 1)
                    * global_batch) / position.schedule_batch
            at, saved = position.schedule_step(), lambda part: saved_section(found[1], part)
            schedule = (schedule_note(saved("train"), cfg.train, at, last)
                        + stage_note(saved("model"), saved("mtp"), cfg.model, cfg.mtp, at))
            order = data_order_note(found[1], cfg, position.next_sample())
            print(f"resumed from {found[1]} at step {run.start_step}{position.resume_note(state)}"
                  f"{order}{schedule if run.start_step < cfg.train.max_steps else ''}",
                  file=sys.stderr)
    done = found is not None and found[0] == cfg.train.max_steps
    if pstate.is_main and done:
        print(f"resume: {found[1]} is at train.max_steps={cfg.train.max_steps}: nothing to train",
              file=sys.stderr)
    elif pstate.is_main:  # only once every check above has passed, and when a step will run
        write_config(cfg.run.dir, config_yaml)
    run.evaluator = build_evaluator(cfg, run.model, valid_ds, tokenizer, pstate)
    return run
