"""A run's own files that cannot be written (a full disk): the error names the file, so `tandem
train`'s one error line does (it said only `[Errno 28] No space left on device`)."""

import errno
import os

import pytest

from tandem.trainer import run as run_module
from tandem.trainer.metrics import MetricsLogger
from tandem.trainer.recipe import load_config
from tests.unit.test_checkpoint_write_errors import full_disk_for


def test_config_yaml(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("earlier: 1\n")
    full_disk_for(monkeypatch, "config.yaml.tmp")
    with pytest.raises(OSError) as info:
        run_module.write_config(str(tmp_path), "a: 1\n")
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(tmp_path / "config.yaml"))
    assert (tmp_path / "config.yaml").read_text() == "earlier: 1\n"
    assert not (tmp_path / "config.yaml.tmp").exists()


def test_run_lock(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, ".tandem.lock")
    with pytest.raises(OSError) as info:
        run_module.lock_run_dir(str(tmp_path))
    assert info.value.filename == str(tmp_path / ".tandem.lock")


def test_metrics_jsonl(tmp_path, monkeypatch):
    cfg = load_config(None, [f"run.dir={tmp_path}", "logging.wandb=false",
                             "logging.progress=false"])
    full_disk_for(monkeypatch, "metrics.jsonl")
    log = MetricsLogger(cfg, True, 0, 10)
    with pytest.raises(OSError) as info:
        log.log({"step": 1, "loss": 1.0})
    assert info.value.filename == str(tmp_path / "metrics.jsonl")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_still_names_metrics_jsonl_after_the_loop_closes_it(tmp_path):
    """A real ENOSPC (/dev/full) in a record's write, then the loop's `finally: logger.close()`:
    the error that reaches `tandem train` names metrics.jsonl. The line-buffered file kept the
    refused record and failed again, nameless, on close, replacing the named error."""
    cfg = load_config(None, [f"run.dir={tmp_path}", "logging.wandb=false",
                             "logging.progress=false"])
    log = MetricsLogger(cfg, True, 0, 10)
    log.file.close()
    log.file = log._open("/dev/full")
    with pytest.raises(OSError) as info:
        try:
            log.log({"step": 1, "loss": 1.0})
        finally:
            log.close()
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC,
                                                       str(tmp_path / "metrics.jsonl"))


def test_the_progress_bar_is_not_redrawn_each_step_into_a_log(tmp_path, capsys):
    """Into a file (a Slurm log; here pytest's capture, not a terminal) the bar redraws at most
    once a minute: it redrew every step, ~120 bytes each on one endless line. The last step's
    figures still reach the log when the bar closes."""
    cfg = load_config(None, [f"run.dir={tmp_path}", "logging.wandb=false",
                             "logging.progress=true"])
    log = MetricsLogger(cfg, True, 0, 500)
    for step in range(1, 501):
        log.progress(step, {"loss": 1.0 + 1 / step, "loss/main": 1.0})
    log.close()
    err = capsys.readouterr().err
    assert err.count("\r") <= 3 and "500/500" in err and "loss=1.002" in err, err[-400:]
