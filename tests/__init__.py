"""The test suite, a package: test modules and torchrun workers import shared helpers by their
dotted names (`from tests.eval_helpers import ...`, `from tests.distributed import worker`). pytest
(its default `prepend` import mode) puts the directory above this package, the repository root, on
sys.path; multi-rank workers start as modules from there (tests/processes.py)."""
