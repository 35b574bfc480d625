"""QSA over packed documents (`documents=`): each document of a packed row computes, token for
token, what it computes alone from position 0 (blocks aligned to its start, selection within it,
block-diagonal attention, the indexer's target and recall per document), in every training form, and
a row holding a single document gives exactly the plain (documents=None) forward."""

from __future__ import annotations

import functools

import pytest
import torch

from tandem.models.documents import Documents
from tandem.models.qsa import IndexedAttention
from tandem.models.qsa_loss import measuring_recall
from tests.unit.test_qsa import BUDGET, HIDDEN, RATIO
from tests.unit.test_qsa import make_qsa as make_plain_qsa

# Boundaries off the block grid, a 1-token document, documents longer than the budget (selection
# active) and, in row 1, a document cut by the window's end inside a block.
LENGTHS = [[7, 13, 1, 19], [3, 22, 15]]
S = 40


def make_qsa(seed: int, form: str = "mask", indexer_loss_coef: float = 0.0) -> IndexedAttention:
    """test_qsa.py's QSA layer (its shape, its weights drawn so selection is decided by content)."""
    return make_plain_qsa(seed, form=form, indexer_loss_coef=indexer_loss_coef)


def packed(seed: int = 1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), S, HIDDEN, generator=g) + 1.5 * torch.randn(HIDDEN, generator=g)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)),
                                               torch.tensor(row)) for row in lengths])
    docs = Documents.from_doc_ids(ids)
    return x, docs


def spans(lengths=LENGTHS):
    """(row, start, length) of every document."""
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            yield b, start, n
            start += n


def alone(x_bsh, b, start, n):
    return x_bsh[b:b + 1, start:start + n], torch.arange(n)[None]


def assert_per_document(y_packed, run_alone, lengths=LENGTHS):
    for b, start, n in spans(lengths):
        want = run_alone(b, start, n)
        torch.testing.assert_close(y_packed[b:b + 1, start:start + n], want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"document at row {b}, {start}..{start + n}: {m}")


@pytest.mark.parametrize("form,dense", [("mask", False), ("gather", False), ("mask", True)])
def test_each_document_computes_what_it_computes_alone(form, dense):
    layer = make_qsa(1, form).train()
    attn = functools.partial(layer, dense=dense)
    x, docs = packed(1)
    g = torch.randn_like(x)
    xp = x.clone().requires_grad_()
    y = attn(xp, docs.positions(), documents=docs)
    (y * g).sum().backward()
    assert_per_document(y.detach(), lambda b, s0, n: attn(*alone(x, b, s0, n)).detach())

    def grad_alone(b, s0, n):
        xa = x[b:b + 1, s0:s0 + n].clone().requires_grad_()
        (attn(xa, torch.arange(n)[None]) * g[b:b + 1, s0:s0 + n]).sum().backward()
        return xa.grad

    assert_per_document(xp.grad, grad_alone)


def test_gather_form_equals_mask_form_on_packed_documents():
    x, docs = packed(2)
    ys = [make_qsa(2, form)(x, docs.positions(), documents=docs) for form in ("mask", "gather")]
    torch.testing.assert_close(ys[1], ys[0], rtol=1e-5, atol=1e-5)


def test_selection_stays_in_the_query_document():
    attn = make_qsa(3)
    x, docs = packed(3)
    _, sel = attn(x, docs.positions(), return_selection=True, documents=docs)
    rows = sel.block_rows_bn.gather(1, sel.blocks_bsk.flatten(1)).view_as(sel.blocks_bsk)
    real = torch.arange(sel.blocks_bsk.shape[-1]) < sel.counts_bs[..., None]
    at = docs.positions()[..., None]
    first = docs.starts_bs[..., None]
    assert sel.counts_bs.max() == BUDGET // RATIO  # the budget binds somewhere
    assert ((rows >= first) & ((rows - first) % RATIO == 0)
            & (rows - first + RATIO - 1 <= at))[real].all()
    assert torch.equal(sel.counts_bs, ((at[..., 0] + 1) // RATIO).clamp(max=BUDGET // RATIO))


@pytest.mark.parametrize("form", ["mask", "gather"])
def test_a_handed_over_selection_is_read_in_its_documents(form):
    """MTP depth 1 selects, a later depth (other weights) attends over that selection."""
    depth1, depth2 = make_qsa(4, form), make_qsa(5, form)
    x, docs = packed(4)
    x2 = packed(5)[0]
    _, sel = depth1(x, docs.positions(), return_selection=True, documents=docs)
    y = depth2(x2, docs.positions(), selection=sel, documents=docs)

    def run_alone(b, s0, n):
        _, sel_a = depth1(*alone(x, b, s0, n), return_selection=True)
        return depth2(*alone(x2, b, s0, n), selection=sel_a)

    assert_per_document(y, run_alone)
    with pytest.raises(RuntimeError, match="packed documents"):
        depth2(x2, docs.positions(), selection=sel)


@pytest.mark.parametrize("dense", [False, True])
def test_indexer_loss_and_recall_per_document(dense):
    """The KL averages over queries with a candidate block (L - r + 1 of a document of L >= r
    tokens) and the recall over all queries: the packed row's values are those weighted means of
    each document's own."""
    attn = make_qsa(6, indexer_loss_coef=1.0).train()
    attn.chunk_elems = 1500
    x, docs = packed(6)
    with measuring_recall():
        attn(x, docs.positions(), documents=docs, dense=dense)
    got_loss, got_recall = attn.last_indexer_loss, attn.last_recall
    kl = queries = recall = 0.0
    for b, s0, n in spans():
        with measuring_recall():
            attn(*alone(x, b, s0, n), dense=dense)
        recall += attn.last_recall * n
        if n >= RATIO:
            kl += attn.last_indexer_loss * (n - RATIO + 1)
            queries += n - RATIO + 1
    torch.testing.assert_close(got_loss, kl / queries, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_recall, recall / sum(map(sum, LENGTHS)), rtol=1e-5, atol=1e-6)
    assert got_recall < 0.999


@pytest.mark.parametrize("form,dense", [("mask", False), ("gather", False), ("mask", True)])
def test_one_document_per_row_equals_the_plain_forward(form, dense):
    """documents=None is the single-document row: the documents path reproduces it (bit for bit
    where the same kernels run), outputs, gradients, the indexer's loss and the recall."""
    attn = make_qsa(7, form, indexer_loss_coef=1.0).train()
    x, docs = packed(7, [[S], [S]])
    g = torch.randn_like(x)
    out = {}
    for key, kwargs in (("plain", {}), ("documents", {"documents": docs})):
        attn.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with measuring_recall():
            y, sel = attn(xi, docs.positions(), return_selection=True, dense=dense, **kwargs)
        (y * g).sum().backward()
        out[key] = (y.detach(), xi.grad, attn.indexer.index_qk_proj.weight.grad,
                    attn.last_indexer_loss, attn.last_recall, sel)
    plain, documents = out["plain"], out["documents"]
    # dense: is_causal SDPA against the document mask, another kernel; same values to rounding
    same = (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)) if dense else \
        (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0))
    for a, b in zip(documents[:5], plain[:5]):
        same(a, b)
    if not dense:
        assert torch.equal(documents[5].blocks_bsk, plain[5].blocks_bsk)
        assert torch.equal(documents[5].block_rows_bn,
                           torch.arange(S // RATIO).expand(2, -1) * RATIO)
