"""A shared launch that loses a rank to a signal fails the tests of that job and of every job after
it, each report naming the launch's exit and showing the dead rank's stack; nothing is retried (a
crash a retry hides is a defect)."""

import pytest

from tests.distributed.shared_launch import check, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = "tests.distributed.crash_worker"


def test_a_rank_that_dies_of_a_signal_fails_its_job_with_its_stack(tmp_path):
    before, crash, after = (tmp_path / name for name in ("before", "crash", "after"))
    jobs = [(before, WORKER, ["steady"]), (crash, WORKER, ["crash"]), (after, WORKER, ["steady"])]
    proc = launch(2, jobs, tmp_path)
    assert proc.returncode != 0 and "rank 0 exited with -11" in proc.stderr, proc.stderr[-3000:]
    check(before, WORKER, 2, proc)
    with pytest.raises(AssertionError) as crashed:
        check(crash, WORKER, 2, proc)
    report = str(crashed.value)
    # rank 0's own stack, whose frames name the function it died in (after rank 1's echo, "peer
    # closed", when rank 1 wrote it before the launch stopped it)
    assert "--- rank 0 ---" not in report
    assert "Fatal Python error: Segmentation fault" in report and "rank_zero_dies" in report
    # ... after its faulting thread's native stack, and the launch's exit note names the signal
    assert "SIGSEGV(11), PID: " in report and "frame #0: c10::FatalSignalHandler" in report
    assert report.endswith("rank 0 exited with -11 (SIGSEGV)"), report[-300:]
    with pytest.raises(AssertionError, match="did not run to its end"):
        check(after, WORKER, 2, proc)
    assert not (after / "ran.rank0").exists()  # the crash stopped the launch: nothing ran again
