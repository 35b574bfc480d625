"""Bad-step handling: non-finite loss or grad norm, or a loss spike, before the update is applied.

Policies (`train.bad_step_policy`):
- `skip`: drop the update (weights, optimizer moments and router biases untouched), log and count
  it.
- `halt`: checkpoint the last good state (the weights before this update) and stop with a report
  naming the step and every depth's loss; the CLI exits non-zero.
- `rewind`: reload the newest checkpoint and replay from there, skipping the offending batch.
More than `train.max_skips` bad steps within `train.skip_window` steps halts whatever the policy.
Skipped batches are kept in checkpoints as sample ranges of the data position
(`DataPosition.skipped`), so a resumed run skips the same samples under any global batch.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from typing import Callable, Dict, List, Optional


def rewind_headroom(train_cfg, steps: int) -> int:
    """The most bad steps, and so global batches the `rewind` policy passes over, in a run of
    `steps` steps: more than `max_skips` within `skip_window` steps halt it (counted under any
    policy, so a resume under another policy reads the same sample order)."""
    return train_cfg.max_skips * -(-int(steps) // train_cfg.skip_window)


def depth_loss_sum(record: dict) -> float:
    """The step's losses summed over its depths with weight 1, what spikes are judged on: the
    trained loss weighs the MTP depths by mtp.loss.lambda, and a schedule that raises it
    (lambda_after) made every later step a spike against the mean of the steps before."""
    return sum(v for k, v in record.items() if k == "loss/main" or k.startswith("loss/mtp_"))


class BadStepHalt(RuntimeError):
    """Training stopped on a bad step; the message is the report."""


class BadStepGuard:
    """Decides what a step's losses and gradient norm allow. It acts on the run only through the
    data position and two callbacks: `save(steps_done)` (a blocking checkpoint of the last good
    state) and `restore()` (load the newest checkpoint into the model and optimizer: its trainer
    state, or None when there is none)."""

    def __init__(self, train_cfg, is_main: bool, data_position, save: Callable[[int], None],
                 restore: Callable[[], Optional[dict]]):
        self.t = train_cfg
        self.is_main, self.data = is_main, data_position
        self.save, self.restore = save, restore
        self.recent_losses: deque = deque(maxlen=self.t.spike_window)
        self.bad_steps: List[int] = []
        self.total_bad = 0

    # -- state kept in checkpoints -------------------------------------------------------------
    def state(self) -> dict:
        """What the guard's next decisions depend on: a resumed run spots the same spikes and
        counts the same bad steps towards `train.max_skips` as the run it continues."""
        return {"bad_steps_total": self.total_bad, "bad_steps_recent": list(self.bad_steps),
                "recent_depth_losses": list(self.recent_losses)}

    def load_state(self, state: dict) -> None:
        self.total_bad = int(state.get("bad_steps_total", 0))
        self.bad_steps = [int(s) for s in state.get("bad_steps_recent", [])]
        self.recent_losses.clear()
        # an older checkpoint holds lambda-weighted `recent_losses`: not comparable, left to refill
        self.recent_losses.extend(float(v) for v in state.get("recent_depth_losses", []))

    # -- per-step decision ---------------------------------------------------------------------
    def reason(self, record: dict, grad_norm: float) -> str:
        losses = {k: v for k, v in record.items() if k.startswith("loss")}
        if not all(math.isfinite(v) for v in losses.values()):
            return "non-finite loss"
        if not math.isfinite(grad_norm):
            return "non-finite grad norm"
        if self.t.spike_factor > 0 and len(self.recent_losses) >= min(5, self.t.spike_window):
            mean, loss = sum(self.recent_losses) / len(self.recent_losses), depth_loss_sum(record)
            if loss > self.t.spike_factor * mean:
                return (f"loss spike (summed over depths {loss:.4g} > {self.t.spike_factor} x "
                        f"running mean {mean:.4g})")
        return ""

    def inspect(self, step: int, record: dict, grad_norm: float) -> str:
        """`ok`, or the policy's action for a bad step (`skip`, `halt`, `rewind`)."""
        why = self.reason(record, grad_norm)
        if not why:
            self.recent_losses.append(depth_loss_sum(record))
            return "ok"
        self.total_bad += 1
        self.bad_steps = [s for s in self.bad_steps if s > step - self.t.skip_window] + [step]
        self.last_reason = why
        if self.is_main:
            print(f"bad step {step}: {why}; policy={self.t.bad_step_policy}", file=sys.stderr)
        if len(self.bad_steps) > self.t.max_skips:
            self.last_reason = (f"{why}; {len(self.bad_steps)} bad steps within "
                                f"{self.t.skip_window} steps "
                                f"(train.max_skips={self.t.max_skips})")
            return "halt"
        return self.t.bad_step_policy

    def metrics(self) -> Dict[str, float]:
        return {"bad_steps/total": float(self.total_bad)}

    def halt(self, steps_done: int, record: dict) -> None:
        # the checkpoint is the last good state, from before this step: its guard state too, or the
        # resume, which replays the step, counted it twice (and halted again at max_skips=1)
        counted = self.total_bad, self.bad_steps
        self.total_bad, self.bad_steps = self.total_bad - 1, self.bad_steps[:-1]
        saved = f"last good state saved as checkpoint step_{steps_done}"
        try:
            self.save(steps_done)
        except OSError as exc:  # (a full disk): the halt and its report stand, exit status 3
            saved = f"the last good state could not be saved ({exc})"
        finally:
            self.total_bad, self.bad_steps = counted
        losses = ", ".join(f"{k}={v:.6g}" for k, v in record.items() if k.startswith("loss"))
        raise BadStepHalt(f"halted at step {record['step']}: {self.last_reason}; {losses}; {saved}")

    def rewind(self, steps_done: int) -> int:
        """Reload the newest checkpoint and skip the batch of the bad step; return the step to
        resume at."""
        data = self.data
        bad = data.step_ranges()
        state = self.restore()
        if state is None:  # nothing to rewind to: the update was dropped, move past the batch
            data.skip(bad)
            if self.is_main:
                print(f"no checkpoint to rewind to: dropped the update and skipped samples "
                      f"{', '.join(f'{a}..{b - 1}' for a, b in bad)}", file=sys.stderr)
            return steps_done
        skipped = data.skipped + bad  # the checkpoint may predate earlier rewinds' skips
        # the bad steps seen since that checkpoint still count (towards max_skips and the total);
        # the loss window restarts from the checkpoint's, before the steps that are replayed
        total, recent = self.total_bad, self.bad_steps
        self.load_state(state)
        self.total_bad, self.bad_steps = total, recent
        # the dataset in use was built for this run's sample count, which a resume since that
        # checkpoint may have changed: later checkpoints recorded the older count, and the next
        # resume built the samples in another order
        stream = data.stream_builds
        data.load_state(state)
        data.stream_builds = stream
        data.skip(skipped)
        if self.is_main:
            samples = ", ".join(f"{a}..{b - 1}" for a, b in bad)
            print(f"rewound to checkpoint step {state['step']}; skipping samples {samples}",
                  file=sys.stderr)
        return int(state["step"])
