"""A checkpoint that cannot be written (a full disk): one OSError line naming the file or the
checkpoint's directory, and the complete checkpoints kept as they were."""

import builtins
import contextlib
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import types

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from tandem.trainer import checkpoint as ckpt

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _model():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def full_disk_for(monkeypatch, suffix):
    """Every file opened for writing whose path ends in `suffix` fails at its first write, as a
    full disk's does: ENOSPC without a file name."""
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opener(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax") and str(file).endswith(suffix):
            return Full(f)
        return f

    monkeypatch.setattr(builtins, "open", opener)


def _full_shards(monkeypatch):
    """DCP's shard files fail to open, as on a full disk."""
    real = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


def test_a_failed_shard_write_is_one_line_naming_the_checkpoint_kept(tmp_path, monkeypatch):
    """torch's CheckpointException is a BaseException: `tandem train` printed a traceback per rank
    instead of its one error line."""
    model, optimizer = _model()
    writer = ckpt.CheckpointWriter(str(tmp_path))
    kept = writer.save(1, model, optimizer, "a: 1\n", {})
    _full_shards(monkeypatch)
    with pytest.raises(OSError) as info:
        writer.save(2, model, optimizer, "a: 1\n", {})
    line = str(info.value)
    assert "\n" not in line
    assert f"the checkpoint of step 2 could not be written into {tmp_path}/checkpoints/.tmp_step_2"\
           ": rank 0: [Errno 28] No space left on device" in line, line
    assert line.endswith(f"the newest complete checkpoint, {kept}, is kept"), line
    assert ckpt.list_checkpoints(str(tmp_path))[0] == [(1, kept)]


def test_a_failed_background_save_names_its_step_at_the_next_save(tmp_path, monkeypatch):
    model, optimizer = _model()
    writer = ckpt.CheckpointWriter(str(tmp_path), async_save=True)
    writer.save(1, model, optimizer, "a: 1\n", {})
    writer.finish()
    _full_shards(monkeypatch)
    writer.save(2, model, optimizer, "a: 1\n", {})
    with pytest.raises(OSError) as info:
        writer.save(3, model, optimizer, "a: 1\n", {})
    line = str(info.value)
    assert line.startswith("the checkpoint of step 2 could not be written (in the background; "
                           "this is the next save) into "), line
    assert "rank 0: [Errno 28] No space left on device" in line
    assert line.endswith("step_1, is kept"), line


@contextlib.contextmanager
def file_size_limit():
    """Files of this process may not grow past 16 bytes inside the block (writes past it fail with
    EFBIG, as a full disk's with ENOSPC). Only around the write under test: pytest reports a test's
    result before its fixtures end, and under `-n 0` with its output sent to a file that report
    failed with EFBIG and stopped the session."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_failed_rng_state_write_names_the_file(tmp_path):
    """torch.save's own writer reported it as `[enforce fail at inline_container.cc:672] .
    unexpected pos 64 vs 0`."""
    model, optimizer = _model()
    writer = ckpt.CheckpointWriter(str(tmp_path))
    with pytest.raises(OSError) as info, file_size_limit():
        writer.save(1, model, optimizer, "a: 1\n", {})
    assert info.value.errno == errno.EFBIG
    assert info.value.filename == f"{tmp_path}/checkpoints/.tmp_step_1/rng/rank0.pt"


@pytest.mark.parametrize("name", ["trainer_state.json", "config.yaml", "COMPLETE"])
def test_a_failed_metadata_write_names_the_file(tmp_path, monkeypatch, name):
    model, optimizer = _model()
    full_disk_for(monkeypatch, name)
    with pytest.raises(OSError) as info:
        ckpt.save_checkpoint(str(tmp_path), 1, model, optimizer, "a: 1\n", {})
    assert info.value.filename == f"{tmp_path}/checkpoints/.tmp_step_1/{name}"
    assert ckpt.list_checkpoints(str(tmp_path))[0] == []


def test_a_non_ascii_config_is_written_as_utf8_under_an_ascii_locale(tmp_path):
    """A recipe with a non-ASCII value (a wandb group in French) failed every checkpoint of a job
    whose locale is ASCII: config.yaml was written in the locale's encoding."""
    code = ("import sys, torch; from tandem.trainer import checkpoint as ckpt; "
            "m = torch.nn.Linear(2, 2); "
            "ckpt.save_checkpoint(sys.argv[1], 1, m, torch.optim.SGD(m.parameters()), "
            "'logging:\\n  group: \\u00e9tude\\n', {})")
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = tmp_path / "checkpoints" / "step_1" / "config.yaml"
    assert written.read_bytes() == "logging:\n  group: \u00e9tude\n".encode("utf-8")


def test_an_empty_marker_is_not_complete(tmp_path):
    """A marker whose write failed (opened, nothing written) marked the checkpoint complete."""
    model, optimizer = _model()
    final = ckpt.save_checkpoint(str(tmp_path), 1, model, optimizer, "a: 1\n", {})
    with open(os.path.join(final, ckpt.MARKER)) as f:
        assert f.read() == "1\n"  # what every save has written: such checkpoints stay complete
    open(os.path.join(final, ckpt.MARKER), "w").close()
    assert ckpt.list_checkpoints(str(tmp_path)) == ([], [final])
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resolve_checkpoint(final)


def test_the_side_files_are_on_disk_before_the_marker(tmp_path, monkeypatch):
    """The config, trainer state and tokenizer were written without a sync before the synced
    marker: after a power loss a checkpoint marked complete could hold them empty."""
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text("{}")
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    model, optimizer = _model()
    run_tokenizer = types.SimpleNamespace(path=str(tokenizer), eod_token=None)
    writer = ckpt.CheckpointWriter(str(tmp_path / "run"), tokenizer=run_tokenizer)
    writer.save(1, model, optimizer, "a: 1\n", {})
    before_marker = synced[:synced.index(ckpt.MARKER)]
    for name in ("config.yaml", "trainer_state.json", "tokenizer.json", "rank0.pt"):
        assert name in before_marker, synced


def test_an_unfinished_save_that_cannot_be_removed_is_left_with_a_note(tmp_path, monkeypatch,
                                                                       capsys):
    """Removing a failed save's directory is housekeeping: a file system that refuses (NFS's .nfs
    files of a shard a dead rank held open) must not refuse the resume."""
    from tandem.trainer import checkpoint_dirs

    unfinished = tmp_path / "checkpoints" / ".tmp_step_3"
    unfinished.mkdir(parents=True)

    def busy(path, *args, **kwargs):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)

    monkeypatch.setattr(checkpoint_dirs.shutil, "rmtree", busy)
    checkpoint_dirs.remove_unfinished_saves(str(tmp_path))
    assert "could not remove the unfinished save" in capsys.readouterr().err
    assert unfinished.exists()


def test_a_prune_cut_short_leaves_no_half_deleted_step(tmp_path, monkeypatch, capsys):
    """keep_last's pruning renames an old checkpoint out of the steps before removing it: a removal
    cut short (a kill, a file the file system will not delete) used to leave a `step_<N>` without
    its marker that every resume listed as incomplete and nothing removed. What it leaves now is
    `.pruned_step_<N>`, which the next launch removes."""
    from tandem.trainer import checkpoint_dirs

    model, optimizer = _model()
    writer = ckpt.CheckpointWriter(str(tmp_path), keep_last=1)
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(checkpoint_dirs.shutil, "rmtree", lambda path, **kw: None)  # cut short
    writer.save(1, model, optimizer, "a: 1\n", {})
    writer.save(2, model, optimizer, "a: 1\n", {})
    complete, others = ckpt.list_checkpoints(str(tmp_path))
    assert [s for s, _ in complete] == [2]
    assert [os.path.basename(p) for p in others] == [".pruned_step_1"]
    monkeypatch.setattr(checkpoint_dirs.shutil, "rmtree", real_rmtree)
    checkpoint_dirs.remove_unfinished_saves(str(tmp_path))
    assert ckpt.list_checkpoints(str(tmp_path))[1] == []
    assert ".pruned_step_1" in capsys.readouterr().err
