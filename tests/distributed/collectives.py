"""Record what every collective receives: the op, and each tensor's device and dtype.

NCCL and HCCL accept only tensors on the process's device and Ascend has no fp64 units, while gloo
(which the CPU tests run on) accepts anything. `CollectiveRecorder` wraps the collectives of
`torch.distributed` (what FSDP2, pipelining and Tandem's own code call) and of the functional
collectives (what DTensor redistributions call) so a CPU run can assert that every tensor a
training step hands them is a device tensor and not float64.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

DIST_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
            "reduce_scatter",
            "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather",
            "scatter", "all_to_all", "all_to_all_single", "send", "recv")
# isend/irecv (pipelining's activations) are recorded where every one of them is described: the
# construction of a `P2POp`. Wrapping them instead would make P2POp reject the wrapper as "not
# isend or irecv", and the schedules call the P2POp's own reference to them.
FUNCOL_OPS = ("all_reduce", "all_reduce_inplace", "all_reduce_coalesced", "all_gather_tensor",
              "all_gather_tensor_autograd", "all_gather_single", "all_gather_inplace",
              "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
              "reduce_scatter_tensor_autograd",
              "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "all_to_all_single",
              "all_to_all_single_autograd", "broadcast", "permute_tensor")


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class CollectiveRecorder:
    """`install()` once per process; calls made while `active` are counted in `calls` as
    (op, device, dtype) -> number of tensors."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.active = False
        self._originals = []

    def install(self) -> "CollectiveRecorder":
        for module, names in ((dist, DIST_OPS), (funcol, FUNCOL_OPS)):
            for name in names:
                fn = getattr(module, name, None)
                if fn is not None:
                    self._originals.append((module, name, fn))
                    setattr(module, name,
                            self._wrap(f"{module.__name__.split('.')[-1]}.{name}", fn))

        init = dist.P2POp.__init__
        self._originals.append((dist.P2POp, "__init__", init))

        @functools.wraps(init)
        def p2p_init(op_self, op, tensor, *args, **kwargs):
            if self.active:
                self.calls[(f"distributed.{getattr(op, '__name__', op)}", str(tensor.device),
                            str(tensor.dtype))] += 1
            return init(op_self, op, tensor, *args, **kwargs)

        dist.P2POp.__init__ = p2p_init
        return self

    def uninstall(self) -> None:
        for module, name, fn in self._originals:
            setattr(module, name, fn)
        self._originals.clear()

    def _wrap(self, label: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.active:
                for t in _tensors((args, kwargs)):
                    self.calls[(label, str(t.device), str(t.dtype))] += 1
            return fn(*args, **kwargs)
        return wrapper
