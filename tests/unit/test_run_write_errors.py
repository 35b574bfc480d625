"""A run's own files that cannot be written (a full disk): the error names the file, so `tandem
train`'s one error line does (it said only `[Errno 28] No space left on device`)."""

import errno

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
