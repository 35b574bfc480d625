"""MTP fine-tuning's host memory without an environment variable (issue 20, item 10): the trainer
fixes glibc's mmap threshold itself when it fine-tunes a checkpoint (model.init_from), so freed read
and all-gather buffers go back to the system instead of staying in the heap."""

import os
import subprocess
import sys
import textwrap

import pytest

from tandem.trainer import run
from tandem.trainer.parallel import device as device_layer
from tandem.trainer.recipe import load_config


class _Stop(Exception):
    pass


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


@pytest.mark.parametrize("overrides,expected", [
    (["model.init_from=/ckpt/glm"], [65536]),  # fine-tuning: fixed by default
    ([], []),  # pretraining keeps glibc's default (a fixed threshold costs page faults every step)
    (["model.init_from=/ckpt/glm", "train.malloc_mmap_threshold=0"], []),
    (["train.malloc_mmap_threshold=1048576"], [1048576]),
])
def test_trainer_sets_the_threshold_at_start_up(monkeypatch, tmp_path, overrides, expected):
    calls = []

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(run, "set_malloc_mmap_threshold", lambda n: calls.append(n) or True)
    monkeypatch.setattr(run, "resolve_init_from", stop)  # before any checkpoint or model work
    monkeypatch.setattr(run, "resolve_device", stop)
    cfg = load_config(None, [f"run.dir={tmp_path}", "logging.wandb=false", *overrides])
    with pytest.raises(_Stop):
        run.build_run(cfg)
    assert calls == expected


def test_user_setting_and_other_platforms_win(monkeypatch):
    import ctypes

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    # M_MMAP_THRESHOLD
    assert device_layer.set_malloc_mmap_threshold(65536) and calls == [(-3, 65536)]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # glibc applied the user's own at start
    assert not device_layer.set_malloc_mmap_threshold(65536) and len(calls) == 1
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")

    def not_glibc(name):
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(os, "confstr", not_glibc)
    assert not device_layer.set_malloc_mmap_threshold(65536) and len(calls) == 1


@pytest.mark.skipif(not _glibc(), reason="glibc only")
def test_fixed_threshold_returns_freed_blocks():
    """In a fresh process: 1 MiB blocks allocated, touched and freed 32 times. glibc's dynamic
    threshold rises past 1 MiB at the first free and serves the rest from the heap (few page
    faults); fixed at 64 KiB, every block is mmapped and unmapped (its pages faulted in each
    time)."""
    script = textwrap.dedent("""
        import ctypes, resource, sys
        from tandem.trainer.parallel.device import set_malloc_mmap_threshold
        if sys.argv[1] == "fixed":
            assert set_malloc_mmap_threshold(65536)
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(32):
            p = libc.malloc(1 << 20)
            ctypes.memset(p, 1, 1 << 20)
            libc.free(p)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    faults = {mode: int(subprocess.run([sys.executable, "-c", script, mode], env=env,
                                       capture_output=True, text=True,
                                       check=True, timeout=120).stdout) for mode in ("default",
                                                                                     "fixed")}
    assert faults["fixed"] >= 31 * 256 > 8 * faults["default"], faults  # 256 4-KiB pages per block
