"""train.compile under a parallel layout (FSDP2 over dp=2, gloo) equals eager training in one process,
within the tolerances every fp32 layout meets (test_parallel_equivalence.py): compiling a block only
re-fuses fp32 elementwise work (measured against the eager one-process run: losses 4.8e-7 absolute,
parameters 9.2e-6 relative after three AdamW steps)."""

from __future__ import annotations

import pytest
import torch

from test_parallel_equivalence import DEFAULT_PARAM_RTOL, RTOL, load, launch, rel_err  # puts worker on sys.path

import worker  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUT = "dp=2,train.compile=true"


def test_compiled_fsdp_matches_eager_single_process(tmp_path):
    launch(tmp_path, 2, [LAYOUT])
    losses, params = load(tmp_path, LAYOUT, 2)
    torch.set_num_threads(1)
    ref = worker.run_layout("single", batch_size_for_ref=2)  # eager, one process, the same global batch
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref["losses"], dtype=torch.float64), rtol=RTOL, atol=1e-6)
    assert params.keys() == ref["params"].keys()
    for name, value in params.items():
        assert rel_err(value, ref["params"][name]) <= DEFAULT_PARAM_RTOL, name
