"""Bad input in a checkpoint's side files: `--resume` and `tandem eval --checkpoint` give one line
naming the file (and line), before the model is built, and leave the run directory as it was.
"""

import os
import shutil

import pytest

import tandem.trainer.run as run_module
from tests.e2e import test_bad_input as bad_input

RECIPE, snapshot = bad_input.RECIPE, bad_input.snapshot
ctx, earlier_run = bad_input.ctx, bad_input.earlier_run  # the fixtures, registered here


def _step(ctx, n=2):
    return os.path.join(ctx.run, "checkpoints", f"step_{n}")


def _damage(ctx, name, text):
    with open(os.path.join(_step(ctx), name), "w") as f:
        f.write(text)
    ctx.before = snapshot(ctx.run)
    return os.path.join(_step(ctx), name)


@pytest.fixture
def no_model(monkeypatch):
    """Every refusal here comes before the model is built."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was checked")

    monkeypatch.setattr(run_module, "build_model", refuse)


def test_resume_with_corrupt_checkpoint_config(ctx, no_model):
    path = _damage(ctx, "config.yaml", "x: [\n")
    line = ctx.fails(["train", RECIPE, *ctx.base, "--resume"],
                     f"checkpoint config {path} is not valid YAML")
    assert "line 2" in line


def test_resume_with_corrupt_trainer_state(ctx, no_model):
    path = _damage(ctx, "trainer_state.json", '{"step": 2,\n oops}\n')
    ctx.fails(["train", RECIPE, *ctx.base, "--resume"],
              f"{path}:2: not valid JSON (Expecting property name enclosed in double quotes)")


def test_resume_with_trainer_state_without_step(ctx, no_model):
    path = _damage(ctx, "trainer_state.json", "[2]\n")
    ctx.fails(["train", RECIPE, *ctx.base, "--resume"],
              f"{path}: not a JSON object with an integer 'step'")


def test_resume_from_a_complete_checkpoint_without_dcp_index(ctx, no_model):
    """COMPLETE without DCP's .metadata once failed inside DCP after the model was built, with a
    traceback and a 414-character line."""
    os.remove(os.path.join(_step(ctx), ".metadata"))
    ctx.before = snapshot(ctx.run)
    ctx.fails(["train", RECIPE, *ctx.base, "--resume"],
              f"checkpoint {_step(ctx)} is marked COMPLETE but lacks its .metadata (DCP's index of "
              "its shards); no older complete checkpoint exists")


def test_missing_dcp_index_names_the_older_complete_checkpoint(ctx, no_model):
    shutil.copytree(_step(ctx), _step(ctx, 1))
    os.remove(os.path.join(_step(ctx), ".metadata"))
    ctx.before = snapshot(ctx.run)
    for argv in (["train", RECIPE, *ctx.base, "--resume"], ["eval", "--checkpoint", ctx.run]):
        line = ctx.fails(argv, f"checkpoint {_step(ctx)} is marked COMPLETE but lacks its "
                               ".metadata")
        assert (f"the newest older complete checkpoint is {os.path.basename(_step(ctx, 1))}: move "
                f"{os.path.basename(_step(ctx))} out of ") in line


def _unfinished_save(ctx):
    """A save of step 7 that never completed, and step 1's complete copy left by a kill between
    the renames that publish a step (checkpoint_dirs._scan)."""
    root = os.path.join(ctx.run, "checkpoints")
    os.makedirs(os.path.join(root, ".tmp_step_7", "rng"))
    with open(os.path.join(root, ".tmp_step_7", "rng", "rank0.pt"), "wb") as f:
        f.write(b"\0" * 64)
    shutil.copytree(_step(ctx), os.path.join(root, ".tmp_step_1"))
    with open(os.path.join(root, ".tmp_step_1", "COMPLETE"), "w") as f:
        f.write("1\n")
    ctx.before = snapshot(ctx.run)
    return root


def test_resume_removes_unfinished_saves(ctx, capsys):
    """They stayed until their step was saved again: on a full disk, the space a new save needs."""
    root = _unfinished_save(ctx)
    assert bad_input.main(["train", RECIPE, *ctx.base, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint: removed the unfinished save(s) {root}/.tmp_step_7\n" in err, err
    # step 1's copy, marked complete, goes into place
    assert f"uncommitted: {root}/step_1\n" in err, err
    assert sorted(os.listdir(root)) == ["step_1", "step_2", "step_3"]


def test_a_refused_resume_keeps_unfinished_saves(ctx):
    _unfinished_save(ctx)
    ctx.fails(["train", RECIPE, *ctx.base, "--resume", "model.hidden_size=64"],
              "has a different model shape")
