"""The statistics behind `tandem report`: smoothed training curves, the evaluator's 95% intervals,
the evaluations that moved, and which runs' final figures differ.

* `ema`: an exponential moving average of a training curve (pandas' `ewm(span=N, adjust=False)`: the
  weight of a point decays by 2 / (N + 1) a record), so noisy per-step losses read as a trend;
* `interval`: the `<key>_lo95` / `<key>_hi95` series the evaluator logs beside each acceptance
  figure;
* `shifts`: evaluations whose interval does not overlap the previous evaluation's (a change a reader
  can trust; overlapping intervals do not prove there is none);
* `final_rows` / `compare_runs`: the last evaluation of each overlaid run with its interval, and a
  test of each pair of runs' difference at the last step both evaluated (`differences`).

The test of a difference. Non-overlapping 95% intervals is a valid but conservative test (two
intervals can overlap while the difference is significant at 5%: it rejects at about 0.6% for equal
widths). Instead each run's standard error is read from its logged interval, half-width / 1.96 (the
bootstrap interval over prompts, eval/acceptance.py), and the difference b - a is tested with the
normal statistic z = (b - a) / sqrt(se_a^2 + se_b^2), two-sided, at 5%. The runs are treated as
independent. They are evaluated on the same prompts, and prompts that are easy for one model are
usually easy for the other, so the true variance of the difference is smaller: the test errs on the
side of "not significant". A paired bootstrap would need both runs' per-prompt rows, which
metrics.jsonl does not hold. An asymmetric interval is summarised by its half-width.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import List, Optional, Sequence, Tuple

import pandas as pd

Z95 = NormalDist().inv_cdf(0.975)
"""The normal quantile of a two-sided 95% interval (1.96)."""
ALPHA = 0.05
"""The test's level: a difference with p below it is called significant."""


def ema(values: Sequence[float], span: int) -> List[float]:
    """The EMA of `values` with pandas' span `span` (span <= 1 returns them unchanged)."""
    if span <= 1 or not values:
        return list(values)

    return pd.Series(list(values), dtype="float64").ewm(span=span, adjust=False).mean().tolist()


def interval(run, key: str) -> Tuple[List[int], List[float], List[float], List[float]]:
    """(steps, values, lo, hi) of the records of `run` that hold `key` and its 95% interval."""
    steps, (values, lo, hi) = run.aligned(key, f"{key}_lo95", f"{key}_hi95")
    return steps, values, lo, hi


def shifts(lo: Sequence[float], hi: Sequence[float]) -> List[int]:
    """Indices i >= 1 whose interval [lo_i, hi_i] does not overlap [lo_{i-1}, hi_{i-1}]."""
    return [i for i in range(1, len(lo)) if lo[i] > hi[i - 1] or hi[i] < lo[i - 1]]


@dataclass
class Final:
    """One run's last evaluation of one figure."""

    run: str
    key: str
    step: int
    value: float
    lo: float
    hi: float

    @property
    def se(self) -> float:
        """The standard error the 95% interval implies (half-width / 1.96)."""
        return (self.hi - self.lo) / 2 / Z95


def _final_at(run, key: str, step: Optional[int] = None) -> Optional[Final]:
    """`run`'s evaluation of `key` at `step` (its last one there: a resumed run may log a step
    twice), or its last evaluation when `step` is None; None when it logged none."""
    steps, values, lo, hi = interval(run, key)
    if not steps:
        return None
    i = len(steps) - 1 if step is None else len(steps) - 1 - steps[::-1].index(step)
    return Final(run.label, key, steps[i], values[i], lo[i], hi[i])


def final_rows(runs, keys: Sequence[str]) -> List[Final]:
    """The last evaluation of each `key` in each run that logged it with an interval."""
    return [f for key in keys for run in runs if (f := _final_at(run, key)) is not None]


def compare_runs(runs, keys: Sequence[str]) -> List["Difference"]:
    """Each pair of runs' figures compared at the last step both evaluated: a run stopped at step
    500 and one trained on to 750 differ by the 250 steps as much as by what the runs vary, so they
    are compared at 500; a pair with no step in common is reported untested."""
    out = []
    for key in keys:
        logged = [(run, set(steps)) for run in runs if (steps := interval(run, key)[0])]
        for (a, a_steps), (b, b_steps) in itertools.combinations(logged, 2):
            common = a_steps & b_steps
            step = max(common) if common else None
            out += differences([_final_at(a, key, step), _final_at(b, key, step)])
    return out


@dataclass
class Difference:
    """A pair of runs' final figures compared."""

    key: str
    a: Final
    b: Final
    diff: float
    """b - a."""
    p: float
    """Two-sided p of the normal test (module docstring); NaN when untested."""
    overlap: bool
    """Whether the two 95% intervals overlap (the conservative check)."""

    @property
    def significant(self) -> bool:
        return self.p < ALPHA


def _p_value(a: Final, b: Final) -> float:
    """NaN for figures of different steps (`compare_runs`), and when either interval has zero
    width: prompts with identical counts (all drafts accepted,
    none accepted) show no spread, which says nothing of that figure's uncertainty (one side's
    se of 0 made a two-prompt evaluation at 4.0 differ from 3.90 +- 0.05 at p = 9e-5)."""
    se = math.hypot(a.se, b.se)
    if a.step != b.step or a.se == 0 or b.se == 0:
        return math.nan
    return 2 * (1 - NormalDist().cdf(abs(b.value - a.value) / se))


def differences(finals: Sequence[Final]) -> List[Difference]:
    """Every pair of runs for each key (in run order), tested as the module docstring says."""
    out = []
    keys = list(dict.fromkeys(f.key for f in finals))
    for key in keys:
        rows = [f for f in finals if f.key == key]
        for a, b in itertools.combinations(rows, 2):
            out.append(Difference(key, a, b, b.value - a.value, _p_value(a, b),
                                  not (a.lo > b.hi or b.lo > a.hi)))
    return out


def verdict(d: Difference) -> str:
    """One phrase for the table: which run is ahead and whether it is significant."""
    if d.a.step != d.b.step:
        return f"untested: evaluated at different steps ({d.a.step}, {d.b.step})"
    if math.isnan(d.p):
        return "untested: an interval without width"
    if not d.significant:
        return "not significant"
    ahead = d.b.run if d.diff > 0 else d.a.run
    return f"significant: {ahead} higher" + ("" if d.overlap else " (intervals do not overlap)")


def _steps(d: Difference) -> str:
    return (f"step {d.a.step}" if d.a.step == d.b.step
            else f"steps {d.b.step} - {d.a.step}")


def text_table(finals: Sequence[Final], diffs: Sequence[Difference]) -> str:
    """The final figures and the pairwise tests as plain text (what `tandem report` prints)."""
    lines = ["final figures (95% interval):"]
    for f in finals:
        lines.append(f"  {f.key}  {f.run}  step {f.step}: {f.value:.3f} [{f.lo:.3f}, {f.hi:.3f}]")
    if diffs:
        lines.append(f"differences (normal test on the intervals' half-widths, level {ALPHA:g}):")
    for d in diffs:
        lines.append(f"  {d.key}  {d.b.run} - {d.a.run} = {d.diff:+.3f}  {_steps(d)}  p={d.p:.3g}  "
                     f"{verdict(d)}")
    return "\n".join(lines)


def html_tables(finals: Sequence[Final], diffs: Sequence[Difference], escape) -> Optional[str]:
    """The same as two HTML tables (None without finals)."""
    if not finals:
        return None

    def table(header, rows):
        head = "<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>"
        body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>\n"
                       for row in rows)
        return f'<table class="significance">\n{head}\n{body}</table>'

    parts = ["<h2>final figures</h2>",
             table(["figure", "run", "step", "value", "95% interval"],
                   [[f.key, f.run, f.step, f"{f.value:.3f}",
                     f"[{f.lo:.3f}, {f.hi:.3f}]"] for f in finals])]
    if diffs:
        parts += ["<h2>significance</h2>",
                  "<p>Difference of the final figures, two-sided normal test with each run's "
                  "standard error "
                  f"taken from its logged 95% interval (half-width / {Z95:.2f}); significant when "
                  "p &lt; "
                  f"{ALPHA:g}. Runs are treated as independent, which is conservative for runs "
                  "evaluated on the "
                  "same prompts.</p>",
                  table(["figure", "runs", "at", "difference", "p", "verdict"],
                        [[d.key, f"{d.b.run} - {d.a.run}", _steps(d), f"{d.diff:+.3f}",
                          f"{d.p:.3g}",
                          verdict(d)]
                         for d in diffs])]
    return "\n".join(parts)
