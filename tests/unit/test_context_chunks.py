"""The token mixers' context-parallel forms (models/context.py) in one process: a window cut into
chunks that this process holds all of (`LocalChunks`: the halo read from the chunk before, the Gated
DeltaNet carry folded over the chunks here) computes what the plain forward computes, outputs and
gradients, on real-data shapes: runs of one token, packed documents with starts on chunk edges and
one off them, slow decay. The distributed exchanges themselves are checked in
tests/distributed/test_context_parallel.py; this checks the chunk arithmetic, and the fla-kernel
branch through a torch stand-in for fla."""

from __future__ import annotations

import pytest
import torch

from tandem.models import gated_deltanet as gdn
from tandem.models.context import WholeWindow
from tandem.models.documents import Documents
from tandem.models.gated_deltanet import GatedDeltaNet
from tandem.trainer.parallel.context import chunks_of_rank
from tests.unit.test_gated_deltanet import fla_stand_in


class LocalChunks(WholeWindow):
    """Every chunk of the window held here, in window order (so `local` and `gather` are
    identities)."""

    def __init__(self, chunks: int):
        super().__init__()
        self.n = chunks

    @property
    def sharded(self) -> bool:
        return True

    @property
    def chunks(self) -> int:
        return self.n

    def chunk_ends(self, local_rows: int) -> list:
        return [(c + 1) * local_rows // self.n for c in range(self.n)]

    def split(self, x):
        return x.reshape(x.shape[0] * self.n, x.shape[1] // self.n, *x.shape[2:])

    def join(self, x):
        return x.reshape(x.shape[0] // self.n, x.shape[1] * self.n, *x.shape[2:])

    def halo(self, chunks_bl, n, fill=0):
        whole = self.join(chunks_bl)
        padded = torch.cat([whole.new_full((whole.shape[0], n, *whole.shape[2:]), fill), whole], 1)
        length = chunks_bl.shape[1]
        return torch.stack([padded[:, c * length: c * length + n] for c in range(self.n)],
                           1).reshape(
            chunks_bl.shape[0], n, *chunks_bl.shape[2:])

    def carry(self, transition, final):
        b = transition.shape[0] // self.n
        m, f = transition.view(b, self.n, *transition.shape[1:]), final.view(b, self.n,
                                                                             *final.shape[1:])
        state, entering = torch.zeros_like(f[:, 0]), []
        for c in range(self.n):
            entering.append(state)
            state = m[:, c] @ state + f[:, c]
        return torch.stack(entering, 1).reshape(final.shape)


def _inputs(seed: int, s: int, documents: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, s, 32, generator=g)
    x[0, 5:30] = x[0, 5]  # a run of one token
    starts = torch.zeros(2, s, dtype=torch.long)
    if documents:  # document starts on a chunk edge (s/4), one off one (s/2 + 1) and mid-chunk
        for row, cuts in ((0, [s // 4, s // 2 + 1]), (1, [s // 2 - 1, 3 * s // 4])):
            for cut in cuts:
                starts[row, cut:] = cut
    docs = Documents(starts) if documents else None
    positions = docs.positions() if docs is not None else torch.arange(s).expand(2, s)
    return x, positions, docs


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("fla", [False, True])
def test_gated_deltanet_over_chunks_equals_the_whole_window(documents, fla, monkeypatch):
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, conv_kernel=4, kernel="torch")
    with torch.no_grad():
        layer.A_log.fill_(-4.0)  # slow decay: the carried state matters far into the next chunk
    x, positions, docs = _inputs(1, 128, documents)
    x.requires_grad_(True)
    want = layer(x, positions, documents=docs)
    (gx_want,) = torch.autograd.grad(want.square().sum(), x)
    if fla:  # the fla branch, with a torch stand-in for the kernel (it runs without documents only)
        monkeypatch.setattr(gdn, "_fla_chunk", fla_stand_in)
        monkeypatch.setattr(GatedDeltaNet, "_use_fla", lambda self, v: True)
    for chunks in (2, 4, 64):  # 64: two-token chunks, shorter than the conv's 3-row halo
        got = layer(x, positions, documents=docs, context=LocalChunks(chunks))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        (gx,) = torch.autograd.grad(got.square().sum(), x)
        torch.testing.assert_close(gx, gx_want, rtol=1e-4, atol=1e-5)


def test_the_carry_matters():
    """Without the entering state the chunks' outputs differ (the check above is not vacuous)."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, conv_kernel=4, kernel="torch")
    with torch.no_grad():
        layer.A_log.fill_(-4.0)
    x, positions, _ = _inputs(1, 128, False)

    class NoCarry(LocalChunks):
        def carry(self, transition, final):
            return torch.zeros_like(final)

    want = layer(x, positions)
    assert float((layer(x, positions, context=NoCarry(4)) - want).abs().max()) > 1e-2


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_chunks_partition_the_window_and_balance_causal_cost(cp):
    """Zigzag (docs: rank r holds chunks r and 2cp-1-r) must give every rank the same causal
    attention cost. Chunk c of 2cp reads keys of c+1 chunks (c*L^2 + L^2/2 pairs), so rank r's
    cost is sum(2c+1) over its chunks; contiguous must not be balanced (cp>1)."""
    held = [c for r in range(cp) for c in chunks_of_rank(r, cp, "zigzag")]
    assert sorted(held) == list(range(2 * cp))
    costs = {r: sum(2 * c + 1 for c in chunks_of_rank(r, cp, "zigzag")) for r in range(cp)}
    assert len(set(costs.values())) == 1, costs
    for r in range(cp):
        mine = chunks_of_rank(r, cp, "zigzag")
        assert mine == sorted(mine), mine  # rows hold their chunks in window order
    assert chunks_of_rank(0, cp, "zigzag")[-1] == 2 * cp - 1  # rank 0 also holds the last chunk
