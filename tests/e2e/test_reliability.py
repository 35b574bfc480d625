"""Crash safety: kill -9 mid-checkpoint, bad-step policies under NaN injection, torchrun
restarts."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tandem.trainer import loop
from tandem.trainer.checkpoint import list_checkpoints
from tandem.trainer.guard import BadStepHalt
from tandem.trainer.loop import train
from tandem.trainer.recipe import load_config
from tandem.trainer.step import TrainStep
from tests.conftest import fault_env

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")


def _refuse(constant):
    raise ValueError(f"metrics.jsonl holds {constant}, which is not JSON")


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=_refuse) for line in f]


def losses(run_dir):
    return [(r["step"], r["loss/main"], r["loss/mtp_1"], r["loss/mtp_2"]) for r in records(run_dir)]


def cli(args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "tandem.trainer.cli", *args],
                            env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def uninterrupted_losses(tiny_overrides, run_dir, accum: int = 1):
    """Losses of an uninterrupted 6-step single-process run (`accum` micro-batches per step)."""
    cfg = load_config(RECIPE,
                      tiny_overrides + ["train.max_steps=6", f"train.grad_accum_steps={accum}",
                                                f"run.dir={run_dir}"])
    train(cfg)
    return losses(cfg.run.dir)


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory):
    """An uninterrupted 6-step run to compare recoveries against (one for every kill point)."""
    return uninterrupted_losses(tiny_base, tmp_path_factory.mktemp("reference") / "run")


@pytest.mark.slow
@pytest.mark.parametrize("point, resumed_at", [("before_shards", 2), ("before_marker", 4)])
def test_kill_9_mid_checkpoint_resumes_from_the_newest_whole_save(point, resumed_at,
                                                                   tiny_overrides, tmp_path,
                                                                   reference):
    """A kill before the shards are written leaves a save a resume deletes, and it goes back to
    step 2; a kill once they are (DCP's index after every rank's shards, the trainer state before
    them) leaves a whole save without its marker, which the resume commits and starts from (an
    async save waits for the next save to be committed: a crash in between threw it away)."""
    run = str(tmp_path / "killed")
    args = ["train", RECIPE, *tiny_overrides, "train.max_steps=6", "checkpoint.interval=2",
            f"run.dir={run}"]
    proc = cli(args, env=fault_env(os.environ, TANDEM_TEST_PAUSE_CHECKPOINT=f"{point}:4"))
    deadline = time.time() + 120
    for line in proc.stderr:
        if "checkpoint: paused at" in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    complete, incomplete = list_checkpoints(run)
    assert [s for s, _ in complete] == [2]
    assert any(p.endswith(".tmp_step_4") for p in incomplete)
    resumed = cli(args + ["--resume"])
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"at step {resumed_at}" in err, err
    settled = "committed the whole save(s) a crash left uncommitted"
    assert (settled in err) == (resumed_at == 4) and ("removed the unfinished save" in err) == (
        resumed_at == 2), err
    # nothing lost but the steps after the resumed one, replayed exactly
    assert losses(run) == reference
    assert [s for s, _ in list_checkpoints(run)[0]] == [2, 4, 6]


def test_a_crash_after_an_async_save_was_written_resumes_from_it(tiny_overrides, tmp_path,
                                                                   reference, monkeypatch, capsys):
    """checkpoint.async_save commits a save at the next one: a crash in between (here at step 5,
    once step 4's background write has finished) left .tmp_step_4 whole but unmarked, and the
    resume deleted it and went back to step 2. It now commits it and resumes at step 4."""
    from tandem.data_pipeline.batches import DataPosition
    from tandem.trainer.checkpoint import CheckpointWriter

    writers, advance, steps = [], DataPosition.advance, []
    save = CheckpointWriter.save

    def recorded_save(writer, *args, **kwargs):
        writers.append(writer)
        return save(writer, *args, **kwargs)

    def advance_then_crash(position, *args, **kwargs):
        steps.append(1)
        if len(steps) == 5:
            writers[-1].pending[0].result()  # step 4's shards on disk, its commit still pending
            raise RuntimeError("crash at step 5")
        return advance(position, *args, **kwargs)

    args = tiny_overrides + ["train.max_steps=6", "checkpoint.interval=2",
                             "checkpoint.async_save=true", f"run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(CheckpointWriter, "save", recorded_save)
    monkeypatch.setattr(DataPosition, "advance", advance_then_crash)
    with pytest.raises(RuntimeError, match="crash at step 5"):
        train(load_config(RECIPE, args))
    run = str(tmp_path / "run")
    assert [s for s, _ in list_checkpoints(run)[0]] == [2]
    monkeypatch.setattr(DataPosition, "advance", advance)
    capsys.readouterr()
    train(load_config(RECIPE, args), resume=True)
    err = capsys.readouterr().err
    assert "committed the whole save(s) a crash left uncommitted" in err and "at step 4" in err, err
    assert [s for s, _ in list_checkpoints(run)[0]] == [2, 4, 6]
    assert losses(run) == reference
    assert [r["step"] for r in records(run) if "loss/main" in r] == [1, 2, 3, 4, 5, 6]


class NaNAtBatch:
    """Makes the loss and gradients of one data batch non-finite (the first time it is used)."""

    def __init__(self, monkeypatch, batches):
        self.batches, self.hit, self.current = set(batches), [], None
        read, step = loop.micro_batches, TrainStep.forward_backward
        injector = self

        # the data batch this step reads (the position is not yet advanced)
        def micro_batches(run, i):
            injector.current = run.data_position.next_sample() // run.global_batch
            return read(run, i)

        def forward_backward(train_step, batches_, counts, coefs, qsa_dense=False):
            sums = step(train_step, batches_, counts, coefs, qsa_dense)
            if injector.current in injector.batches:
                injector.batches.discard(injector.current)
                injector.hit.append(injector.current)
                for p in train_step.model.parameters():
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
                return sums * float("nan")
            return sums

        monkeypatch.setattr(loop, "micro_batches", micro_batches)
        monkeypatch.setattr(TrainStep, "forward_backward", forward_backward)


def params(run_dir, step):
    from tandem.trainer.checkpoint import load_model_from_checkpoint

    model, _ = load_model_from_checkpoint(os.path.join(run_dir, "checkpoints", f"step_{step}"))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_skip_policy_drops_the_update(monkeypatch, tiny_overrides):
    NaNAtBatch(monkeypatch, {2})
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=4", "checkpoint.interval=1",
                                                "train.bad_step_policy=skip"])
    train(cfg)
    recs = records(cfg.run.dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[2].get("skipped") == 1.0 and recs[2]["bad_steps/total"] == 1.0
    assert recs[2]["grad_norm"] is None and recs[2]["loss/main"] is None  # NaN is not JSON
    assert all("skipped" not in r for r in recs[:2] + recs[3:])
    before, after = params(cfg.run.dir, 2), params(cfg.run.dir, 3)
    # weights and router biases untouched
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_dropped_step_is_logged_and_a_rewind_with_no_checkpoint_says_so(monkeypatch,
                                                                          tiny_overrides, capsys):
    """With train.log_interval=2 a skipped step off the interval left no record (the one place it is
    documented to be found); a rewind with no checkpoint to reload dropped the update and skipped
    the batch without a word."""
    NaNAtBatch(monkeypatch, {2})
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=4", "train.log_interval=2",
                                                "train.bad_step_policy=skip"])
    train(cfg)
    recs = records(cfg.run.dir)
    assert [(r["step"], r.get("skipped")) for r in recs] == [(2, None), (3, 1.0), (4, None)]
    NaNAtBatch(monkeypatch, {2})
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=4", "checkpoint.interval=0",
                                                "train.bad_step_policy=rewind",
                                                f"run.dir={cfg.run.dir}_rewind"])
    capsys.readouterr()
    train(cfg)
    G = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    assert (f"no checkpoint to rewind to: dropped the update and skipped samples {2 * G}.."
            f"{3 * G - 1}") in capsys.readouterr().err


def test_halt_policy_saves_last_good_state_and_reports(monkeypatch, tiny_overrides):
    NaNAtBatch(monkeypatch, {2})
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=5", "train.bad_step_policy=halt"])
    with pytest.raises(BadStepHalt) as err:
        train(cfg)
    message = str(err.value)
    assert (
        "halted at step 3" in message
        and "non-finite loss" in message
        and "loss/mtp_2=nan" in message
    )
    complete, _ = list_checkpoints(cfg.run.dir)
    assert [s for s, _ in complete] == [2]


def test_rewind_policy_replays_from_checkpoint_skipping_the_batch(monkeypatch, tiny_overrides):
    injector = NaNAtBatch(monkeypatch, {3})
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=6", "checkpoint.interval=2",
                                                "train.bad_step_policy=rewind"])
    train(cfg)
    assert injector.hit == [3]
    # step 3 ran before the bad step 4 and again after the rewind to step 2: logged once
    assert [r["step"] for r in records(cfg.run.dir)] == [1, 2, 3, 4, 5, 6]
    state = json.load(open(os.path.join(cfg.run.dir, "checkpoints", "step_6",
                                        "trainer_state.json")))
    G = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    assert state["skipped_samples"] == [[3 * G, 4 * G]] and state["consumed_samples"] == 6 * G


def test_too_many_bad_steps_halt_any_policy(monkeypatch, tiny_overrides):
    NaNAtBatch(monkeypatch, {1, 2})
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=5", "train.bad_step_policy=skip",
                                                "train.max_skips=1"])
    with pytest.raises(BadStepHalt, match=r"2 bad steps within 100 steps \(train.max_skips=1\)"):
        train(cfg)


def test_loss_spike_is_a_bad_step(monkeypatch, tiny_overrides):
    original = TrainStep.forward_backward
    calls = []

    def spiky(train_step, batches, counts, coefs, qsa_dense=False):
        sums = original(train_step, batches, counts, coefs, qsa_dense)
        calls.append(1)
        return sums * 10 if len(calls) == 7 else sums

    monkeypatch.setattr(TrainStep, "forward_backward", spiky)
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=8", "train.spike_factor=3",
                                                "train.spike_window=5"])
    train(cfg)
    recs = records(cfg.run.dir)
    assert [r.get("skipped", 0.0) for r in recs] == [0, 0, 0, 0, 0, 0, 1, 0]


@pytest.mark.slow
def test_torchrun_restart_resumes_after_a_rank_dies(tiny_overrides, tmp_path):
    """A rank SIGKILLed after step 3 makes torchrun restart the group, which resumes from step 2.

    The restart re-forms the gloo group in torchrun's shared store, where a restarted rank once read
    the dead attempt's peer addresses (see trainer/parallel/layout.py:init_process_group). One
    process restarting would show nothing more: a resume is bit-exact (test_train_resume.py)."""
    nproc, layout, victim = 2, ["parallel.ep=2"], "3:1"  # rank 1 dies after step 3
    run = str(tmp_path / "elastic")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc),
           "--max-restarts", "1", "-m", "tandem.trainer.cli", "train", RECIPE, *tiny_overrides,
           *layout, "train.max_steps=6", "checkpoint.interval=2", f"run.dir={run}"]
    env = fault_env(os.environ, TANDEM_TEST_KILL_AT_STEP=victim)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "at step 2" in done.stderr
    got = losses(run)
    # n ranks split a batch n times as large: one process accumulating n micro-batches sees the same
    # data.
    want = uninterrupted_losses(tiny_overrides, tmp_path / "reference", accum=nproc)
    # ep2 sums in another order than one process, so agreement is to 1e-5 (as tests/distributed
    # checks).
    assert [r[0] for r in got] == [r[0] for r in want] == list(range(1, 7))
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_before_the_first_update_changes_nothing(monkeypatch, tiny_overrides,
                                                              tmp_path):
    """Step 1 skipped, then a checkpoint: torch's state-dict template gave the optimizer that had
    never stepped a zero-gradient step, so step 2 took step 2's bias correction (loss 6.1979 where
    the run that did not save had 6.1921 by step 4), and the checkpoint recorded it."""
    figures = []
    for extra in (["checkpoint.save_final=false"], ["checkpoint.interval=1"]):
        NaNAtBatch(monkeypatch, {0})
        cfg = load_config(RECIPE, tiny_overrides + [f"run.dir={tmp_path / extra[0]}",
                                                    "train.max_steps=3",
                                                    "train.bad_step_policy=skip", *extra])
        train(cfg)
        figures.append([(r["loss/main"], r["grad_norm"]) for r in records(cfg.run.dir)][1:])
    assert figures[0] == figures[1]


@pytest.mark.parametrize("extra", [["mtp.num_steps=1", "mtp.num_layers=2"],
                                   ["train.bad_step_policy=skip"]], ids=["unused_layer", "skipped"])
def test_resume_when_parameters_hold_no_optimizer_state(monkeypatch, tiny_overrides, tmp_path,
                                                        extra):
    """A looped MTP layer no depth uses (and the QSA indexer-only warm-up's frozen model) never
    gets a gradient, and a run whose every update was skipped has none at all: AdamW holds no state
    for them, the checkpoint neither, and the resume refused it as corrupt ('Missing key in
    checkpoint state_dict'). It continues as the uninterrupted run does."""
    runs = {}
    for name, steps, resume in (("full", 4, False), ("part", 2, False), ("part", 4, True)):
        if "train.bad_step_policy=skip" in extra and not resume:
            NaNAtBatch(monkeypatch, {0, 1})
        cfg = load_config(RECIPE, tiny_overrides + [f"run.dir={tmp_path / name}", *extra,
                                                    f"train.max_steps={steps}",
                                                    f"checkpoint.interval={2 * (name == 'part')}",
                                                    "train.max_skips=5"])
        train(cfg, resume=resume)
        runs[name] = [(r["loss/main"], r["grad_norm"]) for r in records(cfg.run.dir)]
    assert runs["part"] == runs["full"]


def test_a_kill_while_a_step_is_saved_again_keeps_it(tiny_overrides, tmp_path):
    """A halt (or rewind) saves again the step an interval save has just written: the old copy is
    moved aside to .stale_step_N, then .tmp_step_N renamed into place. A kill between the renames
    left no step_N, both copies were ignored, and with checkpoint.keep_last=1 the resume started
    from step 0. Each copy, marked complete, now stands for the step (the new one first)."""
    import shutil

    args = tiny_overrides + ["train.max_steps=2", "checkpoint.keep_last=1"]
    train(load_config(RECIPE, args))
    run = load_config(RECIPE, args).run.dir
    root = os.path.join(run, "checkpoints")
    shutil.copytree(os.path.join(root, "step_2"), os.path.join(root, ".tmp_step_2"))
    os.rename(os.path.join(root, "step_2"), os.path.join(root, ".stale_step_2"))
    complete, incomplete = list_checkpoints(run)
    assert complete == [(2, os.path.join(root, ".tmp_step_2"))]
    assert incomplete == [os.path.join(root, ".stale_step_2")]
    shutil.rmtree(os.path.join(root, ".tmp_step_2"))
    assert list_checkpoints(run)[0] == [(2, os.path.join(root, ".stale_step_2"))]
    train(load_config(RECIPE, args[:-2] + ["train.max_steps=3", "checkpoint.keep_last=1"]),
          resume=True)
    assert [r["step"] for r in records(run) if "loss/main" in r] == [1, 2, 3]
    assert [s for s, _ in list_checkpoints(run)[0]] == [3]
