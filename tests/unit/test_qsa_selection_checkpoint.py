"""QSA index reuse under activation checkpointing: MTP depth 1 hands its selection to depths 2..K as
a value, so a recomputed depth attends over the selection of its own forward. Every checkpointing
mode x reuse on/off x dense/sparse stage x eager/compiled gives the uncheckpointed run's losses and
gradients.

The bug this guards: the selection lived in module state set outside the checkpointed block, so
depth 1's recomputation in backward ran in `reuse` mode (left by the last depth), skipped the
indexer and saved a different number of tensors (CheckpointError at the first sparse step of a real
run)."""

from __future__ import annotations

import pytest
import torch

from tandem.models.qsa_loss import measuring_recall
from tandem.trainer.parallel import ParallelState
from tandem.trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from tandem.trainer.parallel.compile import apply_compile
from tandem.trainer.parallel.device import resolve_device
from tandem.trainer.recipe import load_config
from tandem.trainer.run import build_model as build_sharded

# A Qwen4-Exp trunk in miniature (Gated DeltaNet, QSA selecting 8 of 24 positions, 4 streams, PLE)
# with its QSA drafter at K = 3, so depths 2 and 3 both reuse.
OVERRIDES = [
    "model.vocab_size=300", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.intermediate_size=64", "model.moe_intermediate_size=16",
    "model.num_experts=4", "model.first_k_dense=0", "model.max_seq_len=64", "mtp.num_steps=3",
    "data.vocab_size=260", "data.seq_len=24", "model.full_attention_interval=2", "model.hc_count=4",
    "model.hc_lowrank=8", "model.zero_centered_norm=true", "model.head_dim=8",
    "model.partial_rotary_factor=0.5",
    "model.linear_num_key_heads=2", "model.linear_num_value_heads=4", "model.linear_key_head_dim=8",
    "model.linear_value_head_dim=8", "model.indexer_heads=2", "model.indexer_head_dim=8",
    "model.indexer_budget=8", "model.indexer_compress_ratio=4", "model.ple_layers=[0]",
    "model.heads_per_ngram=2", "model.ngram_vocab_base=97", "model.eos_token_id=1",
]


def _model(reuse: bool):
    # the indexer's KL rides on each QSA layer's backward
    cfg = load_config(None, OVERRIDES + [f"mtp.qsa_reuse_indices={str(reuse).lower()}",
                                         "model.indexer_loss_coef=0.1"])
    torch.manual_seed(0)
    return build_sharded(cfg, ParallelState(device=resolve_device("cpu"))).train()


def _step(model, dense: bool = False):
    tokens = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(0))
    out = model(tokens, qsa_dense=dense)
    out.loss_sums.sum().backward()
    return out.loss_sums.detach(), {n: p.grad.clone() for n,
                                    p in model.named_parameters() if p.grad is not None}


def _run(mode: str, reuse: bool, dense: bool, compiled: bool):
    model = _model(reuse)
    if compiled:
        apply_compile(model, backend="eager")  # dynamo capture, as train.compile
    if mode != "none":
        apply_activation_checkpointing(model, mode)
    return _step(model, dense)


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_checkpointed_equals_uncheckpointed(reuse, dense):
    ref_losses, ref_grads = _run("none", reuse, dense, compiled=False)
    indexer = [n for n in ref_grads if n.startswith("mtp.") and ".indexer." in n]
    # depth 1's KL is live
    assert indexer and all(float(ref_grads[n].abs().sum()) > 0 for n in indexer)
    # compiled once, where the crash was (tracing is most of this test's time)
    cases = [("full", False),
             ("selective", False)] + ([("full", True)] if reuse and not dense else [])
    for mode, compiled in cases:
        losses, grads = _run(mode, reuse, dense, compiled)
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0,
                                   msg=f"{mode} compiled={compiled}")
        assert set(grads) == set(ref_grads)
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=f"{name} ({mode}, compiled={compiled})")


def test_reuse_changes_the_later_depths():
    """The hand-over is live: with reuse the later depths' losses differ from selecting for
    themselves (and depth 1's does not), so the equality above compares two different
    computations."""
    with_reuse, _ = _run("none", True, False, False)
    own, _ = _run("none", False, False, False)
    assert torch.equal(with_reuse[:2], own[:2])
    assert all(abs(float(with_reuse[d] - own[d])) > 1e-6 for d in (2, 3))


def test_reusing_depths_run_no_indexer():
    """In the sparse stage depths 2 and 3, handed depth 1's selection, run no indexer (nor, under
    context parallelism, gather its keys: tests/e2e/test_context_bench.py counts the bytes), and
    nothing changes for it: the losses and gradients equal those of a forward whose every depth runs
    the indexer (measuring recall, which scores it, makes them)."""
    model = _model(reuse=True)
    calls = []
    model.mtp.layers[0].block.self_attn.indexer.register_forward_hook(lambda *_: calls.append(1))
    losses, grads = _step(model)
    assert len(calls) == 1
    model.zero_grad(set_to_none=True)
    with measuring_recall():
        all_losses, all_grads = _step(model)
    assert len(calls) == 1 + 3
    torch.testing.assert_close(losses, all_losses, rtol=0, atol=0)
    assert set(grads) == set(all_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], all_grads[name], rtol=0, atol=0, msg=name)
