"""megatron-core's data layer (its indexed and GPT datasets, their blending and builder, the
tokenizer base) imported without running the package's `__init__`.

That `__init__` imports the whole library: its model, optimizer and inference layers, wandb, and 24
`torch.compile` decorators that load inductor. That is seconds of CPU in every rank of every run
(docs/data.md has the figure), and warnings about Transformer Engine and Apex. The data layer needs
none of it. So `megatron.core` is first made a package whose `__init__` has not run
(`_PackageShell`); the dataset modules import into it, and its `__init__` runs on the first
attribute it lacks, so `from megatron.core import X` elsewhere still works. If the package was
already imported, it is used as it is. A release whose dataset modules need that `__init__` to have
run fails the shell import; the shell is then dropped and the ordinary import runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from importlib.machinery import PathFinder

PACKAGE = "megatron.core"


class _PackageShell(types.ModuleType):
    """`megatron.core` with its submodules importable and its `__init__` not yet run: the first
    attribute it lacks that is not a submodule runs that `__init__` in it (the package as an
    ordinary import leaves it). A submodule's name raises AttributeError, so that `from
    megatron.core import config` imports the submodule, as with the ordinary package."""

    def __getattr__(self, name: str):
        if (self.__dict__.get("_tandem_init_ran")
                or PathFinder.find_spec(f"{PACKAGE}.{name}", self.__path__) is not None):
            raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
        self._tandem_init_ran = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def _drop_package() -> None:
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    vars(sys.modules["megatron"]).pop("core", None)


def _import_datasets() -> tuple:
    """`_dataset_classes`, imported into `_PackageShell` unless the package is already imported
    (or the shell import fails: then the ordinary import, warnings about Transformer Engine and
    Apex silenced)."""
    shell = None
    if PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(PACKAGE)
        shell = _PackageShell(PACKAGE)
        shell.__spec__, shell.__loader__ = spec, spec.loader
        shell.__file__, shell.__package__ = spec.origin, PACKAGE
        shell.__path__ = list(spec.submodule_search_locations)
        sys.modules[PACKAGE] = shell
        importlib.import_module("megatron").core = shell  # as an import binds it in its parent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            # first, as the package's __init__ does: it and megatron.core.utils import each other
            importlib.import_module(PACKAGE + ".parallel_state")
            return _dataset_classes()
        except Exception:
            if shell is None:
                raise
            _drop_package()
            return _dataset_classes()


def _dataset_classes() -> tuple:
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
    from megatron.core.tokenizers import MegatronTokenizerBase

    return (BlendedDataset, BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, DType,
            IndexedDataset, IndexedDatasetBuilder, MegatronTokenizerBase)


(BlendedDataset, BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, DType, IndexedDataset,
 IndexedDatasetBuilder, MegatronTokenizerBase) = _import_datasets()
