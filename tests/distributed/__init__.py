"""Multi-process tests: torchrun workers on gloo, started as modules of this package
(tests/processes.py)."""
