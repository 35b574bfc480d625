"""`tandem report RUN_DIR [RUN_DIR ...]`: plots of one or more runs, as PNGs and one HTML page.

Each run directory is read as training wrote it: `metrics.jsonl` (the series) and `config.yaml`
(what the run was: K, L, the MTP objective and lambda schedule, the layout). Several runs are
overlaid on the same axes, so objectives, lambda schedules and K can be compared side by side.

Figures (one PNG each, and inline SVG in `report.html`, which needs no other file):
* `losses.png`: one panel per depth (main head, then MTP depth 1..K), training loss solid and the
  evaluator's held-out loss dashed, one colour per run; the training loss is drawn as its EMA
  (`--ema-span N` logged records, report_stats.ema) over the raw points, kept faint;
* `acceptance.png`: acceptance length over training, one line per run and decoding variant
  (greedy, and each sampled temperature the evaluator logged), its 95% interval
  (`<key>_lo95`/`<key>_hi95`, eval/acceptance.py) as a band and a star on each evaluation whose
  interval does not overlap the previous one's;
* `accept_rate_by_position.png`: one panel per draft position k, the rate at which position k was
  accepted, same lines, bands and stars as above;
* `decode_throughput.png`: speculative vs autoregressive decode tokens/s, and the measured speedup
  against the one the per-round timings predict.

The page also holds the final figures of every run with their intervals and, when runs are overlaid,
which differences are significant (report_stats: a normal test on the difference, each run's
standard error read from its interval's half-width), also printed on stdout above the page's path.

Variants are read from the key names: `eval/acceptance_length` and `eval/accept_rate/pos_k` are the
evaluator's greedy decoding; a key with an extra segment before the leaf
(`eval/<variant>/acceptance_length`, `eval/<variant>/accept_rate/pos_k`) is one more variant,
labelled by that segment (the evaluator writes `T<t>` for each sampled temperature in
`eval.temperatures`: `eval/T1/acceptance_length`). Every line carries `run|key` as matplotlib `gid`
(`run|key|ema`, `run|key|band`, `run|key|shift` for the EMA, band and stars), which the SVG keeps as
the element's id, so a test (or a notebook) can find the series a figure holds.
"""

from __future__ import annotations

import argparse
import html
import io
import os
import re
import sys
from typing import Dict, List, Sequence

from .files import write_replacing
from .report_runs import ReportError, Run, read_run
from .report_stats import compare_runs, ema, final_rows, html_tables, interval, shifts, text_table

# a variant is a temperature (`T1`), optionally with the other verification rule (`T1/block`)
POS_RE = re.compile(
    r"^eval/(?:(?P<variant>[^/]+(?:/(?:token|block))?)/)?accept_rate/pos_(?P<k>\d+)$"
)
ACC_RE = re.compile(r"^eval/(?:(?P<variant>[^/]+(?:/(?:token|block))?)/)?acceptance_length$")
LOSS_RE = re.compile(r"^(?P<prefix>eval/)?loss/(?P<depth>main|mtp_(?P<k>\d+))$")


DEFAULT_EMA_SPAN = 10
"""`--ema-span` default: records (logged steps) in the EMA of the training curves."""


def _variants(run: Run, pattern: re.Pattern) -> Dict[str, List[str]]:
    """variant label -> keys of `run` matching `pattern` (variant None = the main setting)."""
    out: Dict[str, List[str]] = {}
    for key in run.keys():
        m = pattern.match(key)
        if m:
            out.setdefault(m.group("variant") or run.main_variant(), []).append(key)
    return out


def _colors(n: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _plot(ax, run: Run, key: str, label: str, color, style: str = "-") -> bool:
    steps, values = run.series(key)
    if not steps:
        return False
    marker = "o" if len(steps) <= 12 else None
    ax.plot(steps, values, style, color=color, label=label, gid=f"{run.label}|{key}", marker=marker,
            markersize=3)
    return True


def _plot_train(ax, run: Run, key: str, label: str, color, span: int) -> bool:
    """A training curve: the logged points faint (gid `label|key`), their EMA (`--ema-span`) drawn
    over them (gid `label|key|ema`), so per-step noise does not hide the trend nor the trend the
    data."""
    steps, values = run.series(key)
    if not steps:
        return False
    if span <= 1:
        return _plot(ax, run, key, label, color)
    ax.plot(steps, values, "-", color=color, alpha=0.25, lw=0.8, gid=f"{run.label}|{key}")
    ax.plot(steps, ema(values, span), "-", color=color, label=f"{label} (EMA {span})",
            gid=f"{run.label}|{key}|ema")
    return True


def _plot_eval(ax, run: Run, key: str, label: str, color, style: str = "-") -> bool:
    """An evaluator series: its line, its 95% interval as a band (gid `label|key|band`) and a star
    on each evaluation whose interval does not overlap the previous one's (gid
    `label|key|shift`)."""
    if not _plot(ax, run, key, label, color, style):
        return False
    steps, _, lo, hi = interval(run, key)
    if steps:
        ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0, gid=f"{run.label}|{key}|band")
        moved = shifts(lo, hi)
        if moved:
            by_step = dict(zip(*run.series(key)))
            ax.plot([steps[i] for i in moved], [by_step[steps[i]] for i in moved], "*", color=color,
                    markersize=10,
                    markeredgecolor="black", markeredgewidth=0.5, gid=f"{run.label}|{key}|shift")
    return True


def loss_figure(runs: Sequence[Run], ema_span: int = 0):
    import matplotlib.pyplot as plt

    depths = sorted({m.group("depth") for r in runs for k in r.keys() if (m := LOSS_RE.match(k))},
                    key=lambda d: -1 if d == "main" else int(d.split("_")[1]))
    if not depths:
        return None
    fig, axes = plt.subplots(1, len(depths), figsize=(4 * len(depths), 3.4), squeeze=False,
                             sharey=True)
    for ax, depth in zip(axes[0], depths):
        for run, color in zip(runs, _colors(len(runs))):
            _plot_train(ax, run, f"loss/{depth}",
                        f"{run.label} train{_objective_note(run, depth)}", color, ema_span)
            _plot(ax, run, f"eval/loss/{depth}", f"{run.label} held-out", color, "--")
        ax.set_title("main head" if depth == "main" else f"MTP depth {depth.split('_')[1]}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    other = any(_objective_note(run, d) for run in runs for d in depths)
    axes[0][0].set_ylabel("nats (held-out: cross-entropy)" if other else "cross-entropy (nats)")
    _legend(axes[0])
    fig.tight_layout()
    return fig


def _legend(axes) -> None:
    """One legend for a row of panels: a run may be missing from some (a K=1 run has no depth 2)."""
    entries: Dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    axes[0].legend(list(entries.values()), list(entries), fontsize=7)


def _variant_lines(runs: Sequence[Run], pattern: re.Pattern):
    """[(run, variant, keys, color, linestyle)]: colour per run, line style per variant."""
    styles = ["-", "--", ":", "-."]
    order: Dict[str, int] = {}
    out = []
    for run, color in zip(runs, _colors(len(runs))):
        for variant, keys in _variants(run, pattern).items():
            style = styles[order.setdefault(variant, len(order)) % len(styles)]
            out.append((run, variant, keys, color, style))
    return out


def acceptance_figure(runs: Sequence[Run]):
    import matplotlib.pyplot as plt

    lines = _variant_lines(runs, ACC_RE)
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for run, variant, keys, color, style in lines:
        _plot_eval(ax, run, keys[0], f"{run.label} {variant}", color, style)
    ax.set_xlabel("step")
    ax.set_ylabel("acceptance length (tokens / verify)")
    ax.set_title("speculative decoding: acceptance length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def position_figure(runs: Sequence[Run]):
    import matplotlib.pyplot as plt

    lines = _variant_lines(runs, POS_RE)
    positions = sorted({int(POS_RE.match(k).group("k")) for _, _, keys, _,
                        _ in lines for k in keys})
    if not positions:
        return None
    fig, axes = plt.subplots(1, len(positions), figsize=(4 * len(positions), 3.4), squeeze=False,
                             sharey=True)
    for ax, k in zip(axes[0], positions):
        for run, variant, keys, color, style in lines:
            for key in keys:
                if int(POS_RE.match(key).group("k")) == k:
                    _plot_eval(ax, run, key, f"{run.label} {variant}", color, style)
        ax.set_title(f"draft position {k}")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accepted fraction")
    _legend(axes[0])
    fig.tight_layout()
    return fig


def throughput_figure(runs: Sequence[Run]):
    import matplotlib.pyplot as plt

    if not any("eval/decode_tokens_per_s/spec" in r.keys() for r in runs):
        return None
    fig, (ax_tps, ax_speed) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, color in zip(runs, _colors(len(runs))):
        _plot(ax_tps, run, "eval/decode_tokens_per_s/spec", f"{run.label} speculative", color)
        _plot(ax_tps, run, "eval/decode_tokens_per_s/ar", f"{run.label} autoregressive", color,
              "--")
        _plot(ax_speed, run, "eval/speedup", f"{run.label} measured", color)
        _plot(ax_speed, run, "eval/speedup_predicted", f"{run.label} predicted", color, ":")
    ax_tps.set_ylabel("decode tokens/s")
    ax_tps.set_title("speculative vs autoregressive decoding")
    ax_speed.set_ylabel("speedup over autoregressive")
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_speed.set_title("speedup: measured vs predicted")
    for ax in (ax_tps, ax_speed):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


FIGURES = (("losses", loss_figure), ("acceptance", acceptance_figure),
           ("accept_rate_by_position", position_figure), ("decode_throughput", throughput_figure))


def make_figures(runs: Sequence[Run], ema_span: int = DEFAULT_EMA_SPAN) -> Dict[str, object]:
    """name -> matplotlib Figure, for every figure the runs have data for (training curves smoothed
    by an EMA of span `ema_span`; <= 1: raw)."""
    import matplotlib

    matplotlib.use("Agg")
    figures = {}
    for name, build in FIGURES:
        fig = build(runs, ema_span) if build is loss_figure else build(runs)
        if fig is not None:
            figures[name] = fig
    return figures


def _objective_note(run: Run, depth: str) -> str:
    """How an MTP depth's training loss differs from the held-out cross-entropy drawn beside it
    ('' when it is cross-entropy on the data)."""
    if depth == "main":
        return ""
    mtp = run.config.get("mtp", {})
    loss_cfg = mtp.get("loss", {}) if isinstance(mtp.get("loss"), dict) else {}
    if loss_cfg.get("objective", "ce") != "ce":
        return f" ({loss_cfg['objective']} loss)"
    distill = run.config.get("train", {}).get("distill", "none")
    return f" ({distill} distillation)" if distill not in ("none", None) else ""


def _lambda_schedule(loss_cfg: dict) -> str:
    """`mtp.loss.lambda` and its `lambda_after` milestones: `0.3 -> 0.1 @250`."""
    after = loss_cfg.get("lambda_after") or {}
    return str(loss_cfg.get("lambda", "")) + "".join(
        f" -> {after[k]} @{k}" for k in sorted(after, key=int))


def _summary_rows(runs: Sequence[Run]) -> List[List[str]]:
    rows = []
    for run in runs:
        mtp = run.config.get("mtp", {})
        loss_cfg = mtp.get("loss", {}) if isinstance(mtp.get("loss"), dict) else {}
        last = run.last
        accept, loss = run.series("eval/acceptance_length")[1], run.series("loss/main")[1]
        rows.append([run.label, run.path, str(mtp.get("num_steps", "")),
                     str(mtp.get("num_layers", "")),
                     str(loss_cfg.get("objective", "ce")), _lambda_schedule(loss_cfg),
                     # (a step the guard skipped logs null: the last value logged)
                     str(last["step"]), f"{loss[-1]:.4f}" if loss else "",
                     f"{accept[-1]:.3f}" if accept else "not evaluated"])
    return rows


def _inline_svg(fig) -> str:
    """The figure as inline SVG: vector, self-contained, and each series findable by its gid (the
    `<g id="run|key|band">` of an interval band), which a PNG cannot show a test or a reader's
    search."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # the XML prolog and doctype are not allowed inside HTML


def final_keys(runs: Sequence[Run]) -> List[str]:
    """The figures of the final-figures table: acceptance length of every variant, then the greedy
    draft acceptance rate."""
    keys = {k: None for r in runs for k in r.keys() if ACC_RE.match(k)}
    return sorted(keys,
                  key=lambda k: (k != "eval/acceptance_length", k)) + ["eval/draft_acceptance_rate"]


def _shift_list(runs: Sequence[Run]) -> str:
    """HTML list of the evaluations whose interval does not overlap the previous one's."""
    items = []
    for run in runs:
        for key in [k for k in run.keys() if ACC_RE.match(k)]:
            steps, values, lo, hi = interval(run, key)
            for i in shifts(lo, hi):
                items.append(f"<li>{html.escape(run.label)} {html.escape(key)}: step "
                             f"{steps[i - 1]} "
                             f"{values[i - 1]:.3f} [{lo[i - 1]:.3f}, {hi[i - 1]:.3f}] &rarr; step "
                             f"{steps[i]} "
                             f"{values[i]:.3f} [{lo[i]:.3f}, {hi[i]:.3f}]</li>")
    if not items:
        return ""
    return ("<h2>evaluations that moved</h2>\n<p>Acceptance whose 95% interval does not overlap "
            "the previous "
            "evaluation's (starred in the figures).</p>\n<ul>\n" + "\n".join(items) + "\n</ul>")


def _summary_table(runs: Sequence[Run]) -> str:
    header = ["run", "directory", "K", "L", "objective", "lambda", "last step", "loss/main",
              "acceptance length"]
    return "<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>\n" + "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for row in _summary_rows(runs))


def write_report(runs: Sequence[Run], out_dir: str, ema_span: int = DEFAULT_EMA_SPAN) -> Dict[str,
                                                                                              str]:
    """Write one PNG per figure and `report.html` (figures inline as SVG, the final figures and
    their significance, the evaluations that moved) into `out_dir`; return name -> path, plus
    "table": the final-figures text `tandem report` prints."""
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    figures = make_figures(runs, ema_span)
    paths, sections = {}, []
    for name, fig in figures.items():
        path = os.path.join(out_dir, f"{name}.png")
        write_replacing(path, lambda f, fig=fig: fig.savefig(f, format="png", dpi=110),
                        binary=True)
        sections.append(f'<h2>{html.escape(name.replace("_", " "))}</h2>\n'
                        '<div class="figure" '
                        f'id="figure-{html.escape(name)}">{_inline_svg(fig)}</div>')
        plt.close(fig)
        paths[name] = path
    if not any(name != "losses" for name in figures):
        sections.append("<p>No evaluator records: these runs had <code>eval.interval=0</code> or "
                        "no MTP module.</p>")
    finals = final_rows(runs, final_keys(runs))
    diffs = compare_runs(runs, final_keys(runs))
    tables = html_tables(finals, diffs, html.escape)
    page = (
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>Tandem report</title>\n"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px "
        "8px}svg{max-width:100%;height:auto}</style></head><body>\n"
        f"<h1>Tandem report: {html.escape(', '.join(r.label for r in runs))}</h1>\n"
        f"<table>\n{_summary_table(runs)}\n</table>\n" + (tables
                                                          or "") + "\n" + _shift_list(runs) + "\n"
        + "\n".join(sections) + "\n</body></html>\n")
    html_path = os.path.join(out_dir, "report.html")
    write_replacing(html_path, lambda f: f.write(page))
    paths["html"] = html_path
    paths["table"] = text_table(finals, diffs) if finals else ""
    return paths


def _check_args(args, labels: list, out: str) -> None:
    """ReportError in one line naming the flag, before any run is read: a --labels count that is
    not the runs', a negative --ema-span, an output directory that is a file or under one."""
    if len(labels) != len(args.run_dirs):
        raise ReportError(f"--labels has {len(labels)} entries for {len(args.run_dirs)} run "
                          "directories")
    if args.ema_span < 0:
        raise ReportError(f"--ema-span {args.ema_span} must be >= 0 (0 or 1: raw points)")
    blocker = os.path.abspath(out)
    while not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if not os.path.isdir(blocker):
        where = "is" if blocker == os.path.abspath(out) else f"is under {blocker},"
        raise ReportError(f"--out {out} {where} a file, not a directory; pass another --out")


def report_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem report",
                                     description="Plot one or more runs (overlaid) as PNGs and one "
                                                 "self-contained HTML "
                                                 "page.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out",
                        help="output directory (default: RUN_DIR/report for one run, ./report for "
                             "several)")
    parser.add_argument(
        "--labels", help="comma-separated legend labels, one per run (default: directory names)"
    )
    parser.add_argument("--ema-span", type=int, default=DEFAULT_EMA_SPAN,
                        help="span (in logged records) of the EMA drawn over the training curves, "
                             "raw points "
                             f"kept faint; 1 or 0 draws them raw (default {DEFAULT_EMA_SPAN})")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [None] * len(args.run_dirs)
    out = args.out or (os.path.join(args.run_dirs[0], "report") if len(args.run_dirs) == 1
                       else "report")
    try:
        _check_args(args, labels, out)
        runs = [read_run(path, label) for path, label in zip(args.run_dirs, labels)]
        seen: Dict[str, int] = {}
        for run in runs:  # two runs named alike (…/a/run, …/b/run) still get their own legend entry
            n = seen[run.label] = seen.get(run.label, 0) + 1
            if n > 1:
                run.label = f"{run.label}#{n}"
        paths = write_report(runs, out, args.ema_span)
    except (ReportError, OSError) as exc:
        print(f"tandem report: error: {exc}", file=sys.stderr)
        return 2
    if paths["table"]:
        print(paths["table"])
    print(paths["html"])
    return 0
