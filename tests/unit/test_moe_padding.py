"""Padding (`data.packing=pad`, the tail of the last packed window) is routed and computed like any
token, but MoE layers leave it out of their load counters (the aux-free bias step,
`moe/max_over_mean_load`) and of the balance and z losses, and QSA indexers out of their KL, as
they leave out each MTP depth's rows whose input token lies past the record: a record padded to a
longer window, with any ids, gives at every MoE and QSA layer of the trunk and the MTP chain the
loads, auxiliary losses and gradients of the record alone. The padding flag comes from the chat
windows (`ChatWindows`, both packings) through `get_batch`; the layout suites
(tests/distributed/worker.py `global_batch`) pad rows across the SP shard, chunk and stage edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.data_pipeline.batches import get_batch
from tandem.data_pipeline.chat_dataset import ChatWindows
from tandem.models import MTPConfig, TandemModel, flavors
from tandem.models.moe import MoE
from tandem.models.qsa import IndexedAttention

EOD = 0
AUX = {"balance": "aux_loss", "aux_loss_coef": 0.1, "z_loss_coef": 0.01}


def _model(flavor: str) -> TandemModel:
    torch.manual_seed(0)
    overrides = dict(AUX, vocab_size=64)
    if flavor == "debug":
        overrides.update(num_experts=4, top_k=2, max_seq_len=256)
    model = TandemModel(flavors.model_config(flavor, **overrides), MTPConfig(num_steps=2,
                                                                             num_layers=1))
    with torch.no_grad():  # routers away from their init, so that the loads are uneven
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
    return model.train()


def _window(record: torch.Tensor, pad: int, fill: int = EOD):
    """The record (ending in EOD) as one window padded with `pad` inputs of id `fill` (ChatWindows
    pads with EOD), as ChatWindows lays it out: the loss on the record's targets, the padding a
    document of its own."""
    n = len(record)
    tokens = torch.cat([record, torch.full((pad + 1,), fill)])[None]
    loss_mask = torch.zeros(1, n + pad)
    loss_mask[0, : n - 1] = 1.0
    doc_ids = (torch.arange(n + pad + 1) >= n).long()[None]
    padding = (torch.arange(n + pad) >= n)[None]
    return tokens, loss_mask, doc_ids, padding


def _train_forward(model: TandemModel, window, with_padding: bool = True):
    tokens, loss_mask, doc_ids, padding = window
    model.zero_grad(set_to_none=True)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.router.tokens_per_expert.zero_()
    out = model(tokens, loss_mask, doc_ids, document_mask=True,
                padding_bs=padding if with_padding else None)
    out.loss_sums.sum().backward()
    return {
        "loss_sums": out.loss_sums.detach(),
        "loads": [m.router.tokens_per_expert.clone() for m in moes],
        "aux": [m.last_aux_loss for m in moes]
        + [m.last_indexer_loss for m in model.modules() if isinstance(m, IndexedAttention)],
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen4"])
def test_a_padded_record_counts_as_the_record_alone(flavor):
    model = _model(flavor)
    g = torch.Generator().manual_seed(3)
    record = torch.cat([torch.randint(2, 64, (22,), generator=g), torch.tensor([EOD])])
    alone = _train_forward(model, _window(record, 0))
    # padded with other ids than the window past the record alone holds: the MTP depths of the
    # record's last rows read the padding, and count in no load, auxiliary loss or indexer KL
    padded = _train_forward(model, _window(record, 17, fill=5))
    # the MTP layer's MoE too: trunk layers and the looped layer, each counted once per depth
    assert len(alone["loads"]) >= 2
    for a, b in zip(alone["loads"], padded["loads"]):
        assert torch.equal(a, b), (a, b)
    assert sum(float(a.sum()) for a in alone["loads"]) > 0
    for a, b in zip(alone["aux"], padded["aux"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(padded["loss_sums"], alone["loss_sums"], rtol=1e-5, atol=1e-6)
    assert alone["grads"].keys() == padded["grads"].keys()
    for name, grad in alone["grads"].items():
        # (fp32 sums over windows of other lengths: rounding, relative to the tensor's scale)
        torch.testing.assert_close(padded["grads"][name], grad, rtol=1e-4,
                                   atol=1e-5 * float(grad.abs().max()),
                                   msg=lambda m: f"{name}: {m}")
    # without the flag the padding counts: loads, aux losses and router gradients all move
    unflagged = _train_forward(model, _window(record, 17), with_padding=False)
    assert any(not torch.equal(a, b) for a, b in zip(alone["loads"], unflagged["loads"]))
    assert any(abs(float(a) - float(b)) > 1e-4 * abs(float(a))
               for a, b in zip(alone["aux"], unflagged["aux"]))


@pytest.mark.parametrize("packing", ["pad", "pack"])
def test_chat_windows_flag_the_padding_inputs(packing):
    records = [("a.jsonl:1", np.array([5, 6, 7, EOD]), np.array([0, 1, 1, 1], dtype=np.uint8)),
               ("a.jsonl:2", np.array([8, 9, EOD]), np.array([0, 1, 1], dtype=np.uint8))]
    windows = ChatWindows(records, seq_len=5, packing=packing, eod_id=EOD)
    batch = get_batch(windows, range(len(windows)))
    want = ([[False] * 4 + [True], [False] * 3 + [True] * 2] if packing == "pad"
            # the stream 5 6 7 EOD 8 9 EOD, cut into windows of 6 with one token of overlap: the
            # second window's inputs are 9 EOD and three padding EODs
            else [[False] * 5, [False, False, True, True, True]])
    assert batch["padding"].tolist() == want
    assert batch["padding"].dtype == torch.bool
    # padding never carries a target
    assert not (batch["loss_mask"].bool() & batch["padding"]).any()


def test_a_sample_without_the_flag_has_no_padding():
    """(A batch of samples of which only some carry the flag kept none: every other sample's
    padding then counted.)"""
    flagged = {"tokens": torch.tensor([5, 6, EOD]), "labels": torch.tensor([6, EOD, EOD]),
               "loss_mask": torch.tensor([1.0, 0.0, 0.0]),
               "padding": torch.tensor([False, False, True])}
    plain = {k: v for k, v in flagged.items() if k != "padding"}
    batch = get_batch([flagged, plain], [0, 1], eod_id=EOD)
    assert batch["padding"].tolist() == [[False, False, True], [False, False, False]]


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balance_and_z_loss_values_are_the_formulas(score):
    """DeepSeek-V3's sequence balance loss, coef * E * sum_i f_i * P_i (f_i: the share of the T*k
    routed copies expert i took; P_i: the mean over tokens of its score normalised over the
    experts), plus the z loss, coef * mean_t logsumexp(logits_t)^2, written out by hand: the tests
    above only compared the loss with itself (padded and not), so a wrong formula passed them."""
    torch.manual_seed(0)
    cfg = flavors.model_config("debug", num_experts=4, top_k=2, balance="aux_loss",
                               aux_loss_coef=0.1, z_loss_coef=0.01, router_score=score)
    moe = MoE(cfg).train()
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.5)
    x = torch.randn(3, 5, cfg.hidden_size)
    moe(x)
    logits = x.reshape(-1, cfg.hidden_size) @ moe.router.weight.detach().T
    scores = logits.sigmoid() if score == "sigmoid" else logits.softmax(-1)
    share = torch.bincount(scores.topk(2, dim=-1).indices.flatten(), minlength=4).float() / (15 * 2)
    mean_score = (scores / scores.sum(-1, keepdim=True)).mean(0)
    want = 0.1 * 4 * (share * mean_score).sum() + 0.01 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(moe.last_aux_loss, want, rtol=1e-5, atol=1e-7)
