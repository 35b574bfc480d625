"""The per-depth losses keep every row and mask the targets (models/loss.py IGNORE): no host sync in
the loss, and the loss region traces into one graph; the values and gradients are those of the loss
over the valid rows only (the reference below selects them, as the model did before)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.models import ModelConfig, MTPConfig, TandemModel, depth_target_mask
from tandem.models.loss import acceptance_loss_sum
from tandem.models.mtp import shifted_tokens
from tandem.trainer.loss import combine_losses

VOCAB, S = 97, 12

# name -> (mtp.loss.objective, model.distill, mtp.loss_head_backward)
OBJECTIVES = {
    "ce": ("ce", "none", "recompute"),
    "ce_fused": ("ce", "none", "fused"),
    "acceptance": ("acceptance", "none", "recompute"),
    "distill_soft": ("ce", "soft", "recompute"),
    "distill_argmax": ("ce", "argmax", "fused"),
}


def make(objective: str, mtp_moe: bool = True) -> TandemModel:
    kind, distill, head_backward = OBJECTIVES[objective]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2,
                      first_k_dense=1, max_seq_len=64)
    mtp = MTPConfig(num_steps=3, num_layers=1, loss_chunk_tokens=7,
                    loss_head_backward=head_backward, moe=mtp_moe)
    mtp.loss.objective = kind
    mtp.loss.acceptance_ce_weight = 0.5 if kind == "acceptance" else 0.0
    model = TandemModel(cfg, mtp, distill=distill)
    return model.train()


def batch():
    """Two rows of S+1 tokens with masked targets and a document boundary: every depth has rows
    without a target, not only the window's tail."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, S + 1), generator=g)
    loss_mask = torch.ones(2, S)
    loss_mask[0, 2] = loss_mask[1, 7] = 0
    doc_ids = torch.zeros(2, S + 1, dtype=torch.long)
    doc_ids[1, 6:] = 1  # token 5 of row 1 ends a document
    return tokens, loss_mask, doc_ids


# --- host syncs -----------------------------------------------------------------------------------
class SyncingOps(TorchDispatchMode):
    """Counts the ops that make the host wait for an accelerator: reading a value (`.item()`,
    `.tolist()`, `bool(t)`), an output whose size depends on the data (boolean-mask indexing and its
    backward's scatter, `nonzero`, `masked_select`, `repeat_interleave` without `output_size`,
    `unique`), and a tensor built from host data (`torch.tensor(list, device=...)`: a blocking
    host-to-device copy). On a CPU these run without waiting; the count is what an accelerator would
    wait for."""

    DATA_SIZED = ("aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique",
                  "aten._unique2", "aten.unique_consecutive", "aten.unique_dim")

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __enter__(self):
        # `Tensor.tolist` reads the values without passing through the dispatcher: counted here
        self._tolist = torch.Tensor.tolist
        counter, tolist = self.calls, self._tolist

        def counted_tolist(t):
            counter["Tensor.tolist"] += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.calls[f"{name} (boolean mask)"] += 1
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            self.calls[name] += 1
        elif name in ("aten._local_scalar_dense", "aten.lift_fresh") or name in self.DATA_SIZED:
            self.calls[name] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_the_loss_makes_no_host_sync(objective):
    """From the trunk's hidden state to the combined loss and back through it: nothing that waits
    for the device (it was two syncs per depth forward and one backward, 12 per micro-batch at K=3,
    plus the loss coefficients' host-to-device copy)."""
    model = make(objective)
    tokens, loss_mask, doc_ids = batch()
    pos = torch.arange(S).expand(2, S)
    h0 = model.trunk(tokens[:, :S], pos)
    counter = SyncingOps()
    with counter:
        out = model.losses_from_hidden(h0, tokens, loss_mask, doc_ids, pos)
        combine_losses(out.loss_sums, out.token_counts, [1.0, 0.5, 0.25, 0.125]).backward()
    assert not counter.calls, dict(counter.calls)


def test_the_detector_counts_every_kind_of_sync():
    with SyncingOps() as counter:
        x = torch.arange(4.0)
        x.tolist()
        x.sum().item()
        x[x > 1].sum()
    assert counter.calls == {"Tensor.tolist": 1, "aten._local_scalar_dense": 1,
                             "aten.index (boolean mask)": 1}


def test_a_qwen4_training_step_syncs_only_where_eager_qsa_sizes_its_selection():
    """The whole Qwen4-Exp model (Gated DeltaNet, QSA, PLE, hyper-connections, MoE, the MTP chain)
    on packed documents, forward and backward: the one sync is eager QSA's read of how many block
    columns each query chunk reaches (models/qsa_stream.py stream_select; none under
    torch.compile), at most one per selecting QSA forward."""
    from tandem.models.qsa import IndexedAttention
    from tests.eval_helpers import tiny_qwen4_model

    model = tiny_qwen4_model(3).train()
    forwards = []
    for layer in model.modules():
        if isinstance(layer, IndexedAttention):
            layer.register_forward_pre_hook(lambda *_: forwards.append(1))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 64, (2, 41), generator=g)
    doc_ids = (torch.arange(41) >= 17).long().expand(2, 41)
    counter = SyncingOps()
    with counter:
        out = model(tokens, doc_ids_bs1=doc_ids, document_mask=True)
        combine_losses(out.loss_sums, out.token_counts, [1.0, 0.1, 0.1, 0.1]).backward()
    assert set(counter.calls) <= {"Tensor.tolist"}, dict(counter.calls)
    assert 0 < counter.calls["Tensor.tolist"] <= len(forwards), (dict(counter.calls), forwards)


# --- values and gradients: the valid rows' loss ---------------------------------------------------
def reference_sums(model: TandemModel, tokens, loss_mask, doc_ids) -> torch.Tensor:
    """Per-depth loss sums over the valid rows only, selected by boolean mask, each objective
    written out from its definition (cross-entropy, soft cross-entropy, the acceptance loss's own
    function)."""
    pos = torch.arange(S).expand(2, S)
    h0 = model.trunk(tokens[:, :S], pos)
    teacher = model.norm(h0.detach()).detach()
    w = model.lm_head.weight
    objective, ce_weight = model.mtp_cfg.loss.objective, model.mtp_cfg.loss.acceptance_ce_weight
    sums = []
    for depth, h in model.depth_states(h0, tokens, pos):
        mask = depth_target_mask(loss_mask, doc_ids, depth)
        hn = model.final_norm(depth, h)[mask]
        targets = shifted_tokens(tokens, depth + 1, S)[mask]
        # the trunk at t+depth
        teach = torch.cat([teacher[:, depth:], teacher[:, :depth]], dim=1)[mask]
        if depth == 0:
            sums.append(F.cross_entropy(F.linear(hn, w).float(), targets, reduction="sum"))
        elif model.distill == "argmax":
            teacher_ids = F.linear(teach, w).argmax(-1)
            sums.append(F.cross_entropy(F.linear(hn, w).float(), teacher_ids, reduction="sum"))
        elif model.distill == "soft":
            p = F.linear(teach, w.detach()).float().softmax(-1)  # the teacher takes no gradient
            sums.append(-(p * F.linear(hn, w).float().log_softmax(-1)).sum())
        elif objective == "acceptance":
            sums.append(acceptance_loss_sum(hn, teach, w, targets, ce_weight))
        else:
            sums.append(F.cross_entropy(F.linear(hn, w).float(), targets, reduction="sum"))
    return torch.stack(sums)


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_losses_and_gradients_are_the_valid_rows_ones(objective):
    tokens, loss_mask, doc_ids = batch()
    results = []
    for use_model in (True, False):
        model = make(objective)
        if use_model:
            sums = model(tokens, loss_mask, doc_ids).loss_sums
        else:
            sums = reference_sums(model, tokens, loss_mask, doc_ids)
        (sums * torch.tensor([1.0, 0.5, 0.25, 0.125])).sum().backward()
        results.append((sums.detach(),
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (got, got_grads), (ref, ref_grads) = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert set(got_grads) == set(ref_grads)
    # fp32 sums in another order: absolute error scales with the gradient
    for name, g in got_grads.items():
        scale = max(1.0, ref_grads[name].abs().max().item())
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_token_counts_stay_on_the_device_and_count_valid_targets():
    model = make("ce")
    tokens, loss_mask, doc_ids = batch()
    out = model(tokens, loss_mask, doc_ids)
    expected = [int(depth_target_mask(loss_mask, doc_ids, d).sum()) for d in range(4)]
    assert out.token_counts.tolist() == expected and expected[3] < expected[0] < 2 * S


# --- one graph ------------------------------------------------------------------------------------
def test_the_loss_region_compiles_into_one_graph():
    """torch.compile(fullgraph=True) traces the loss region (the MTP depths, the chunked head
    losses, the counts) forward and backward: boolean-mask selection broke it (a data-dependent
    shape). Values and gradients as eager. The MTP block is dense here: tracing a MoE block is the
    regional compile's business (trainer/parallel/compile.py) and would only make this test
    slower."""
    tokens, loss_mask, doc_ids = batch()
    pos = torch.arange(S).expand(2, S)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make("ce", mtp_moe=False)
        h0 = model.trunk(tokens[:, :S], pos)
        fn = torch.compile(model.losses_from_hidden, fullgraph=True,
                           backend="aot_eager") if compiled \
            else model.losses_from_hidden
        out = fn(h0, tokens, loss_mask, doc_ids, pos)
        combine_losses(out.loss_sums, out.token_counts, [1.0, 0.5, 0.25, 0.125]).backward()
        results.append((out.loss_sums.detach(), out.token_counts,
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager, eager_counts, eager_grads), (comp, comp_counts, comp_grads) = results
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(comp_counts, eager_counts)
    assert set(comp_grads) == set(eager_grads)
    for name, g in comp_grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
