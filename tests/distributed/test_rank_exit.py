"""A rank leaves through `tandem`'s exit (leave_distributed_process) without aborting after gloo
collectives whose group outlives destroy_process_group: every shared launch of the session (one per
world size, up to 8 ranks) ends that way after thousands of collectives on device meshes it keeps
alive (worker.reuse_device_meshes, as torch's DTensor caches keep a run's), and this module's job
adds an all_gather over a kept mesh's group to the 8-rank one (exit_worker.py, which also measures
the plain exit's abort rate; docs/parallelism.md, "How a rank exits")."""

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SHARED_JOBS = [(8, "tests.distributed.exit_worker", [])]


def test_every_shared_launch_leaves_cleanly(shared_jobs, shared_launches):
    assert 8 in shared_launches.procs
    for world, proc in shared_launches.procs.items():
        assert proc.returncode == 0 and "terminate called" not in proc.stdout, (
            world, proc.stdout[-3000:])
