"""The bad-step guard's window (train.skip_window): more than train.max_skips bad steps within the
last skip_window steps halt the run whatever the policy; bad steps that have left the window no
longer count."""

import math

import pytest

from tandem.trainer.guard import BadStepGuard, BadStepHalt
from tandem.trainer.recipe import load_config


def _guard(window: int, spike_factor: float = 0.0) -> BadStepGuard:
    t = load_config(None, ["train.bad_step_policy=skip", "train.max_skips=1",
                           f"train.skip_window={window}",
                           f"train.spike_factor={spike_factor}"]).train
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


def test_the_window_ends_exactly_skip_window_steps_back():
    """skip_window=5 at step 7 covers steps 3..7: step 2 has left it, step 3 has not."""
    assert _actions(_guard(window=5), {2, 7}, 7)[-1] == "skip"
    assert _actions(_guard(window=5), {3, 7}, 7)[-1] == "halt"


def test_spikes_are_judged_from_the_fifth_good_step():
    """As train.spike_factor says: once min(5, spike_window) good steps are in the mean."""
    for good, flagged in ((5, True), (4, False)):
        guard = _guard(window=100, spike_factor=3.0)
        _actions(guard, set(), good)
        reason = guard.reason({"loss": 50.0, "loss/main": 50.0}, 1.0)
        assert reason.startswith("loss spike") == flagged, (good, reason)


def test_a_resumed_guard_decides_as_the_run_it_continues():
    """The guard's state goes through trainer_state.json: a run stopped after step 4 and resumed
    halts at step 7, as the uninterrupted run does (its window held step 2's bad step, which the
    resumed guard had forgotten), and spots the spike at step 9 against the losses before it."""
    import json

    whole = _guard(window=10)
    assert _actions(whole, {2, 7}, 7)[-1] == "halt"
    first = _guard(window=10)
    _actions(first, {2}, 4)
    resumed = _guard(window=10)
    resumed.load_state(json.loads(json.dumps(first.state())))
    assert resumed.state() == first.state()
    assert resumed.inspect(7, {"step": 7, "loss": math.nan}, 1.0) == "halt"

    spiky = _guard(window=10, spike_factor=3.0)
    _actions(spiky, set(), 8)
    later = _guard(window=10, spike_factor=3.0)
    later.load_state(json.loads(json.dumps(spiky.state())))
    assert later.reason({"loss": 50.0, "loss/main": 50.0}, 1.0).startswith("loss spike")


def test_spikes_are_judged_on_the_depths_unweighted():
    """The trained loss weighs the MTP depths by lambda: a schedule raising it from 0.1 to 1.0
    (lambda_after) made each later step a 'spike' (4.0 against a mean of 1.3), and the run halted
    at train.max_skips."""
    guard = _guard(window=100, spike_factor=2.0)
    for step in range(1, 11):
        weight = 0.1 if step <= 5 else 1.0
        record = {"step": step, "loss": 1.0 + weight * 3.0, "loss/main": 1.0,
                  **{f"loss/mtp_{k}": 1.0 for k in (1, 2, 3)}}
        assert guard.inspect(step, record, 1.0) == "ok", step
    spike = {"loss": 1.3, "loss/main": 1.0, "loss/mtp_1": 1.0, "loss/mtp_2": 1.0, "loss/mtp_3": 7.0}
    assert guard.reason(spike, 1.0) == ("loss spike (summed over depths 10 > 2.0 x running mean "
                                        "4)")


class _Position:
    """A data position with one step of samples 8..15 and a record of what it was told."""

    def __init__(self, skipped=()):
        self.skipped = list(skipped)
        self.stream_builds = [4200, 900]  # what this run's dataset was built from

    def load_state(self, state):
        self.skipped = [tuple(r) for r in state["skipped_samples"]]
        self.stream_builds = state["stream_builds"]

    def step_ranges(self):
        return [(8, 16)]

    def skip(self, ranges):
        self.skipped = sorted(set(self.skipped) | set(ranges))


def test_a_rewind_keeps_the_bad_step_it_rewinds_over_counted():
    """`rewind` reloads a checkpoint saved before the bad step: the bad step still counts in the
    total and in the window (the checkpoint's state had 0), and its samples are skipped."""
    t = load_config(None, ["train.bad_step_policy=rewind", "train.max_skips=1"]).train
    checkpoint = {"step": 2, "bad_steps_total": 0, "skipped_samples": [], "stream_builds": [14]}
    guard = BadStepGuard(t, False, _Position(), save=None, restore=lambda: checkpoint)
    assert guard.inspect(3, {"step": 3, "loss": math.nan}, 1.0) == "rewind"
    assert guard.rewind(2) == 2
    assert guard.state()["bad_steps_total"] == 1 and guard.data.skipped == [(8, 16)]
    # the checkpoint predates a resume that appended a build for more samples: the builds of the
    # dataset in use stay (later checkpoints recorded [14], and the next resume read another order)
    assert guard.data.stream_builds == [4200, 900]
    assert guard.inspect(3, {"step": 3, "loss": math.nan}, 1.0) == "halt"  # 2 within the window


def test_a_rewind_past_an_earlier_rewind_keeps_that_ones_skip():
    """A rewind to a checkpoint saved before an earlier rewind skipped samples 0..7: those stay
    skipped beside this step's 8..15 (the checkpoint knew none of them)."""
    t = load_config(None, ["train.bad_step_policy=rewind", "train.max_skips=5"]).train
    checkpoint = {"step": 0, "bad_steps_total": 0, "skipped_samples": [], "stream_builds": [1]}
    guard = BadStepGuard(t, False, _Position([(0, 8)]), save=None, restore=lambda: checkpoint)
    assert guard.inspect(3, {"step": 3, "loss": math.nan}, 1.0) == "rewind"
    guard.rewind(2)
    assert guard.data.skipped == [(0, 8), (8, 16)]


def test_a_halt_checkpoints_the_guard_state_of_the_last_good_step():
    """`halt` saves the state from before the bad step, and the resume replays that step: the
    guard state it saves must not count the step yet. It did, so a halted run resumed under `skip`
    counted one bad step twice, and at max_skips=1 halted again and could not get past it."""
    t = load_config(None, ["train.bad_step_policy=halt", "train.max_skips=1"]).train
    saved = {}
    guard = BadStepGuard(t, False, None, save=lambda step: saved.update(guard.state()),
                         restore=None)
    assert guard.inspect(1, {"step": 1, "loss": 1.0}, 1.0) == "ok"
    assert guard.inspect(2, {"step": 2, "loss": math.nan}, 1.0) == "halt"
    with pytest.raises(BadStepHalt, match="halted at step 2"):
        guard.halt(1, {"step": 2, "loss": math.nan})
    assert saved["bad_steps_total"] == 0 and saved["bad_steps_recent"] == []
    assert guard.state()["bad_steps_total"] == 1
    skip = load_config(None, ["train.bad_step_policy=skip", "train.max_skips=1"]).train
    resumed = BadStepGuard(skip, False, None, save=None, restore=None)
    resumed.load_state(saved)
    assert resumed.inspect(2, {"step": 2, "loss": math.nan}, 1.0) == "skip"
    assert resumed.state()["bad_steps_total"] == 1
