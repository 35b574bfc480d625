"""Faults injected into a `tandem` process from outside, for the crash-safety tests.

Put this directory on PYTHONPATH (tests/conftest.py `fault_env`) and set one of:
* TANDEM_TEST_KILL_AT_STEP=<step>[:<rank>]: SIGKILL that rank (default 0) once it has completed
  `step` optimizer steps, on the job's first attempt only (so a torchrun restart shows recovery);
* TANDEM_TEST_PAUSE_CHECKPOINT=<point>:<step>: block the save of checkpoint `step` at
  `before_shards` (the config, the trainer state and the RNG written, no shard) or `before_marker`
  (everything but the completion marker), so a test can kill -9 the process mid-save;
* TANDEM_TEST_SAMPLE_LOG=<dir>: append the training samples each rank reads for each 1-based step
  to <dir>/rank<R>.jsonl;
* TANDEM_TEST_SLOW_FIRST_ATTEMPT=<seconds>: every optimizer step takes that much longer on a Slurm
  job's first attempt (SLURM_RESTART_COUNT unset or 0), so a short time limit reaches a tiny run;
* TANDEM_TEST_LATE_RANK=<rank>:<seconds>: that rank returns from building its data (the run's last
  collective before the run directory's checks) `seconds` late, so the other ranks get that far
  ahead in starting the run unless something holds them back;
* TANDEM_TEST_PUBLISH_AT_START=<staged>:<final>: rank 1 renames the directory `staged` to `final`
  (a checkpoint being published) once it has looked up the checkpoints it reads (`tandem train`:
  the one to resume, model.init_from's and mtp.init_from's; `tandem generate`: --checkpoint's), or
  when it comes to take rank 0's answer instead, and rank 0 looks only after that, so the two
  ranks see a run directory before and after a checkpoint appears in it.
* TANDEM_TEST_BALLAST=<rank>:<MiB>: that rank holds that many MiB of written memory from start-up,
  so its peak memory stands above every other rank's.
Python imports `sitecustomize` at start-up; nothing is imported or patched without these variables.
"""

import json
import os
import signal
import sys
import time

_KILL = os.environ.get("TANDEM_TEST_KILL_AT_STEP")
_PAUSE = os.environ.get("TANDEM_TEST_PAUSE_CHECKPOINT")
_SAMPLES = os.environ.get("TANDEM_TEST_SAMPLE_LOG")
_SLOW = os.environ.get("TANDEM_TEST_SLOW_FIRST_ATTEMPT")
_LATE = os.environ.get("TANDEM_TEST_LATE_RANK")
_PUBLISH = os.environ.get("TANDEM_TEST_PUBLISH_AT_START")
_BALLAST = os.environ.get("TANDEM_TEST_BALLAST")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _kill_at_step(spec: str) -> None:
    from tandem.data_pipeline.batches import DataPosition

    at, _, who = spec.partition(":")
    advance, done = DataPosition.advance, []

    def advance_then_maybe_die(self, *args, **kwargs):
        out = advance(self, *args, **kwargs)
        done.append(1)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and len(done) == int(at) and _rank() == int(who or 0):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    DataPosition.advance = advance_then_maybe_die


def _slow_first_attempt(seconds: str) -> None:
    from tandem.data_pipeline.batches import DataPosition

    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        return
    advance = DataPosition.advance

    def advance_slowly(self, *args, **kwargs):
        time.sleep(float(seconds))
        return advance(self, *args, **kwargs)

    DataPosition.advance = advance_slowly


def _late_rank(spec: str) -> None:
    from tandem.trainer import run

    who, _, seconds = spec.partition(":")
    build_data = run._build_data

    def build_data_late(*args, **kwargs):
        out = build_data(*args, **kwargs)
        if _rank() == int(who):
            time.sleep(float(seconds))
        return out

    run._build_data = build_data_late


def _publish_at_start(spec: str) -> None:
    from tandem.trainer import generate, run

    staged, _, final = spec.partition(":")
    published = []

    def publish():
        if _rank() == 1 and not published:
            os.rename(staged, final)
            published.append(1)

    def around_a_publish(look_up):
        def looked_up(*args, **kwargs):
            if _rank() == 0:
                while not os.path.exists(final):
                    time.sleep(0.1)
            out = look_up(*args, **kwargs)
            publish()
            return out

        return looked_up

    def publish_then(agree):
        def agreed(*args, **kwargs):
            publish()  # a rank 1 that no longer looks for itself
            return agree(*args, **kwargs)

        return agreed

    run._sources = around_a_publish(run._sources)
    generate.resolve_checkpoint = around_a_publish(generate.resolve_checkpoint)
    generate.decided_on_rank0 = publish_then(generate.decided_on_rank0)


def _pause_checkpoint(spec: str) -> None:
    from tandem.trainer.checkpoint import CheckpointWriter

    point, _, at = spec.partition(":")
    # _write_shards(state, step, tmp) and _publish(tmp, step): where each takes the step
    method, step_arg = {"before_shards": ("_write_shards", 1),
                        "before_marker": ("_publish", 1)}[point]
    original = getattr(CheckpointWriter, method)

    def paused(self, *args):
        if args[step_arg] == int(at):
            print(f"checkpoint: paused at {point}", file=sys.stderr, flush=True)
            while True:
                time.sleep(1)
        return original(self, *args)

    setattr(CheckpointWriter, method, paused)


def _log_samples(where: str) -> None:
    from tandem.trainer import loop

    indices, read = loop.batch_indices, []

    def recorded_indices(*args, **kwargs):
        idx = indices(*args, **kwargs)
        read.extend(int(i) for i in idx)
        return idx

    micro_batches = loop.micro_batches

    def logged_micro_batches(run, step):
        read.clear()
        out = micro_batches(run, step)
        with open(os.path.join(where, f"rank{run.pstate.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step + 1, "samples": list(read)}) + "\n")
        return out

    loop.batch_indices, loop.micro_batches = recorded_indices, logged_micro_batches


if _KILL:
    _kill_at_step(_KILL)
if _PAUSE:
    _pause_checkpoint(_PAUSE)
if _SAMPLES:
    _log_samples(_SAMPLES)
if _SLOW:
    _slow_first_attempt(_SLOW)
if _LATE:
    _late_rank(_LATE)
if _PUBLISH:
    _publish_at_start(_PUBLISH)
if _BALLAST and _rank() == int(_BALLAST.partition(":")[0]):
    _ballast = b"\x01" * (int(_BALLAST.partition(":")[2]) << 20)  # written, so resident
