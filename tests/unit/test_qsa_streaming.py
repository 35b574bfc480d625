"""QSA's streamed training form (models/qsa_stream.py) against the path before it, which held the
whole [B, S, S / r] score matrix (bench/qsa_memory.py `MaterialisedIndexedAttention`): the same
selection slot for slot, and outputs, input and parameter gradients and the indexer KL within fp32
rounding, on data with many tied scores (relu zeros, long runs of one token), packed documents, both
forms and stages, with chunks small enough that queries and blocks stream in many pieces."""

from __future__ import annotations

import pytest
import torch

from bench.qsa_memory import MaterialisedIndexedAttention
from tandem.models.documents import Documents
from tandem.models.qsa import IndexedAttention
from tandem.models.qsa_loss import measuring_recall

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, IDX_HEADS, IDX_DIM, BUDGET, RATIO = 32, 4, 2, 8, 2, 16, 16, 4
B, S = 2, 48


def pair(seed: int, form: str, chunk_elems: int = 200, ties: bool = True):
    """The streamed layer and the reference with the same weights. `ties`: indexer queries pointing
    away from the key head, so most relu(q . k) are 0 and many blocks tie."""
    torch.manual_seed(seed)
    layers = []
    for cls in (IndexedAttention, MaterialisedIndexedAttention):
        layers.append(cls(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 0.5, 10000.0, 64, 1e-6, IDX_HEADS,
                          IDX_DIM, BUDGET, RATIO, form=form, indexer_loss_coef=0.5).train())
    with torch.no_grad():
        for p in layers[0].parameters():
            p.normal_(0, 0.3)
        if ties:
            w = layers[0].indexer.index_qk_proj.weight.view(IDX_HEADS + 1, IDX_DIM, HIDDEN)
            w[:-1] = -w[-1] + 0.2 * w[:-1]
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        layer.chunk_elems = chunk_elems
    return layers


def inputs(seed: int, runs: bool = True, dtype=torch.float32):
    """x [B, S, HIDDEN]; `runs`: row 0 repeats one token for 20 rows (identical block keys)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, HIDDEN, generator=g) + 1.5 * torch.randn(HIDDEN, generator=g)
    if runs:
        x[0, 8:28] = x[0, 8]
    return x.to(dtype).requires_grad_(), torch.arange(S).expand(B, S)


def run(layer, x, pos, documents=None, grad_seed: int = 0, dense: bool = False, counted=None):
    """One training forward and backward, measuring the recall: (output, selection, input gradient,
    parameter gradients, indexer loss, recall)."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with measuring_recall():
        y, sel = layer(x, pos, return_selection=True, documents=documents, dense=dense,
                       counted=counted)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y.dtype)
    (y * g).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return y, sel, x.grad, grads, layer.last_indexer_loss, layer.last_recall


def assert_same(got, want, tol=1e-5):
    y, sel, gx, grads, loss, recall = got
    y_r, sel_r, gx_r, grads_r, loss_r, recall_r = want
    if sel_r is not None:
        assert torch.equal(sel.blocks_bsk, sel_r.blocks_bsk) and torch.equal(sel.counts_bs,
                                                                             sel_r.counts_bs)
    torch.testing.assert_close(y, y_r, rtol=tol, atol=tol)
    torch.testing.assert_close(gx, gx_r, rtol=tol, atol=tol)
    assert grads.keys() == grads_r.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_r[name], rtol=tol, atol=tol,
                                   msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(loss, loss_r, rtol=tol, atol=tol)
    torch.testing.assert_close(recall, recall_r, rtol=tol, atol=tol)


@pytest.mark.parametrize("form,dense", [("mask", False), ("gather", False), ("mask", True)])
# 24: blocks merged in 6-block pieces; 200: query chunks
@pytest.mark.parametrize("chunk_elems", [24, 200, 1 << 20])
def test_streamed_equals_the_materialised_path(form, dense, chunk_elems):
    streamed, reference = pair(1, form, chunk_elems)
    x, pos = inputs(1)
    assert_same(run(streamed, x, pos, dense=dense), run(reference, x, pos, dense=dense))


@pytest.mark.parametrize("form,dense", [("mask", False), ("gather", False), ("mask", True)])
@pytest.mark.parametrize("padded", [False, True])
def test_streamed_equals_the_materialised_path_on_packed_documents(form, dense, padded):
    """Boundaries off the block grid, a 1-token document, one cut by the window's end, one run of a
    token; `padded`: row 1's last document is padding, which the KL leaves out."""
    streamed, reference = pair(2, form, chunk_elems=24)
    x, pos = inputs(2)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                       for r in ([7, 13, 1, 27], [3, 22, 23])])
    docs = Documents.from_doc_ids(ids)
    counted = (ids != 2) | (torch.arange(B) == 0)[:, None] if padded else None
    got = run(streamed, x, docs.positions(), docs, dense=dense, counted=counted)
    assert_same(got, run(reference, x, docs.positions(), docs, dense=dense, counted=counted))
    if padded:  # (the padding had queries to learn from)
        assert not torch.allclose(got[4], run(streamed, x, docs.positions(), docs, dense=dense)[4])


def test_ties_are_many_and_break_toward_the_earlier_block():
    """The data above does tie (so the comparison means something), and ties go to the earlier block
    in the streamed merge exactly as in one top-k over the whole row."""
    streamed, _ = pair(1, "mask", chunk_elems=24)
    x, pos = inputs(1)
    q_idx, raw = streamed.indexer(x, pos, streamed.rotary)
    k_bnd = streamed._training_block_keys(raw, pos, None)
    scores = streamed.indexer.block_scores(q_idx, k_bnd)
    complete = (pos + 1) // RATIO
    visible = torch.arange(S // RATIO) < complete[..., None]
    assert (scores[visible] == 0).float().mean() > 0.3
    blocks, count = streamed._training_selection(q_idx, k_bnd, None, None, pos, True,
                                                 streamed._visible_fn(None, pos))
    # the literal top-k of the path before streaming (unselectable blocks all -1): the real slots
    # agree
    bits = scores.float().contiguous().view(torch.int32).long()
    block = torch.arange(S // RATIO)
    key = torch.where(visible, (bits << 31) | (2**31 - 1 - block), -1)
    want = key.topk(BUDGET // RATIO, dim=-1).indices
    real = torch.arange(BUDGET // RATIO) < count[..., None]
    assert torch.equal(blocks[real], want[real])
    # every tie among a query's selectable blocks is broken toward the earlier one
    for b in range(B):
        for t in range(S):
            chosen = blocks[b, t, : count[b, t]].tolist()
            cutoff = scores[b, t, chosen].min() if chosen else None
            for j in range(int(complete[b, t])):
                if j not in chosen and cutoff is not None and scores[b, t, j] == cutoff:
                    assert all(c < j for c in chosen if scores[b, t, c] == cutoff)


def test_bf16_streamed_equals_the_materialised_path():
    streamed, reference = pair(3, "gather", chunk_elems=300)
    streamed.to(torch.bfloat16), reference.to(torch.bfloat16)
    x, pos = inputs(3, dtype=torch.bfloat16)
    got, want = run(streamed, x, pos), run(reference, x, pos)
    assert torch.equal(got[1].blocks_bsk, want[1].blocks_bsk)  # the scores are fp32 either way
    # the same selection, the same attention
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[4], want[4], rtol=1e-4, atol=1e-5)
    for name, g in got[3].items():  # relative to each gradient's own size (the indexer's are
        # ~1e-4: a fixed 2e-2 accepted an all-zero one)
        w = want[3][name].float()
        assert w.norm() > 0 and (g.float() - w).norm() <= 2e-2 * w.norm(), name


def test_query_chunks_cost_the_backward_nothing_per_chunk():
    """map_query_chunks (the indexer scores' query loop) cut into 64 chunks writes in backward what
    it writes in 4: a slice of the queries per chunk zero-filled them whole in backward, once per
    chunk (at the 256k stage's shape, ~130 chunks per QSA layer)."""
    from tandem.models.qsa_stream import map_query_chunks
    from tests.backward_cost import backward_elements

    written = []
    for chunks in (4, 64):
        q = torch.randn(2, 256, 4, 8, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        out = map_query_chunks(lambda part: part.square(), 256 // chunks, (q,))
        written.append(backward_elements(out.sum()))
    assert written[1] < 1.05 * written[0], written


def _gather_case(dtype):
    """Queries, slots (each query's own rows, some invalid, one row gathered twice) and keys."""
    g = torch.Generator().manual_seed(3)
    b, s, h, kvh, d, L = 2, 40, 4, 2, 8, 9
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = 2 * torch.randn(b, s, kvh, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, kvh, d, generator=g, dtype=torch.float64)
    idx = torch.randint(0, s, (b, s, L), generator=g)
    idx[..., 1] = idx[..., 0]
    ok = torch.rand(b, s, L, generator=g) < 0.7
    ok[..., 0] = True
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], idx, ok


@pytest.mark.parametrize("chunk", [40, 7, 1])
def test_gather_form_gradients_equal_plain_autograd(chunk):
    """The gather form's backward (its own, chunk by chunk, K and V accumulated into one buffer)
    against autograd through the attention written out over whole queries, in fp64: queries, keys
    and values, with invalid slots and a row gathered twice."""
    from tandem.models.qsa_tokens import gather_attend

    (q, k, v), idx, ok = _gather_case(torch.float64)
    b, s, h, d = q.shape
    kg = torch.stack([k[i, idx[i]] for i in range(b)])  # [B, S, L, KVH, D]
    vg = torch.stack([v[i, idx[i]] for i in range(b)])
    q5 = q.view(b, s, k.shape[2], -1, d)
    att = (torch.einsum("bckgd,bclkd->bckgl", q5, kg) * d ** -0.5).masked_fill(
        ~ok[:, :, None, None], float("-inf")).softmax(-1)
    want = torch.einsum("bckgl,bclkd->bckgd", att, vg).reshape(b, s, h * d)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=want.dtype)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = gather_attend(q, idx, ok, k, v, chunk)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, g, w in zip("qkv", torch.autograd.grad(got, (q, k, v), grad), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    # bf16 inputs: the gradients in their dtype, within bf16 rounding of the fp64 ones
    (qb, kb, vb), _, _ = _gather_case(torch.bfloat16)
    for g, w in zip(torch.autograd.grad(gather_attend(qb, idx, ok, kb, vb, chunk), (qb, kb, vb),
                                        grad.to(torch.bfloat16)), want_grads):
        assert g.dtype == torch.bfloat16
        assert (g.double() - w).norm() <= 2e-2 * w.norm()


def test_gather_form_key_value_gradients_cost_nothing_per_chunk():
    """The gather form cut into 40 query chunks writes in backward what it writes in 2 (within
    the recomputation): a checkpoint per chunk gave each chunk a gradient the size of the whole K
    and V, zero-filled and added, quadratic in the chunks."""
    from tandem.models.qsa_tokens import gather_attend
    from tests.backward_cost import backward_elements

    written = []
    for chunk in (20, 1):
        (q, k, v), idx, ok = _gather_case(torch.float32)
        written.append(backward_elements(gather_attend(q, idx, ok, k, v, chunk).sum()))
    assert written[1] < 1.1 * written[0], written
