"""Parallelism applied from outside the model: device layer, mesh, TP/SP, EP, PP, FSDP."""

from .layout import init_parallel, parallelize_model
from .state import ParallelState

__all__ = ["ParallelState", "init_parallel", "parallelize_model"]
