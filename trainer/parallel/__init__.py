"""Parallelism applied from outside the model: device layer, mesh, TP/SP, EP, PP, FSDP."""

from .state import ParallelState, init_parallel, parallelize_model

__all__ = ["ParallelState", "init_parallel", "parallelize_model"]
