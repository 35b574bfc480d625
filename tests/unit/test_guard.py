"""The bad-step guard's window (train.skip_window): more than train.max_skips bad steps within the
last skip_window steps halt the run whatever the policy; bad steps that have left the window no
longer count."""

import math

from tandem.trainer.guard import BadStepGuard
from tandem.trainer.recipe import load_config


def _guard(window: int) -> BadStepGuard:
    t = load_config(None, ["train.bad_step_policy=skip", "train.max_skips=1",
                           f"train.skip_window={window}"]).train
    return BadStepGuard(t, False, data_position=None, save=None, restore=None)


def _actions(guard: BadStepGuard, bad_at, steps: int):
    out = []
    for step in range(1, steps + 1):
        loss = math.nan if step in bad_at else 1.0
        out.append(guard.inspect(step, {"step": step, "loss": loss, "loss/main": loss}, 1.0))
    return out


def test_bad_steps_apart_by_more_than_the_window_are_skipped():
    actions = _actions(_guard(window=5), {2, 8}, 10)  # step 2 has left the window when step 8 fails
    assert [s for s, a in enumerate(actions, 1) if a != "ok"] == [2, 8]
    assert set(actions) == {"ok", "skip"}


def test_bad_steps_within_the_window_halt():
    actions = _actions(_guard(window=10), {2, 8}, 8)
    assert actions[1] == "skip" and actions[7] == "halt"
