"""Context parallelism: one rank's chunks of each training window (`ContextShards`, the model's
`window` under parallel.cp > 1; models/context.py says what the model and the mixers ask of it).

The window of S rows is cut into `cp * per_rank` equal chunks of L rows: zigzag (per_rank = 2, rank
r holds chunks r and 2cp - 1 - r, so every rank gets the same share of causal attention's and the
QSA indexer's quadratic cost) or contiguous (one chunk per rank). A rank's rows are its chunks end
to end. Every exchange is an all-gather over the cp group whose backward is a reduce-scatter
(comm.py `gather_along`), so gradients reach the rows' owners summed over every rank that read them:
* `gather`: all of a tensor's rows (attention's keys and values), put back in window order;
* `halo`: only the last n rows of each chunk travel (n = a convolution's reach back; whole chunks
  when n > L, for a window cut finer than a convolution reaches);
* `carry`: one transition [H, Dk, Dk] and one final state [H, Dk, Dv] per chunk (fp32), folded in
  window order on every rank (a handful of small matmuls) so each chunk's entering state is exact.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tandem.models.context import WholeWindow

from .comm import gather_along


def chunks_of_rank(rank: int, cp: int, sharding: str) -> List[int]:
    """The window chunks rank `rank` holds, in the order its rows hold them."""
    return [rank, 2 * cp - 1 - rank] if sharding == "zigzag" else [rank]


class ContextShards(WholeWindow):
    def __init__(self, group, sharding: str = "zigzag", switch=None):
        """`switch`: state.WholeSequenceSwitch; while it is off (evaluation) the model computes
        whole windows, as one process."""
        super().__init__()
        self.group, self.sharding, self.switch = group, sharding, switch
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mine = chunks_of_rank(self.rank, self.cp, sharding)
        # the gathered rows come rank by rank, each rank's chunks in its order: the window chunk at
        # each gathered position, and its inverse (the gathered position of each window chunk)
        held = [c for r in range(self.cp) for c in chunks_of_rank(r, self.cp, sharding)]
        self.total = len(held)
        self._gathered_pos = [held.index(c) for c in range(self.total)]

    @property
    def sharded(self) -> bool:
        return self.cp > 1 and (self.switch is None or self.switch.on)

    @property
    def size(self) -> int:
        return self.cp

    @property
    def chunks(self) -> int:
        return len(self.mine) if self.sharded else 1

    # With the switch off (evaluation) the window is whole: what the model asks is WholeWindow's
    # answer.
    def local_rows(self, window_rows: int) -> int:
        return window_rows // self.cp if self.sharded else window_rows

    def rows(self, local_rows: int, device) -> torch.Tensor:
        if not self.sharded:
            return super().rows(local_rows, device)
        length = local_rows // self.chunks
        return torch.cat([torch.arange(c * length, (c + 1) * length,
                                       device=device) for c in self.mine])

    def chunk_ends(self, local_rows: int) -> list:
        if not self.sharded:
            return super().chunk_ends(local_rows)
        length = local_rows // self.chunks
        return [(c + 1) * length for c in self.mine]

    def local(self, x_bs: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return x_bs
        length = x_bs.shape[1] // self.total
        return torch.cat([x_bs[:, c * length:(c + 1) * length] for c in self.mine], dim=1)

    def split(self, x_bs: torch.Tensor) -> torch.Tensor:
        b, rows = x_bs.shape[:2]
        return x_bs.reshape(b * self.chunks, rows // self.chunks, *x_bs.shape[2:])

    def join(self, x_bs: torch.Tensor) -> torch.Tensor:
        bc, length = x_bs.shape[:2]
        return x_bs.reshape(bc // self.chunks, self.chunks * length, *x_bs.shape[2:])

    def _window_order(self, gathered_bt: torch.Tensor) -> torch.Tensor:
        """[B, total, ...] in gathered order -> window order (differentiable index)."""
        index = torch.tensor(self._gathered_pos, device=gathered_bt.device)
        return gathered_bt.index_select(1, index)

    def gather(self, x_bs: torch.Tensor) -> torch.Tensor:
        if not self.sharded:  # (every rank holds another batch's whole windows: nothing to share)
            return super().gather(x_bs)
        b, rows = x_bs.shape[:2]
        length = rows // self.chunks
        # [B, cp * rows, ...], rank by rank
        gathered = gather_along(x_bs.contiguous(), self.group, 1)
        by_chunk = gathered.reshape(b, self.total, length, *x_bs.shape[2:])
        return self._window_order(by_chunk).reshape(b, self.total * length, *x_bs.shape[2:])

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return super().sum(x)
        # funcol's all-reduce: differentiable (its backward sums the gradients) and traced by
        # torch.compile; torch.distributed.nn's is deprecated
        return funcol.all_reduce(x, "sum", self.group)

    def halo(self, chunks_bl: torch.Tensor, n: int, fill=0) -> torch.Tensor:
        if not self.sharded:
            return super().halo(chunks_bl, n, fill)
        if n == 0:
            return chunks_bl[:, :0]
        bc, length = chunks_bl.shape[:2]
        b, rest = bc // self.chunks, chunks_bl.shape[2:]
        # rows each chunk sends: its last n, or all of it when the halo is longer
        m = min(n, length)
        tails = chunks_bl[:, length - m:].reshape(b, self.chunks * m, *rest)
        gathered = gather_along(tails.contiguous(), self.group, 1).reshape(b, self.total, m, *rest)
        # chunk by chunk, in order
        window = self._window_order(gathered).reshape(b, self.total * m, *rest)
        # the rows before chunk c end at row c * m of `window`; `fill` stands before the window's
        # start
        padded = torch.cat([window.new_full((b, n, *rest), fill), window], dim=1)
        before = [padded[:, c * m: c * m + n] for c in self.mine]
        return torch.stack(before, 1).reshape(bc, n, *rest)

    def carry(self, transition_bhkk: torch.Tensor, final_bhkv: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return super().carry(transition_bhkk, final_bhkv)
        bc = transition_bhkk.shape[0]
        b = bc // self.chunks
        packed = torch.cat([transition_bhkk, final_bhkv], dim=-1).float()  # [B*c, H, Dk, Dk + Dv]
        packed = packed.reshape(b, self.chunks, *packed.shape[1:])
        # [B, total, H, Dk, Dk+Dv]
        window = self._window_order(gather_along(packed.contiguous(), self.group, 1))
        dk = transition_bhkk.shape[-1]
        state = torch.zeros_like(window[:, 0, ..., dk:])
        entering = []
        for c in range(self.total):  # state entering chunk c, then leaving it
            entering.append(state)
            state = window[:, c, ..., :dk] @ state + window[:, c, ..., dk:]
        index = torch.tensor(self.mine, device=transition_bhkk.device)
        return torch.stack(entering, 1).index_select(1, index).reshape(bc, *final_bhkv.shape[1:])
