"""A shared launch that loses a rank to a signal runs its unfinished jobs once more in a fresh
launch (shared_launch.relaunch_after_a_crash); a job that fails, or crashes again, still fails its
tests."""

import subprocess

import pytest

from tests.distributed import shared_launch
from tests.distributed.shared_launch import check, launch, relaunch_after_a_crash

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = "tests.distributed.crash_worker"


def runs(directory, rank: int) -> int:
    return len((directory / f"runs.rank{rank}").read_text().splitlines())


def test_a_crashed_launch_reruns_only_its_unfinished_jobs_once(tmp_path):
    steady, crash_once, crash = (tmp_path / name for name in ("steady", "crash_once", "crash"))
    jobs = [(steady, WORKER, ["steady"]), (crash_once, WORKER, ["crash_once"]),
            (crash, WORKER, ["crash"])]
    first = launch(2, jobs, tmp_path)
    assert first.returncode != 0 and "exitcode  : -11" in first.stdout, first.stdout[-3000:]
    check(steady, WORKER, 2, first)
    with pytest.raises(AssertionError, match="Fatal Python error: Segmentation fault"):
        check(crash_once, WORKER, 2, first)  # rank 0's stack, from the launch's output
    assert not (crash / "runs.rank0").exists()  # the crash stopped the launch before it

    with pytest.warns(UserWarning, match="2-rank shared launch lost a rank to signal 11"):
        second = relaunch_after_a_crash(2, jobs, first, tmp_path)
    check(crash_once, WORKER, 2, second)
    assert [runs(steady, r) for r in (0, 1)] == [1, 1]  # finished before the crash: not rerun
    assert [runs(crash_once, r) for r in (0, 1)] == [2, 2]
    assert "Segmentation fault" in (tmp_path / "crash.w2.log").read_text()
    # a job that crashes every time crashes the one relaunch too, and fails its tests
    with pytest.raises(AssertionError, match="Segmentation fault"):
        check(crash, WORKER, 2, second)
    assert [runs(crash, r) for r in (0, 1)] == [1, 1]


@pytest.mark.parametrize("report", ["exitcode  : 1", "exitcode  : -15", ""])
def test_no_relaunch_without_a_crash(tmp_path, report, monkeypatch):
    """An exception (exit code 1), torchrun's own SIGTERM to the other ranks (or a timeout's) and a
    clean launch are not crashes: the launch's result stands."""
    monkeypatch.setattr(shared_launch, "launch", lambda *a: pytest.fail("relaunched"))
    proc = subprocess.CompletedProcess([], 1, f"rank 0\n{report}\n", "")
    assert relaunch_after_a_crash(2, [(tmp_path, WORKER, ["steady"])], proc, tmp_path) is proc
