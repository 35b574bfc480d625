"""What a backward pass writes: the elements of every tensor its ops return. A chunk loop that
slices or indexes a tensor needing a gradient zero-fills that whole tensor in backward once per
chunk, so it writes more per token the more chunks it cuts; cut once (`split`, `unbind`), it
writes the same per token however many chunks there are. An op in place counts what it adds, not
the tensor it adds into."""

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
                self.elements += self._written(t, args)
        return out

    @staticmethod
    def _written(out: torch.Tensor, args) -> int:
        """An in-place op (it returns its first argument) writes as many elements as its largest
        other tensor argument holds (`index_add_`'s source rows, not the whole buffer), or all of
        its own when it has none (`zero_`)."""
        if not args or out is not args[0]:
            return out.numel()
        return max((a.numel() for a in args[1:] if isinstance(a, torch.Tensor)),
                   default=out.numel())


def backward_elements(loss: torch.Tensor) -> int:
    """Elements the ops of `loss.backward()` return."""
    with _Written() as written:
        loss.backward()
    return written.elements
