"""data_pipeline/megatron_import.py: megatron-core's dataset classes without its package `__init__`,
which then still runs for whoever asks `megatron.core` for more; and the ordinary import when the
shell import fails. Each case in a fresh interpreter (the import state is the point)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SHELL = """
import importlib.metadata, sys, types
from tandem.data_pipeline import megatron_import as m
import megatron.core
# the dataset layer only: none of the model, inference or optimizer layers
assert type(sys.modules["megatron.core"]) is not types.ModuleType
for name in ("megatron.core.transformer", "megatron.core.optimizer", "megatron.core.inference"):
    assert name not in sys.modules, name
from megatron.core.datasets.gpt_dataset import GPTDataset
assert m.GPTDataset is GPTDataset
# the package's __init__ runs on the first attribute it lacks
assert megatron.core.__version__ == importlib.metadata.version("megatron-core")
from megatron.core import ModelParallelConfig, parallel_state
assert "megatron.core.transformer" in sys.modules
assert callable(parallel_state.get_data_parallel_rank)
print("ok")
"""

FALLBACK = """
import sys, types
sys.modules["megatron.core.parallel_state"] = None  # the shell import fails on it
from tandem.data_pipeline import megatron_import as m
# the shell dropped, the ordinary package imported in full
assert type(sys.modules["megatron.core"]) is types.ModuleType
assert "megatron.core.transformer" in sys.modules
from megatron.core.datasets.indexed_dataset import IndexedDataset
assert m.IndexedDataset is IndexedDataset
# an already imported package is used as it is
assert m._import_datasets()[5] is IndexedDataset
print("ok")
"""


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_dataset_classes_import_without_the_package_init_which_runs_on_demand():
    _run(SHELL)


def test_a_failing_shell_import_falls_back_to_the_ordinary_import():
    _run(FALLBACK)
