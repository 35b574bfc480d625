"""`tandem report` on two synthetic runs' metrics.jsonl: the evaluator's intervals are drawn as
bands, the training curves as an EMA over faint raw points, evaluations that moved are starred, and
the final figures with their significance are printed and tabled."""

from __future__ import annotations

import html
import json
import math
import re

import pytest

from tests import processes

# run a: acceptance jumps from ~2.0 to ~2.6 (non-overlapping intervals at step 20), then holds;
# run b ends at 2.0 with the same width: the final difference (0.6, se 0.07 each) is significant.
# Their T1 figures end 0.02 apart: not significant.
EVALS = {
    "a": [(10, 2.00, 0.10), (20, 2.60, 0.10), (30, 2.62, 0.10)],
    "b": [(10, 2.00, 0.12), (20, 2.05, 0.12), (30, 2.00, 0.14)],
}


def _write_run(path, evals, offset: float):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, 31):  # a noisy training loss every step
            f.write(json.dumps({"step": step,
                                "loss/main": 5.0 - 0.05 * step + offset * (-1) ** step,
                                "loss/mtp_1": 5.5 - 0.04 * step}) + "\n")
            for s, value, half in evals:
                if s == step:
                    rec = {"step": step, "eval/loss/main": 4.0}
                    for key, v in (("eval/acceptance_length", value),
                                   ("eval/T1/acceptance_length", 2.3),
                                   ("eval/accept_rate/pos_1", value / 4),
                                   ("eval/draft_acceptance_rate", value / 4)):
                        rec.update({key: v, f"{key}_lo95": v - half, f"{key}_hi95": v + half})
                    f.write(json.dumps(rec) + "\n")
    return str(path)


@pytest.fixture
def runs(tmp_path):
    return [_write_run(tmp_path / "a", EVALS["a"], 0.3),
            _write_run(tmp_path / "b", EVALS["b"], 0.0)]


def _svg_group(page: str, gid: str) -> str:
    """The SVG <g> element matplotlib wrote for the artist with this gid."""
    m = re.search(rf'<g id="{re.escape(html.escape(gid))}">(.*?)</g>', page, flags=re.S)
    assert m, f"no SVG group {gid!r}"
    return m.group(1)


def test_report_bands_ema_shifts_and_significance(runs, tmp_path):
    out = tmp_path / "report"
    proc = processes.tandem(["report", *runs, "--out", out, "--ema-span", "5"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    stdout = proc.stdout.strip().splitlines()
    assert stdout[-1] == str(out / "report.html")
    page = (out / "report.html").read_text()
    # bands: a filled path for each run's greedy acceptance interval, and for draft position 1
    for run in ("a", "b"):
        for key in ("eval/acceptance_length", "eval/T1/acceptance_length",
                    "eval/accept_rate/pos_1"):
            band = _svg_group(page, f"{run}|{key}|band")
            assert "<path" in band and "fill" in band
        # the EMA line over the faint raw loss
        assert "<path" in _svg_group(page, f"{run}|loss/main|ema")
        assert "<path" in _svg_group(page, f"{run}|loss/main")
    # run a's step-20 evaluation does not overlap step 10's: starred and listed; run b never moved
    assert "<use" in _svg_group(page, "a|eval/acceptance_length|shift")
    assert 'id="b|eval/acceptance_length|shift"' not in page
    assert ("a eval/acceptance_length: step 10 2.000 [1.900, 2.100] &rarr; step 20 2.600 [2.500, "
            "2.700]") in page
    # the final figures with intervals, and the verdicts
    assert ("<td>eval/acceptance_length</td><td>a</td><td>30</td><td>2.620</td><td>[2.520, "
            "2.720]</td>") in page
    text = "\n".join(stdout)
    assert "eval/acceptance_length  b - a = -0.620" in text and "significant: a higher" in text
    t1 = next(line for line in stdout if "eval/T1/acceptance_length  b - a" in line)
    assert "+0.000" in t1 and t1.endswith("not significant")
    assert "<script" not in page and 'src="http' not in page


def test_ema_span_one_draws_raw(runs):
    import matplotlib.pyplot as plt

    from tandem.trainer.report import make_figures
    from tandem.trainer.report_runs import read_run

    figures = make_figures([read_run(d) for d in runs], ema_span=1)
    gids = {line.get_gid() for ax in figures["losses"].axes for line in ax.get_lines()}
    assert "a|loss/main" in gids and "a|loss/main|ema" not in gids
    for fig in figures.values():
        plt.close(fig)


def test_difference_test_units():
    from tandem.trainer.report_stats import Final, differences, ema, shifts

    assert shifts([1.0, 1.5, 1.4], [1.2, 1.7, 1.6]) == [1]
    assert ema([0.0, 1.0], 3) == [0.0, 0.5]  # alpha = 2 / (3 + 1)
    # equal intervals of half-width 0.196 (se 0.1): a gap of 0.3 overlaps yet is significant (z
    # 2.12)
    a, b = Final("a", "k", 1, 2.0, 1.804, 2.196), Final("b", "k", 1, 2.3, 2.104, 2.496)
    (d,) = differences([a, b])
    assert d.overlap and d.significant and d.p == pytest.approx(0.0339, abs=1e-3)
    # two zero-width intervals (a few prompts with identical counts): nothing to test, not p = 0
    from tandem.trainer.report_stats import verdict

    (flat,) = differences([Final("a", "k", 1, 1.0, 1.0, 1.0), Final("b", "k", 1, 1.2, 1.2, 1.2)])
    assert not flat.significant and verdict(flat).startswith("untested")
    # nor one: two prompts that accepted every draft against a measured 3.90 +- 0.05
    (one,) = differences([Final("a", "k", 1, 4.0, 4.0, 4.0), Final("b", "k", 1, 3.9, 3.85, 3.95)])
    assert not one.significant and verdict(one).startswith("untested")


def test_runs_are_compared_at_the_last_step_both_evaluated():
    """A run stopped at step 20 was tested against another's step-30 figure: the gap training
    opens in those steps read as the runs' difference."""
    from tandem.trainer.report_runs import Run
    from tandem.trainer.report_stats import compare_runs, verdict

    def run(label, evals):
        key = "eval/acceptance_length"
        return Run.from_records(label, label, [{"step": s, key: v, f"{key}_lo95": v - 0.1,
                                   f"{key}_hi95": v + 0.1} for s, v in evals], {})

    long = run("long", [(10, 2.0), (20, 2.05), (30, 2.6)])
    short = run("short", [(10, 2.0), (20, 2.0)])
    other = run("other", [(15, 2.0)])
    same, never, never_too = compare_runs([long, short, other], ["eval/acceptance_length"])
    assert (same.a.step, same.b.step) == (20, 20)
    assert same.diff == pytest.approx(-0.05) and verdict(same) == "not significant"
    assert (never.a.step, never.b.step) == (30, 15) and math.isnan(never.p)
    assert verdict(never) == "untested: evaluated at different steps (30, 15)"
    assert verdict(never_too).startswith("untested: evaluated at different steps")


def test_summary_shows_the_lambda_schedule_and_the_losses_their_objective():
    """Runs that differ in their MTP weight schedule showed the same `lambda 0.3`; an acceptance
    objective's training loss (-log sum min(p, q), near 0) was drawn as 'cross-entropy' beside the
    held-out cross-entropy."""
    from tandem.trainer.report import _summary_rows, loss_figure
    from tandem.trainer.report_runs import Run

    records = [{"step": s, "loss/main": 6.0, "loss/mtp_1": 0.07, "eval/loss/mtp_1": 6.2}
               for s in (1, 2)]
    plain = Run.from_records("plain", "a", records,
                             {"mtp": {"num_steps": 1, "loss": {"lambda": 0.3}}})
    scheduled = Run.from_records("acc", "b", records, {"mtp": {"num_steps": 1, "loss": {
        "lambda": 0.3, "lambda_after": {250: 0.1, 40: 0.2}, "objective": "acceptance"}}})
    rows = _summary_rows([plain, scheduled])
    assert rows[0][5] == "0.3" and rows[1][5] == "0.3 -> 0.2 @40 -> 0.1 @250"
    fig = loss_figure([plain, scheduled])
    labels = [t.get_text() for t in fig.legends[0].get_texts()] if fig.legends else [
        line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert "acc train (acceptance loss)" in labels and "plain train" in labels
    assert fig.axes[0].get_ylabel() == "nats (held-out: cross-entropy)"


def test_shifts_finds_a_drop_as_well_as_a_rise():
    from tandem.trainer.report_stats import shifts
    assert shifts([1.5, 1.0], [1.7, 1.2]) == [1]  # the second interval lies wholly below the first
    assert shifts([1.0, 1.5, 1.0], [1.2, 1.7, 1.2]) == [1, 2]
    assert shifts([1.0, 1.1], [1.2, 1.3]) == []  # overlapping: no shift
