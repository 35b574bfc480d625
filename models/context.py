"""Which rows of a training window this rank computes: all of them (`WholeWindow`, one process), or
under context parallelism one rank's chunks of it (trainer/parallel/context.py `ContextShards`).

The window of S positions is cut into equal chunks, and a rank holds `chunks` of them (zigzag:
chunks r and 2cp - 1 - r; contiguous: chunk r), laid end to end in its rows. The model builds every
per-position input over the whole window, which each rank has in full since only token ids and masks
are involved (positions, the documents' starts, each MTP depth's tokens and targets, the loss
masks), and keeps its own rows (`local`), so no label is ever shifted after sharding. Per-token
parts (norms, MLP, MoE routing, hyper-connections, the head) need nothing more. The token mixers
read across chunk edges, and the MoE's auxiliary losses average over the window, through four
exchanges, each the identity in one process:

* `gather`: a tensor's rows of the whole window, in window order (attention's keys and values, QSA's
  indexer keys);
* `halo`: the n rows before each of this rank's chunks (a causal convolution's reach);
* `sum`: a few numbers summed over the ranks (the MoE's auxiliary-loss statistics);
* `carry`: Gated DeltaNet's state entering each chunk, folded from every earlier chunk's final state
  and transition (models/gated_deltanet.py).

Mixers work on chunks as batch rows (`split` [B, c*L, ...] -> [B*c, L, ...], `join` back), so a
chunk with its halo or entering state computes exactly what one process computes for those rows.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class WholeWindow(nn.Module):
    """One process: every row of the window, in order. It holds no parameters."""

    @property
    def sharded(self) -> bool:
        """Whether the window is split over several ranks (the mixers' exchanges are not
        identities)."""
        return False

    @property
    def size(self) -> int:
        """How many ranks the window is split over."""
        return 1

    @property
    def chunks(self) -> int:
        """How many chunks of the window this rank holds."""
        return 1

    def local_rows(self, window_rows: int) -> int:
        """How many of a window's rows this rank holds."""
        return window_rows

    def rows(self, local_rows: int, device) -> torch.Tensor:
        """[local_rows] long: the window row of each of this rank's rows."""
        return torch.arange(local_rows, device=device)

    def chunk_ends(self, local_rows: int) -> list:
        """The window row just past each of this rank's chunks, in its order (host ints)."""
        return [local_rows]

    def local(self, x_bs: torch.Tensor) -> torch.Tensor:
        """This rank's rows (dim 1) of a tensor built over the whole window."""
        return x_bs

    def split(self, x_bs: torch.Tensor) -> torch.Tensor:
        """[B, chunks * L, ...] -> [B * chunks, L, ...]: each chunk a batch row."""
        return x_bs

    def join(self, x_bs: torch.Tensor) -> torch.Tensor:
        """The inverse of `split`."""
        return x_bs

    def gather(self, x_bs: torch.Tensor) -> torch.Tensor:
        """[B, S, ...]: `x_bs`'s rows of the whole window in window order, from every rank's rows
        (differentiable: each rank's rows get the gradient every rank sent them)."""
        return x_bs

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks splitting the window (differentiable: the backward sums each
        rank's gradient too, as every rank computes the same loss from it)."""
        return x

    def halo(self, chunks_bl: torch.Tensor, n: int, fill=0) -> torch.Tensor:
        """[B * chunks, n, ...]: the n window rows before each chunk of `chunks_bl` (a `split`
        tensor), `fill` before the window's first row (differentiable)."""
        return chunks_bl.new_full((chunks_bl.shape[0], n, *chunks_bl.shape[2:]), fill)

    def carry(self, transition_bhkk: torch.Tensor,
              final_bhkv: torch.Tensor) -> Optional[torch.Tensor]:
        """Gated DeltaNet's state entering each chunk (`split` rows), from each chunk's transition M
        and final state F when entered with zero: a chunk entered with state X leaves M X + F. None
        here: the only chunk starts the window, from zero."""
        return None
