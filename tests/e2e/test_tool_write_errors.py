"""Tools whose output cannot be written (a full disk, a failed rename) or whose run holds a torn
config: one error line naming the file, no traceback, and an earlier output kept. The cases run the
`tandem` CLI in-process against a copy of one tiny 2-step run (test_bad_input.py's fixtures)."""

import errno
import glob
import json
import os

import pytest

from tandem.trainer.cli import main
from tests.e2e import test_bad_input
from tests.unit.test_checkpoint_write_errors import full_disk_for

earlier_run, ctx = test_bad_input.earlier_run, test_bad_input.ctx  # the fixtures, used here
snapshot = test_bad_input.snapshot


def _last_error(capsys, rc):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err, (rc, err)
    assert "Traceback" not in "\n".join(err), err
    return err[-1]


@pytest.fixture
def earlier_export(ctx, tmp_path, capsys):
    out = str(tmp_path / "exp")
    assert main(["export", "--checkpoint", ctx.run, "--out", out]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return out, snapshot(out)


def test_export_onto_a_full_disk(ctx, earlier_export, monkeypatch, capsys):
    out, before = earlier_export
    full_disk_for(monkeypatch, "config.json")
    line = _last_error(capsys, main(["export", "--checkpoint", ctx.run, "--out", out,
                                     "--overwrite"]))
    assert line == f"tandem export: error: [Errno 28] No space left on device: '{out}'"
    assert snapshot(out) == before
    assert glob.glob(os.path.join(os.path.dirname(out), ".tmp_export_*")) == []


def test_export_whose_rename_fails_puts_the_earlier_export_back(ctx, earlier_export, monkeypatch,
                                                                 capsys):
    """The earlier export was left in .tmp_export_*.old and --out was gone."""
    out, before = earlier_export
    rename = os.rename

    def failing(src, dst):
        if os.path.basename(src).startswith(".tmp_export_") and not src.endswith(".old"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    line = _last_error(capsys, main(["export", "--checkpoint", ctx.run, "--out", out,
                                     "--overwrite"]))
    assert line == (f"tandem export: error: [Errno 5] could not rename the new export into {out} "
                    "(Input/output error); the earlier export is back in place")
    assert snapshot(out) == before
    assert glob.glob(os.path.join(os.path.dirname(out), ".tmp_export_*")) == []


def test_generate_onto_a_full_disk(ctx, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "def f(x):\n"}) + "\n")
    out = str(tmp_path / "g.jsonl")
    full_disk_for(monkeypatch, "g.jsonl")
    line = _last_error(capsys, main(["generate", "--checkpoint", ctx.run, "--prompts",
                                     str(prompts), "--out", out, "--max-new-tokens", "3"]))
    assert line == (f"tandem generate: error: [Errno 28] No space left on device: '{out}'; run it "
                    "again to resume")


def test_report_onto_a_full_disk(ctx, tmp_path, monkeypatch, capsys):
    """A figure that fails part-way leaves the earlier report's file whole (it was truncated in
    place); figures written before it are the new report's (each file is replaced whole, not the
    report as one)."""
    out = str(tmp_path / "rep")
    assert main(["report", ctx.run, "--out", out]) == 0, capsys.readouterr().err
    before = snapshot(out)
    full_disk_for(monkeypatch, ".png.tmp")
    line = _last_error(capsys, main(["report", ctx.run, "--out", out]))
    assert line == f"tandem report: error: [Errno 28] No space left on device: '{out}/losses.png'"
    assert snapshot(out) == before  # ... and no temporary left beside it


def test_report_of_a_run_with_a_torn_config(ctx, tmp_path):
    config = os.path.join(ctx.run, "config.yaml")
    with open(config, "w") as f:
        f.write("model: [\n")
    ctx.before = snapshot(ctx.run)
    line = ctx.fails(["report", ctx.run, "--out", str(tmp_path / "rep")],
                     f"tandem report: error: {config} is not valid YAML: ")
    assert "line 2" in line
