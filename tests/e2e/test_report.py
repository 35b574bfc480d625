"""`tandem report`: the figures hold exactly the series the runs logged, runs are overlaid, and the
HTML page embeds every figure (tests/e2e/test_report_intervals.py: bands, EMA, significance)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import processes

pytestmark = pytest.mark.slow

EVAL = ["eval.interval=2", "eval.num_prompts=2", "eval.prompt_len=8", "eval.max_new_tokens=6",
        "eval.batch_size=2",
        "eval.loss_batches=1", "train.max_steps=4", "train.log_interval=1",
        "eval.temperatures=[1.0,0.7]"]


@pytest.fixture(scope="module")
def two_runs(tiny_base, tmp_path_factory):
    """Two tiny runs that differ in K (2 and 1), the comparison `tandem report` exists for."""
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    root = tmp_path_factory.mktemp("report_runs")
    dirs = []
    for k in (2, 1):
        run_dir = str(root / f"k{k}")
        train(load_config("recipes/tiny.yaml",
                          tiny_base + EVAL + [f"mtp.num_steps={k}", f"run.dir={run_dir}"]))
        dirs.append(run_dir)
    return dirs


def _logged(run_dir: str, key: str):
    steps, values = [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if key in rec:
                steps.append(rec["step"])
                values.append(rec[key])
    return steps, values


def _lines_by_gid(fig):
    return {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}


def test_figures_hold_the_logged_series(two_runs):
    import matplotlib.pyplot as plt

    from tandem.trainer.report import make_figures
    from tandem.trainer.report_runs import read_run

    runs = [read_run(d) for d in two_runs]
    figures = make_figures(runs)
    assert set(figures) == {"losses", "acceptance", "accept_rate_by_position", "decode_throughput"}
    expected = {
        "losses": ["loss/main", "loss/mtp_1", "eval/loss/main", "eval/loss/mtp_1"],
        # greedy and the sampled temperatures, each its own variant line
        "acceptance": ["eval/acceptance_length", "eval/T1/acceptance_length",
                       "eval/T0.7/acceptance_length"],
        "accept_rate_by_position": ["eval/accept_rate/pos_1", "eval/T1/accept_rate/pos_1",
                                    "eval/T0.7/accept_rate/pos_1"],
        "decode_throughput": ["eval/decode_tokens_per_s/spec", "eval/decode_tokens_per_s/ar",
                              "eval/speedup", "eval/speedup_predicted"],
    }
    for name, keys in expected.items():
        lines = _lines_by_gid(figures[name])
        for run_dir, run in zip(two_runs, runs):
            for key in keys:
                steps, values = _logged(run_dir, key)
                assert steps, (run_dir, key)
                line = lines[f"{run.label}|{key}"]
                assert list(line.get_xdata()) == steps, (name, key)
                assert list(line.get_ydata()) == pytest.approx(values, rel=0, abs=0), (name, key)
    # K=2 has a second MTP depth and a second draft position; the K=1 run has neither
    losses = _lines_by_gid(figures["losses"])
    assert "k2|loss/mtp_2" in losses and "k1|loss/mtp_2" not in losses
    assert len(figures["accept_rate_by_position"].axes) == 2
    labels = {line.get_label() for line in figures["acceptance"].axes[0].get_lines()}
    assert {"k2 greedy", "k2 T1", "k2 T0.7", "k1 greedy"} <= labels
    assert [ax.get_title() for ax in figures["losses"].axes] == ["main head", "MTP depth 1",
                                                                 "MTP depth 2"]
    for fig in figures.values():
        plt.close(fig)


def test_cli_writes_pngs_and_a_self_contained_html(two_runs, tmp_path):
    out = tmp_path / "report"
    proc = processes.command(["tandem", "report", *two_runs, "--out", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out / "report.html")
    assert "final figures (95% interval):" in proc.stdout  # the table printed above the page's path
    pngs = sorted(p.name for p in out.iterdir() if p.suffix == ".png")
    assert pngs == ["accept_rate_by_position.png", "acceptance.png", "decode_throughput.png",
                    "losses.png"]
    page = (out / "report.html").read_text()
    assert "src=\"http" not in page and "<script" not in page  # nothing fetched from elsewhere
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'id="figure-{png[:-4]}"><svg' in page  # each figure inline, as vector
    assert "k2" in page and "k1" in page
    assert 'id="k2|eval/acceptance_length|band"' in page and "<h2>significance</h2>" in page


def test_reading_runs_imports_no_torch(two_runs):
    """`tandem report` reads each run's config.yaml with the trainer's YAML reader, which lived
    beside the recipes and imported the model flavors with it: torch, 1.4 s of every report's
    start. A cold interpreter (not the suite's forkserver, which holds torch) reads both runs."""
    code = ("import sys; from tandem.trainer import report; "
            "runs = [report.read_run(d) for d in sys.argv[1:]]; "
            "print(len(runs), runs[1].config['mtp']['num_steps'], 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *two_runs], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2", "1", "False"], proc.stdout


def test_bad_run_dir_is_one_line(tmp_path):
    proc = processes.command(["tandem", "report", str(tmp_path)], timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"tandem report: error: run directory {str(tmp_path)!r} has no "
                                   "metrics.jsonl")
    assert not (tmp_path / "report").exists()


def test_a_torn_last_line_is_skipped_a_bad_line_before_it_named(tmp_path):
    """A crash mid-write tears the last line, which is dropped; a bad line before it is named (it
    was dropped without a word, and its steps were missing from the plots)."""
    from tandem.trainer.report_runs import ReportError, read_run

    records = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(records) + '\n{"step": 4, "lo')
    assert list(read_run(str(tmp_path)).steps) == [1, 2, 3]
    (tmp_path / "metrics.jsonl").write_text("\n".join([records[0], "garbage", *records[1:]]))
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not a JSON record"):
        read_run(str(tmp_path))


def test_a_run_whose_last_step_was_skipped_reports(tmp_path):
    """A step the bad-step guard skipped logs its losses as null: a run whose newest record is one
    (a live run, or one that ended there) reports, its summary giving the last loss logged. It
    failed with a TypeError traceback."""
    from tandem.trainer.report import report_main

    records = [{"step": 1, "loss": 2.0, "loss/main": 2.0},
               {"step": 2, "loss": 1.5, "loss/main": 1.5},
               {"step": 3, "loss": None, "loss/main": None, "skipped": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report_main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    assert "1.5000" in (tmp_path / "report" / "report.html").read_text()


def test_a_non_finite_figure_from_another_writer_reads_as_missing(tmp_path):
    """Tandem writes a non-finite figure as null; a metrics.jsonl from another writer (a wandb
    export) may hold NaN. Its last evaluation read NaN [NaN, NaN] and hid the run's finite one
    before it; it now reads as missing, as null does."""
    from tandem.trainer.report_runs import read_run
    from tandem.trainer.report_stats import final_rows

    key = "eval/acceptance_length"
    lines = [json.dumps({"step": 10, key: 2.5, f"{key}_lo95": 2.25, f"{key}_hi95": 2.75}),
             '{"step": 20, "%s": NaN, "%s_lo95": NaN, "%s_hi95": NaN}' % (key, key, key)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = read_run(str(tmp_path))
    assert run.series(key) == ([10], [2.5]) and list(run.steps) == [10, 20]
    (row,) = final_rows([run], [key])
    assert (row.step, row.value, row.lo, row.hi) == (10, 2.5, 2.25, 2.75)


def test_a_run_reads_as_columns_of_numbers():
    """metrics.jsonl is held as one column of numbers per key: a key's series skips the records
    without a number under it (absent, null, a string), `aligned` keeps the records that have all
    its keys, and the last record stays whole."""
    from tandem.trainer.report_runs import Run

    records = [{"step": 1, "loss": 3.0, "path": "grouped_mm"},
               {"step": 2, "loss": None, "eval/a": 2.0, "eval/a_lo95": 1.5},
               {"step": 4, "loss": 2.0, "eval/a": 2.5, "eval/a_lo95": 2.25, "skipped": True},
               {"step": 5, "eval/a": 2.75, "eval/a_lo95": 2.5, "samples": [1, 2]}]
    run = Run.from_records("r", "dir", iter(records))
    assert list(run.steps) == [1, 2, 4, 5]
    assert run.series("loss") == ([1, 4], [3.0, 2.0]) and run.series("path") == ([], [])
    assert run.series("skipped") == ([4], [1.0])
    assert run.aligned("loss", "eval/a") == ([4], [[2.0], [2.5]])
    assert run.aligned("eval/a", "eval/a_lo95") == ([2, 4, 5], [[2.0, 2.5, 2.75], [1.5, 2.25, 2.5]])
    assert run.last == records[-1] and "samples" not in run.keys()
