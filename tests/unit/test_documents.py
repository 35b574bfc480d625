"""data.document_mask: a document packed into a window computes, per token and per depth, what it
computes alone at position 0 (every layer kind: Gated DeltaNet's state and conv, QSA's blocks and
selection, PLE's conv, attention, positions, the MTP chain), and the trainer's packed loss equals
the lone documents' losses summed. The lone document itself is the sequence the transformers parity
tests (test_qwen4_exp.py) check Tandem on."""

from __future__ import annotations

import pytest
import torch

from tandem.models.documents import Documents, causal_conv_taps
from tandem.models.model import window_documents, window_positions
from tests.eval_helpers import tiny_model, tiny_qwen4_model

EOS = 1
# boundaries off the QSA block grid (r = 4), a 1-token document, one past the budget
LENGTHS = [7, 13, 1, 22, 9]


def _packed(vocab: int, seed: int = 0, eos: bool = True):
    """Documents ending in EOS and their doc ids, or (`eos` False) ending in any token, with the
    boundaries only in the doc ids (records of a Megatron prefix made without --append-eod)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(2, vocab, (n - 1,), generator=g),
                       torch.tensor([EOS if eos else 3])]) for n in LENGTHS]
    # a run of one token inside the long document: Gated DeltaNet's hardest input
    docs[3][4:14] = 5
    tokens = torch.cat(docs)[None]
    if not eos:
        return docs, tokens, torch.repeat_interleave(torch.arange(len(LENGTHS)),
                                                     torch.tensor(LENGTHS))[None]
    is_eod = (tokens == EOS).long()
    return docs, tokens, torch.cumsum(is_eod, 1) - is_eod


@torch.no_grad()
def _depth_logits(model, tokens_bs1, doc_ids_bs1=None):
    b, s = tokens_bs1.shape[0], tokens_bs1.shape[1] - 1
    documents = window_documents(doc_ids_bs1, s)
    pos = window_positions(documents, b, s, tokens_bs1.device)
    extra = {} if documents is None else {"documents": documents}
    h0 = model.trunk(tokens_bs1[:, :s], pos, **extra)
    return [model.logits(d, h) for d, h in model.depth_states(h0, tokens_bs1, pos, **extra)]


@pytest.mark.parametrize("family", ["qwen4", "qwen4_no_reuse", "dense", "qwen4_no_eos"])
def test_packed_document_equals_lone_document(family):
    """(`qwen4_no_eos`: PLE's n-grams, which end at an EOS as transformers' do, read across a
    boundary that only the doc ids mark, by up to 2.8 in a log-probability.)"""
    if family == "dense":
        model = tiny_model(num_steps=3, vocab=64)
    else:
        model = tiny_qwen4_model(3, vocab=64, reuse_indices=family != "qwen4_no_reuse")
    docs, tokens, doc_ids = _packed(64, eos=family != "qwen4_no_eos")
    packed = _depth_logits(model, tokens, doc_ids)
    unmasked = _depth_logits(model, tokens)
    start, compared = 0, 0
    for d_i, doc in enumerate(docs):
        n = len(doc)
        if n >= 2:
            lone = _depth_logits(model, doc[None])
            for depth, logits in enumerate(lone):
                # positions whose depth-`depth` target lies inside the document
                valid = n - 1 - depth
                if valid <= 0:
                    continue
                got = packed[depth][0, start : start + valid]
                torch.testing.assert_close(got, logits[0, :valid], rtol=1e-4, atol=1e-5,
                                           msg=f"document {d_i} depth {depth}")
                compared += valid
                # without the mask a later document sees the earlier ones
                if d_i > 0 and depth == 0:
                    assert (unmasked[0][0, start : start + valid]
                            - logits[0, :valid]).abs().max() > 1e-3
        start += n
    assert compared > 60


@pytest.mark.parametrize("family", ["qwen4", "dense"])
def test_packed_loss_equals_the_lone_documents_losses_summed(family):
    """The training forward's per-depth loss sums and target counts over the packed window, under
    data.document_mask, are those of each document trained alone, summed."""
    model = tiny_model(3, vocab=64) if family == "dense" else tiny_qwen4_model(3, vocab=64)
    docs, tokens, doc_ids = _packed(64)
    with torch.no_grad():
        packed = model(tokens, doc_ids_bs1=doc_ids, document_mask=True)
        lone = [model(doc[None]) for doc in docs if len(doc) >= 2]
    counts = sum(out.token_counts for out in lone)
    assert torch.equal(packed.token_counts, counts) and counts[-1] > 0
    torch.testing.assert_close(packed.loss_sums, sum(out.loss_sums for out in lone), rtol=1e-5,
                               atol=1e-4)


def test_documents_from_doc_ids_and_positions():
    doc_ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2]])
    docs = Documents.from_doc_ids(doc_ids)
    assert docs.starts_bs.tolist() == [[0, 0, 0, 3, 4, 4, 4, 4]]
    assert docs.positions().tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert torch.equal(Documents.from_positions(docs.positions()).starts_bs, docs.starts_bs)
    mask = docs.attention_mask()[0, 0]
    assert mask[5].tolist() == [False, False, False, False, True, True, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_taps_equal_conv1d_within_a_document(dtype):
    """One document: the tap form is F.conv1d with left zero padding (dilation 1 and 3); two
    documents: each restarts from zeros. In fp64 to fp64 rounding: the taps were summed in fp32,
    so an fp64 run's packed document differed from itself alone by 1.5e-7 (and gradcheck of PLE
    over documents failed)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 20, 6, generator=g, dtype=dtype), torch.randn(6, 1, 4, generator=g,
                                                                        dtype=dtype)
    tol = {} if dtype == torch.float32 else dict(rtol=1e-13, atol=1e-13)
    for dilation in (1, 3):
        pad = (w.shape[-1] - 1) * dilation
        ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (pad, 0)), w,
                                         groups=6, dilation=dilation).transpose(1, 2)
        pos = torch.arange(20).expand(2, 20)
        torch.testing.assert_close(causal_conv_taps(x, w[:, 0], pos, dilation), ref, **tol)
        split = torch.cat([torch.arange(8), torch.arange(12)]).expand(2, 20)
        second = causal_conv_taps(x[:, 8:], w[:, 0], torch.arange(12).expand(2, 12), dilation)
        torch.testing.assert_close(causal_conv_taps(x, w[:, 0], split, dilation)[:, 8:], second)


def test_packed_documents_convolve_in_autocasts_dtype():
    """Under bf16 autocast the tap form gives what conv1d gives (bf16, from bf16-rounded inputs),
    and a Gated DeltaNet layer handed one document computes what it computes without documents,
    its delta rule on bf16 inputs (what fla takes). The taps came out fp32 (bf16 activations times
    the fp32 weight): the rule ran on fp32, so fla was passed over on CUDA, and the output differed
    from the unpacked forward's by 0.017 on values of 0.77."""
    from tandem.models.gated_deltanet import GatedDeltaNet

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 20, 6, generator=g), torch.randn(6, 1, 4, generator=g)
    pos = torch.arange(20).expand(2, 20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), w,
                                         groups=6).transpose(1, 2)
        taps = causal_conv_taps(x.bfloat16(), w[:, 0], pos)
    assert ref.dtype == taps.dtype == torch.bfloat16
    torch.testing.assert_close(taps, ref, rtol=1e-2, atol=1e-2)

    layer = next(m for m in tiny_qwen4_model(1, vocab=64).modules()
                 if isinstance(m, GatedDeltaNet))
    seen = []
    rule = layer._chunked
    layer._chunked = lambda q, k, v, *a, **kw: seen.append(v.dtype) or rule(q, k, v, *a, **kw)
    h = torch.randn(1, 24, layer.in_proj_qkv.in_features, generator=g)
    one_doc = Documents.from_doc_ids(torch.zeros(1, 24, dtype=torch.long))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = layer(h, torch.arange(24)[None])
        packed = layer(h, one_doc.positions(), documents=one_doc)
    assert seen == [torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(packed.float(), plain.float(), rtol=2e-2, atol=4e-3)


def test_flas_cu_seqlens_are_found_once_per_window():
    """fla's variable-length Gated DeltaNet (CUDA) reads where the documents start in the rows laid
    end to end: a host sync (`nonzero`), once per window now, where it was once per layer (36 a
    forward in the flagship)."""
    from tandem.models.documents import flat_cu_seqlens
    from tests.unit.test_loss_syncs import SyncingOps

    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    docs = Documents.from_doc_ids(doc_ids)
    first = flat_cu_seqlens(docs)
    assert first.dtype == torch.int32 and first.tolist() == [0, 3, 5, 6, 7, 12]
    with SyncingOps() as counter:
        again = flat_cu_seqlens(docs)
    assert again is first and not counter.calls
    assert flat_cu_seqlens(Documents.from_doc_ids(doc_ids + 0)).tolist() == first.tolist()
