"""A checkpoint saved under one parallel layout resumes under another, through the real CLI.

tp2 x pp2 (4 processes, the pipeline's embedding copy and vocab-parallel DTensors) trains 2 steps of
8 samples and checkpoints. Every run must match one uninterrupted single-process run of 4 steps:
per-step loss/main within 1e-5 relative, and the saved parameters of steps 2 and 4 (read back in one
process from the DCP shards) within the same tolerance.

The reshard of docs/parallelism.md, resuming at tp1 x ep2 on 4 ranks (dp2 x ep2: 4 batch ranks; ep
is carved out of data parallelism), changes the global batch: 2 x 2 on each of 4 batch ranks = 16
samples per step. It must continue the sample stream exactly where the checkpoint left it (step 3
reads samples 16..31, step 4 32..47: each rank's reads are logged sample by sample), and its
learning rate follows the samples seen (step 4 starts at sample 32, schedule step 32 / 8 = 4), equal
to one process resuming with the same 16-sample batch (which also loads the tp2 x pp2 checkpoint in
one process; resuming with the checkpoint's own batch, continuing the uninterrupted run exactly:
the cp2 x pp2 test below). All steps lie in the warm-up, so the learning rate does not depend on
train.max_steps and the 2-step run sees exactly the first two steps of the 4-step run.

The tp2 x pp2 run starts with rank 1 late (it leaves its data building 10 s after the others): a
fresh run's ranks used to look for an earlier run in run.dir each for itself, and a late one found
the config.yaml its own rank 0 had already written and refused the launch.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from omegaconf import OmegaConf

from tests.conftest import fault_env
from tests.distributed.test_cli_layouts import RECIPE, SMALL, launch, main_losses

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RTOL = 1e-5
# test_cli_layouts' small job without its in-loop evaluation (that test checks it under layouts;
# here it would only add decoding to every run)
RUN = SMALL + ["eval.interval=0"]


def _params(step_dir):
    from tandem.trainer.checkpoint import load_model_from_checkpoint

    model, _ = load_model_from_checkpoint(str(step_dir))
    return {n: p.detach().clone() for n,
            p in list(model.named_parameters()) + list(model.named_buffers())
            if "rotary" not in n and "tokens_per_expert" not in n}


def _assert_params_close(got, ref, what):
    assert set(got) == set(ref), set(got) ^ set(ref)
    worst = max((float((got[n].double() - ref[n].double()).norm()
                       / ref[n].double().norm().clamp(min=1e-30)), n)
                for n in ref)
    assert worst[0] < RTOL, f"{what}: parameter {worst[1]} relative error {worst[0]:.2e}"


def _assert_losses_close(got, ref, steps, what):
    assert sorted(got) == list(steps), (what, sorted(got))
    for step in steps:
        assert abs(got[step] - ref[step]) <= RTOL * abs(ref[step]), (what, step, got, ref)


def _steps_read(log_dir):
    """{1-based step: the samples read that step, over every rank} from the trainer's sample log
    (ranks of one batch rank, tp or pp peers, read the same samples: counted once)."""
    steps = {}
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                rec = json.loads(line)
                steps.setdefault(rec["step"], {})[name] = rec["samples"]
    out = {}
    for step, per_rank in steps.items():
        distinct = {tuple(s) for s in per_rank.values()}
        out[step] = sorted(i for s in distinct for i in s)
    return out


def _assert_reads(log_dir, expected, what):
    """Every step read exactly `expected[step]` (a range of sample indices), each sample once."""
    got = _steps_read(log_dir)
    assert sorted(got) == sorted(expected), (what, sorted(got))
    for step, want in expected.items():
        read, want = got[step], list(want)
        skipped = sorted(set(want) - set(read))
        assert read == want, (f"{what}: step {step} read samples {_spans(read)}, expected "
                              f"{_spans(want)}; "
                              f"{len(skipped)} never read: {_spans(skipped)}")


def _spans(indices):
    """Sorted sample indices as `a..b` runs."""
    out = []
    for i in indices:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in out) or "none"


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss/main" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    """The uninterrupted single-process run of 4 steps of 8 samples, checkpointed at steps 2 and 4,
    and its per-step loss/main."""
    tmp = tmp_path_factory.mktemp("reshard_reference")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    ref_dir = tmp / "single_4steps"
    launch(1, ["train", RECIPE] + RUN + [f"data.cache_dir={corpus_cache}", f"run.dir={ref_dir}",
                                           "train.max_steps=4", "train.grad_accum_steps=4",
                                           "checkpoint.interval=2"],
           env)
    ref = main_losses(ref_dir)
    assert sorted(ref) == [1, 2, 3, 4]
    return ref_dir, ref


def test_checkpoint_saved_at_tp2_pp2_resumes_at_tp1_ep2_on_4_ranks_and_single_process(
    tmp_path, reference, corpus_cache
):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    common = [RECIPE] + RUN + [f"data.cache_dir={corpus_cache}", "checkpoint.interval=0"]
    train = ["train"] + common

    def logged(name, **faults):
        os.makedirs(tmp_path / "reads" / name)
        return fault_env(env, TANDEM_TEST_SAMPLE_LOG=str(tmp_path / "reads" / name), **faults)

    ref_dir, ref = reference
    saved_dir = tmp_path / "tp2pp2"
    launch(4, train + [f"run.dir={saved_dir}", "train.max_steps=2", "train.grad_accum_steps=4",
                       "parallel.tp=2", "parallel.pp=2"],
           logged("tp2pp2", TANDEM_TEST_LATE_RANK="1:10"))
    _assert_reads(tmp_path / "reads" / "tp2pp2", {1: range(0, 8), 2: range(8, 16)}, "tp2xpp2")
    _assert_losses_close(main_losses(saved_dir), ref, [1, 2], "tp2xpp2 before the checkpoint")
    ckpt = saved_dir / "checkpoints" / "step_2"
    ref_params2 = _params(ref_dir / "checkpoints" / "step_2")
    _assert_params_close(_params(ckpt), ref_params2,
                         "tp2xpp2 checkpoint vs single process at step 2")

    def resume(name, world, extra):
        run_dir = tmp_path / name
        os.makedirs(run_dir / "checkpoints")
        shutil.copytree(ckpt, run_dir / "checkpoints" / "step_2")
        launch(world, train + [f"run.dir={run_dir}", "train.max_steps=4", *extra, "--resume"],
               logged(name))
        return run_dir

    # the README's reshard, tp1 x ep2 on 4 ranks: 16 samples per step, from sample 16 on
    resharded = resume("resume_tp1_ep2_4ranks", 4, ["parallel.ep=2", "train.grad_accum_steps=2"])
    one_process = resume("resume_single_batch16", 1, ["train.grad_accum_steps=8"])
    for name in ("resume_tp1_ep2_4ranks", "resume_single_batch16"):
        _assert_reads(tmp_path / "reads" / name, {3: range(16, 32), 4: range(32, 48)}, name)
    got, want, before = _records(resharded), _records(one_process), _records(ref_dir)
    assert [got[s]["consumed_samples"] for s in (3, 4)] == [32, 48]
    assert [got[s]["consumed_tokens"] for s in (3, 4)] == [32 * 32, 48 * 32]  # data.seq_len=32
    # the learning rate follows samples: step 3 starts at sample 16 (schedule step 2, as the
    # uninterrupted run's step 3), step 4 at sample 32 (schedule step 4: warm-up lr * 5 /
    # warmup_steps)
    cfg = OmegaConf.load(resharded / "config.yaml").train
    assert got[3]["lr"] == before[3]["lr"]
    assert got[4]["lr"] == pytest.approx(cfg.lr * 5 / cfg.warmup_steps,
                                         rel=1e-12), (got[4]["lr"], before[4]["lr"])
    _assert_losses_close({s: got[s]["loss/main"] for s in got},
                         {s: want[s]["loss/main"] for s in want}, [3, 4],
                         "tp1xep2 on 4 ranks vs one process, both at 16 samples per step")
    _assert_params_close(_params(resharded / "checkpoints" / "step_4"),
                         _params(one_process / "checkpoints" / "step_4"),
                         "tp1xep2 on 4 ranks vs one process at step 4")


def test_checkpoint_saved_at_cp2_pp2_with_spread_depths_resumes_at_cp2_and_in_one_process(
    tmp_path, reference, corpus_cache
):
    """Context parallelism changes no sample and no parameter's placement beyond FSDP's shards, and
    loss depths spread over interleaved stages (pp_balance) give the embedding, head and MTP module
    copies on both pp ranks, kept whole (two stages of a rank share them) beside FSDP's shards over
    the cp ranks. The DCP checkpoint of cp2 x pp2 holds each once, and resumes at cp=2 and in one
    process, each continuing the uninterrupted single-process run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    train = ["train", RECIPE] + RUN + [f"data.cache_dir={corpus_cache}",
                                         "checkpoint.interval=0", "train.grad_accum_steps=4"]
    ref_dir, ref = reference
    saved_dir = tmp_path / "cp2pp2"
    launch(4,
           train + [f"run.dir={saved_dir}", "train.max_steps=2", "parallel.cp=2", "parallel.pp=2",
                       "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_balance=true"], env)
    _assert_losses_close(main_losses(saved_dir), ref, [1, 2], "cp2 x pp2 before the checkpoint")
    ckpt = saved_dir / "checkpoints" / "step_2"
    _assert_params_close(_params(ckpt), _params(ref_dir / "checkpoints" / "step_2"),
                         "cp2 x pp2 at step 2")
    ref_params4 = _params(ref_dir / "checkpoints" / "step_4")
    for name, world, extra in (("resume_cp2", 2, ["parallel.cp=2"]), ("resume_single", 1, [])):
        run_dir = tmp_path / name
        os.makedirs(run_dir / "checkpoints")
        shutil.copytree(ckpt, run_dir / "checkpoints" / "step_2")
        launch(world, train + [f"run.dir={run_dir}", "train.max_steps=4", *extra, "--resume"], env)
        _assert_losses_close(main_losses(run_dir), ref, [3, 4], f"{name} from cp2 x pp2")
        _assert_params_close(_params(run_dir / "checkpoints" / "step_4"), ref_params4,
                             f"{name} from cp2 x pp2 at step 4")


def test_a_pp2_checkpoint_with_unstepped_parameters_resumes_in_one_process(tmp_path,
                                                                           corpus_cache):
    """An MTP layer no depth uses (mtp.num_layers=2 at K=1) holds no AdamW state, nor does the
    checkpoint. Resumed in one process from a pp=2 checkpoint, the load took the unstepped
    parameters' names from the saved pipeline rank's list, in this rank's order, and dropped the
    state of others (the MTP layer's MoE and norms: their weights 0.007 off by step 4)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    train = ["train", RECIPE] + RUN + [f"data.cache_dir={corpus_cache}", "train.grad_accum_steps=2",
                                         "mtp.num_steps=1", "mtp.num_layers=2"]
    launch(1, train + [f"run.dir={tmp_path / 'single'}", "train.max_steps=4",
                       "checkpoint.interval=2"], env)
    launch(2, train + [f"run.dir={tmp_path / 'pp2'}", "train.max_steps=2", "parallel.pp=2"],
           env)
    resumed = tmp_path / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(tmp_path / "pp2" / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    launch(1, train + [f"run.dir={resumed}", "train.max_steps=4", "--resume"], env)
    got, want = _records(resumed), _records(tmp_path / "single")
    for step in (3, 4):
        for key in ("loss/main", "loss/mtp_1", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=RTOL), (step, key)
    _assert_params_close(_params(resumed / "checkpoints" / "step_4"),
                         _params(tmp_path / "single" / "checkpoints" / "step_4"),
                         "pp2 checkpoint resumed in one process, at step 4")


def test_a_frozen_trunk_fine_tune_resumes_under_pp2(reference, tmp_path, corpus_cache):
    """An MTP fine-tune of a frozen trunk, checkpointed in one process after step 1 and resumed at
    pp=2: pipeline rank 0 holds only frozen trunk stages, so it loads no optimizer state, and the
    load took the saved rank's parameter lists as its own and refused their sizes (so did every
    resume, and every bad-step rewind, of such a run under pp=2). Step 2 must equal the
    uninterrupted run's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    trunk = reference[0] / "checkpoints" / "step_2"
    train = ["train", RECIPE] + RUN + [f"data.cache_dir={corpus_cache}", "train.grad_accum_steps=4",
                                         "train.freeze_trunk=true", f"model.init_from={trunk}"]
    launch(1, train + [f"run.dir={tmp_path / 'single'}", "train.max_steps=2",
                       "checkpoint.interval=1"], env)
    resumed = tmp_path / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(tmp_path / "single" / "checkpoints" / "step_1",
                    resumed / "checkpoints" / "step_1")
    launch(2, train + [f"run.dir={resumed}", "train.max_steps=2", "parallel.pp=2", "--resume"],
           env)
    got, want = _records(resumed), _records(tmp_path / "single")
    assert sorted(got) == [2]
    for key in ("loss/main", "loss/mtp_1", "loss/mtp_2", "grad_norm"):
        assert got[2][key] == pytest.approx(want[2][key], rel=RTOL), key
