"""A checkpoint saved under one parallel layout resumes under another, through the real CLI.

tp2 x pp2 (4 processes, the pipeline's embedding copy and vocab-parallel DTensors) trains 2 steps
and checkpoints; the checkpoint then resumes at tp1 x ep2 (2 processes, experts sharded over ep) and
in a single process, each running steps 3 and 4. Every run must match one uninterrupted
single-process run of 4 steps: per-step loss/main within 1e-5 relative, and the saved parameters
of steps 2 and 4 (read back in one process from the DCP shards) within the same tolerance.

The global batch is the same 8 samples per step everywhere: micro-batch 2 x 4 accumulation steps
on one batch rank (single process, tp2 x pp2), 2 x 2 on each of the two ep ranks (ep is carved out
of data parallelism). All steps lie in the warm-up, so the learning rate does not depend on
train.max_steps and the 2-step run sees exactly the first two steps of the 4-step run.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_cli_layouts import RECIPE, SMALL, main_losses, run, tandem_cmd  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RTOL = 1e-5


def _launch(world, args, env):
    exe = tandem_cmd()
    if world == 1:
        return run(exe + args, env)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    launcher += ["--no-python", *exe] if len(exe) == 1 else ["-m", "tandem.trainer.cli"]
    run(launcher + args, env)


def _params(step_dir):
    from tandem.trainer.checkpoint import load_model_from_checkpoint

    model, _ = load_model_from_checkpoint(str(step_dir))
    return {n: p.detach().clone() for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if "rotary" not in n and "tokens_per_expert" not in n}


def _assert_params_close(got, ref, what):
    assert set(got) == set(ref), set(got) ^ set(ref)
    worst = max((float((got[n].double() - ref[n].double()).norm() / ref[n].double().norm().clamp(min=1e-30)), n)
                for n in ref)
    assert worst[0] < RTOL, f"{what}: parameter {worst[1]} relative error {worst[0]:.2e}"


def _assert_losses_close(got, ref, steps, what):
    assert sorted(got) == list(steps), (what, sorted(got))
    for step in steps:
        assert abs(got[step] - ref[step]) <= RTOL * abs(ref[step]), (what, step, got, ref)


def test_checkpoint_saved_at_tp2_pp2_resumes_at_ep2_and_single_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    common = [RECIPE] + SMALL + [f"data.cache_dir={tmp_path / 'cache'}", "checkpoint.interval=0"]
    train = ["train"] + common

    ref_dir = tmp_path / "single_4steps"
    _launch(1, train + [f"run.dir={ref_dir}", "train.max_steps=4", "train.grad_accum_steps=4",
                        "checkpoint.interval=2"], env)
    ref = main_losses(ref_dir)
    assert sorted(ref) == [1, 2, 3, 4]

    saved_dir = tmp_path / "tp2pp2"
    _launch(4, train + [f"run.dir={saved_dir}", "train.max_steps=2", "train.grad_accum_steps=4",
                        "parallel.tp=2", "parallel.pp=2"], env)
    _assert_losses_close(main_losses(saved_dir), ref, [1, 2], "tp2xpp2 before the checkpoint")
    ckpt = saved_dir / "checkpoints" / "step_2"
    ref_params2 = _params(ref_dir / "checkpoints" / "step_2")
    _assert_params_close(_params(ckpt), ref_params2, "tp2xpp2 checkpoint vs single process at step 2")
    ref_params4 = _params(ref_dir / "checkpoints" / "step_4")

    for name, world, extra in [("resume_ep2", 2, ["parallel.ep=2", "train.grad_accum_steps=2"]),
                               ("resume_single", 1, ["train.grad_accum_steps=4"])]:
        run_dir = tmp_path / name
        os.makedirs(run_dir / "checkpoints")
        shutil.copytree(ckpt, run_dir / "checkpoints" / "step_2")
        _launch(world, train + [f"run.dir={run_dir}", "train.max_steps=4", *extra, "--resume"], env)
        _assert_losses_close(main_losses(run_dir), ref, [3, 4], name)
        _assert_params_close(_params(run_dir / "checkpoints" / "step_4"), ref_params4, f"{name} at step 4")


def test_checkpoint_saved_with_spread_loss_depths_resumes_in_one_process(tmp_path):
    """Loss depths spread over interleaved stages (pp_balance) with FSDP over dp=2: the embedding, head
    and MTP module have copies on both pp ranks, some kept whole (two stages of a rank share them)
    beside FSDP shards. The DCP checkpoint holds each once and resumes in a single process exactly."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    train = ["train", RECIPE] + SMALL + [f"data.cache_dir={tmp_path / 'cache'}", "checkpoint.interval=0"]
    ref_dir = tmp_path / "single_4steps"
    _launch(1, train + [f"run.dir={ref_dir}", "train.max_steps=4", "train.grad_accum_steps=4",
                        "checkpoint.interval=2"], env)
    ref = main_losses(ref_dir)
    saved_dir = tmp_path / "spread"
    _launch(4, train + [f"run.dir={saved_dir}", "train.max_steps=2", "train.grad_accum_steps=2", "parallel.pp=2",
                        "parallel.dp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_balance=true"], env)
    _assert_losses_close(main_losses(saved_dir), ref, [1, 2], "spread depths before the checkpoint")
    ckpt = saved_dir / "checkpoints" / "step_2"
    _assert_params_close(_params(ckpt), _params(ref_dir / "checkpoints" / "step_2"), "spread depths at step 2")
    run_dir = tmp_path / "resume_single"
    os.makedirs(run_dir / "checkpoints")
    shutil.copytree(ckpt, run_dir / "checkpoints" / "step_2")
    _launch(1, train + [f"run.dir={run_dir}", "train.max_steps=4", "train.grad_accum_steps=4", "--resume"], env)
    _assert_losses_close(main_losses(run_dir), ref, [3, 4], "resume_single from spread depths")
    _assert_params_close(_params(run_dir / "checkpoints" / "step_4"), _params(ref_dir / "checkpoints" / "step_4"),
                         "resume_single from spread depths at step 4")
