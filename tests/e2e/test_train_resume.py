"""End-to-end training: losses fall at every depth; resume continues the same trajectory bit for
bit."""

import json
import os
import signal

import pytest

from tandem.trainer.checkpoint import list_checkpoints
from tandem.trainer.loop import train
from tandem.trainer.recipe import load_config

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def signal_after_step(monkeypatch, at: int, sig: signal.Signals) -> None:
    """This process gets `sig` once optimizer step `at` is done, as a rank does from Slurm; called
    again, it replaces the signal set before."""
    from tandem.trainer import loop

    optimizer_step = getattr(loop.optimizer_step, "unsignalled", loop.optimizer_step)

    def step_then_signal(run, step):
        out = optimizer_step(run, step)
        if out[0] == at:
            os.kill(os.getpid(), sig)
        return out

    step_then_signal.unsignalled = optimizer_step
    monkeypatch.setattr(loop, "optimizer_step", step_then_signal)


@pytest.mark.slow
def test_every_depth_learns(tiny_overrides):
    cfg = load_config(RECIPE,
                      tiny_overrides + ["train.max_steps=40", "train.lr=1e-2", "mtp.num_steps=3"])
    train(cfg)
    recs = records(cfg.run.dir)
    assert [r["step"] for r in recs] == list(range(1, 41))
    for key in ["loss/main", "loss/mtp_1", "loss/mtp_2", "loss/mtp_3"]:
        first = sum(r[key] for r in recs[:3]) / 3
        last = sum(r[key] for r in recs[-3:]) / 3
        assert last < first - 0.5, (key, first, last)
    for key in ["loss", "lr", "grad_norm", "tokens_per_s", "mem/peak_gb"]:
        assert key in recs[-1]
    complete, _ = list_checkpoints(cfg.run.dir)
    assert complete[-1][0] == 40
    assert os.path.exists(os.path.join(cfg.run.dir, "config.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_is_bit_exact(tiny_overrides, tmp_path, async_save):
    full = load_config(RECIPE,
                       tiny_overrides + ["train.max_steps=6", f"run.dir={tmp_path / 'full'}"])
    train(full)
    saving = [f"checkpoint.async_save={async_save}", "checkpoint.interval=1",
              "checkpoint.keep_last=2"]
    part = load_config(RECIPE, tiny_overrides + saving + ["train.max_steps=3",
                                                          f"run.dir={tmp_path / 'part'}"])
    train(part)
    complete, incomplete = list_checkpoints(part.run.dir)
    # committed, pruned after completion
    assert [s for s, _ in complete] == [2, 3] and not incomplete
    # a crash after step 3's checkpoint would leave later records; the resume must drop them
    with open(os.path.join(part.run.dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 4, "loss": 123.0}) + "\n")
    resumed = load_config(RECIPE, tiny_overrides + saving + ["train.max_steps=6",
                                                             f"run.dir={tmp_path / 'part'}"])
    train(resumed, resume=True)
    a, b = records(full.run.dir), records(part.run.dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["consumed_samples"] for r in b] == [2, 4, 6, 8, 10, 12]  # micro-batch 2, one rank
    for ra, rb in zip(a, b):
        for key in ra:
            if key.startswith("loss") or key in ("grad_norm", "lr", "moe/max_over_mean_load",
                                                 "consumed_samples",
                                                  "consumed_tokens"):
                assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


def test_resume_on_empty_run_dir_starts_fresh(tiny_overrides):
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=1"])
    record = train(cfg, resume=True)
    assert record["step"] == 1


@pytest.mark.slow
def test_resume_takes_the_optimizer_settings_of_its_config(tiny_overrides):
    """torch's load_state_dict restores each parameter group's settings with the moments: a resume
    under another weight decay, beta2, eps or kernel kept the checkpoint's while config.yaml
    recorded the new ones."""
    from tandem.trainer.run import build_run

    train(load_config(RECIPE, tiny_overrides + ["train.max_steps=1", "train.weight_decay=0.1",
                                                "train.optimizer_kernel=fused"]))
    changed = ["train.max_steps=2", "train.weight_decay=0.0", "train.beta2=0.9",
               "train.eps=1e-6", "train.optimizer_kernel=foreach"]
    run = build_run(load_config(RECIPE, tiny_overrides + changed), resume=True)
    assert run.start_step == 1 and run.optimizer.state  # the moments are the checkpoint's
    for group in run.optimizer.param_groups:
        assert (group["weight_decay"], group["betas"][1], group["eps"]) == (0.0, 0.9, 1e-6)
        assert group["foreach"] and not group["fused"]


@pytest.mark.slow
def test_resume_under_another_global_batch_continues_at_the_next_sample(tiny_overrides,
                                                                        monkeypatch, capsys):
    """3 steps of 2 samples, then a resume at 3 micro-batches of 2 (6 samples per step): the resumed
    steps read samples 6..11 and 12..17, none skipped or repeated, and the learning rate and the MTP
    weight follow the samples seen: the schedule is laid out in steps of the run's first global
    batch (2 samples), so step 5, starting at sample 12, is at schedule step 6, past the end of its
    decay (min_lr) and past the lambda milestone at 5 (counted in steps it would still be at step
    4)."""
    import tandem.trainer.loop as loop

    reads, get_batch = [], loop.get_batch

    def recording_get_batch(ds, indices, eod_id=None):
        reads.append(list(indices))
        return get_batch(ds, indices, eod_id)

    monkeypatch.setattr(loop, "get_batch", recording_get_batch)
    schedule = ["train.warmup_steps=2", "train.max_steps=5", "checkpoint.interval=3",
                "mtp.loss.lambda=0.3", "mtp.loss.lambda_after={5: 0.1}"]
    first = load_config(RECIPE, tiny_overrides + schedule + ["train.max_steps=3"])
    train(first)
    assert reads == [[0, 1], [2, 3], [4, 5]]
    del reads[:]
    resumed = load_config(RECIPE, tiny_overrides + schedule + ["train.grad_accum_steps=3"])
    capsys.readouterr()
    train(resumed, resume=True)
    # max_steps 3 -> 5 re-plans the decay (the checkpoint's had ended: min_lr), and at 6 samples a
    # step the last step is past the schedule's end
    t = resumed.train
    assert ("the LR schedule changed (train.max_steps 3 -> 5): the next step's LR is "
            f"{t.min_lr + 0.75 * (t.lr - t.min_lr):.4g}, {t.min_lr:.4g} on the checkpoint's "
            "schedule; train.decay_steps=1 keeps the checkpoint's decay; the last step "
            "(train.max_steps=5) falls at schedule step 7 of 5 planned") in capsys.readouterr().err
    assert sum(reads, []) == list(range(6, 18)), reads  # today's step x global batch read 18..29
    # another seed orders the samples otherwise: the resume says so (it went on silently)
    reseeded = load_config(RECIPE, tiny_overrides + schedule + ["train.grad_accum_steps=3",
                                                                "train.max_steps=6",
                                                                "train.seed=99"])
    capsys.readouterr()
    train(reseeded, resume=True)
    assert (f"the data order changed (train.seed {t.seed!r} -> 99): the run goes on at sample 18 "
            "of another order") in capsys.readouterr().err
    recs = records(resumed.run.dir)[:5]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["consumed_samples"] for r in recs] == [2, 4, 6, 12, 18]
    assert [r["consumed_tokens"] for r in recs] == [64, 128, 192, 384, 576]  # data.seq_len=32
    # cosine decay over max_steps - warmup_steps = 3 schedule steps: step 4 starts at sample 6
    # (schedule step 3, a third of the decay: cos(pi/3) = 1/2), step 5 at sample 12 (schedule step
    # 6: decay over)
    lrs = [r["lr"] for r in recs[3:]]
    assert lrs == [pytest.approx(t.min_lr + 0.75 * (t.lr - t.min_lr), rel=1e-12), t.min_lr], lrs
    assert [r["mtp/lambda"] for r in recs] == [0.3, 0.3, 0.3, 0.3, 0.1]
    # the logged total is the loss trained on: the main loss plus lambda times the weighted depths
    from tandem.trainer.loss import depth_weights

    last = recs[4]
    depths = [w * last[f"loss/mtp_{k}"] for k, w in enumerate(depth_weights(resumed.mtp), start=1)]
    assert last["loss"] == pytest.approx(last["loss/main"] + 0.1 * sum(depths), rel=1e-6)


@pytest.mark.slow
def test_a_refused_requeue_fails_the_job_naming_the_checkpoint(tiny_overrides, tmp_path,
                                                              monkeypatch, capsys):
    """Slurm may refuse `scontrol requeue` (after the time limit, a job not requeueable): the run
    said it had asked for a requeue and exited 0, so Slurm marked the job COMPLETED with its
    training unfinished. It now exits 4 with a line saying so, its checkpoint kept."""
    from tandem.trainer import preemption
    from tandem.trainer.cli import main

    signal_after_step(monkeypatch, 1, signal.SIGUSR1)
    monkeypatch.setattr(preemption, "requeue_current_job", lambda: False)
    monkeypatch.setenv("SLURM_JOB_ID", "907")
    run_dir = tmp_path / "run"
    assert main(["train", RECIPE, *tiny_overrides, "train.max_steps=4",
                 f"run.dir={run_dir}"]) == 4
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tandem train: preempted: checkpointed step 1, but the requeue of Slurm job 907 failed "
        f"(the log says why): submit it again with run.dir={run_dir} (the job resumes from that "
        "checkpoint)")
    assert [s for s, _ in list_checkpoints(str(run_dir))[0]] == [1]


@pytest.mark.slow
def test_preemption_saves_once_and_a_finished_run_is_not_requeued(tiny_overrides, tmp_path,
                                                                   monkeypatch, capsys):
    """SIGUSR1, Slurm's pre-timeout signal, during step 2, which the interval checkpoints: the run
    stops after step 2 with that one checkpoint (saving it twice left no complete checkpoint of it
    while the copy was replaced) and asks Slurm to requeue it. The signal during a run's last step:
    it finishes with its final checkpoint and asks for no requeue (Slurm would run the finished job
    again)."""
    from tandem.trainer import checkpoint, preemption

    requeues, saves = [], []
    monkeypatch.setattr(preemption, "requeue_current_job", lambda: requeues.append(True))
    save = checkpoint.CheckpointWriter.save

    def counted_save(self, step, *args, **kwargs):
        saves.append(step)
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.CheckpointWriter, "save", counted_save)
    for signalled, name in ((2, "stopped"), (4, "finished")):
        signal_after_step(monkeypatch, signalled, signal.SIGUSR1)
        del requeues[:], saves[:]
        cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=4", "checkpoint.interval=2",
                                                    f"run.dir={tmp_path / name}"])
        assert train(cfg)["step"] == signalled
        assert saves == [2, 4][: signalled // 2] and requeues == ([True] if signalled < 4 else [])
        assert [s for s, _ in list_checkpoints(cfg.run.dir)[0]] == saves

    # SIGTERM (a plain scancel, the scheduler's preemption) checkpoints and stops: it requeued the
    # job, so `scancel` put it back in the queue
    signal_after_step(monkeypatch, 1, signal.SIGTERM)
    del requeues[:], saves[:]
    capsys.readouterr()
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=4", "checkpoint.interval=2",
                                                f"run.dir={tmp_path / 'cancelled'}"])
    assert train(cfg)["step"] == 1 and saves == [1] and requeues == []
    assert "stopped by SIGTERM: checkpointed step 1" in capsys.readouterr().err


def test_peak_memory_is_gathered_on_logged_steps_only(tiny_overrides, monkeypatch):
    """mem/peak_gb is the largest rank's (a collective over every rank): a step that logs nothing
    skips it, and every logged record holds it."""
    from tandem.trainer.parallel.state import ParallelState

    gathered = []
    real = ParallelState.max_over_ranks
    monkeypatch.setattr(ParallelState, "max_over_ranks",
                        lambda self, value: gathered.append(value) or real(self, value))
    cfg = load_config(RECIPE, tiny_overrides + ["train.max_steps=7", "train.log_interval=3",
                                                "checkpoint.interval=0"])
    train(cfg)
    recs = records(cfg.run.dir)
    assert [r["step"] for r in recs] == [3, 6, 7] and len(gathered) == 3
    assert all(r["mem/peak_gb"] == v for r, v in zip(recs, gathered))
