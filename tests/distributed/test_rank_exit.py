"""A rank leaves through `tandem`'s exit (leave_distributed_process) without aborting after gloo
collectives whose group outlives destroy_process_group (exit_worker.py has the plain exit's abort
rate; docs/parallelism.md, "How a rank exits")."""

import pytest

from tests.distributed import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_eight_ranks_leave_cleanly_after_collectives_on_a_kept_mesh():
    done = torchrun.run(8, "tests.distributed.exit_worker", "--leave", timeout=300)
    assert done.returncode == 0 and "terminate called" not in done.stdout, done.stdout[-3000:]
