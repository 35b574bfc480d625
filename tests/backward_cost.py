"""What a backward pass writes: the elements of every tensor its ops return. A chunk loop that
slices or indexes a tensor needing a gradient zero-fills that whole tensor in backward once per
chunk, so it writes more per token the more chunks it cuts; cut once (`split`, `unbind`), it
writes the same per token however many chunks there are. An indexed accumulation in place
(`index_add_`) counts what it adds, not the tensor it adds into."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Written(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.elements += self._written(func, t, args)
        return out

    @staticmethod
    def _written(func, out: torch.Tensor, args) -> int:
        """An indexed accumulation in place (`index_add_`: it returns its first argument) writes as
        many elements as its source holds, not the whole buffer; any other op, all it returns
        (a broadcast `add_` writes the whole tensor)."""
        if func.__name__.split(".")[0] in _INDEXED and args and out is args[0]:
            sources = [a for a in args[1:] if isinstance(a, torch.Tensor)]
            return sources[-1].numel()  # (index_add_'s source, index_put_'s values, ...)
        return out.numel()


_INDEXED = {"index_add_", "index_put_", "scatter_add_", "index_copy_", "put_"}


def backward_elements(loss: torch.Tensor) -> int:
    """Elements the ops of `loss.backward()` return."""
    with _Written() as written:
        loss.backward()
    return written.elements
