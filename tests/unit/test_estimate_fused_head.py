"""--check counts what the fused head holds from forward to backward: one fp32 [vocab x hidden] weight
gradient for every loss it computes (told their incoming gradients, as the trainer does), and a
[tokens x hidden] input gradient per loss. Counted here from a real forward of a tiny model, by the
tensors autograd saves for backward, against the estimate's difference between the fused and the
recomputing head."""

from __future__ import annotations

import pytest
import torch

from tandem.models import TandemModel
from tandem.trainer.config import load_config
from tandem.trainer.estimate import GIB, estimate
from tandem.trainer.loss import depth_coefficients, loss_gradient

V, H, S, B, K = 320, 32, 16, 2, 2
BASE = [f"model.vocab_size={V}", f"data.vocab_size={V}", f"model.hidden_size={H}", "model.num_layers=2",
        "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=64", "model.num_experts=0",
        "model.max_seq_len=64", f"mtp.num_steps={K}", f"data.seq_len={S}", f"train.micro_batch_size={B}",
        "train.dtype=fp32", "device=cpu", "mtp.loss_chunk_tokens=8"]


def held_head_gradients(extra):
    """[vocab x hidden] fp32 tensors autograd keeps for backward in one training forward."""
    cfg = load_config(None, BASE + extra)
    torch.manual_seed(0)
    model = TandemModel(cfg.model, cfg.mtp).train()
    model.loss_grad_scales = loss_gradient(torch.full((K + 1,), 10.0), depth_coefficients(cfg.mtp, 0))
    held = []

    def pack(t):
        if t.shape == (V, H) and t.dtype == torch.float32 and not isinstance(t, torch.nn.Parameter) \
                and t.data_ptr() != model.lm_head.weight.data_ptr():
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, V, (B, S + K)))
    return len(held)


@pytest.mark.parametrize("extra,fused_losses", [([], K + 1), (["mtp.loss.objective=acceptance"], 1)])
def test_estimate_counts_the_fused_heads_held_gradients(extra, fused_losses):
    assert held_head_gradients(extra + ["mtp.loss_head_backward=fused"]) == 1
    assert held_head_gradients(extra + ["mtp.loss_head_backward=recompute"]) == 0
    fused, recompute = (estimate(load_config(None, BASE + extra + [f"mtp.loss_head_backward={b}"]), 1)
                        for b in ("fused", "recompute"))
    held = V * H * 4 + fused_losses * S * B * H * 4
    assert (fused.activations_gib_per_rank - recompute.activations_gib_per_rank) * GIB == pytest.approx(held)


def test_the_vocab_parallel_head_holds_its_shard_of_the_weight_gradient():
    fused, recompute = (estimate(load_config(None, BASE + ["parallel.tp=2", f"mtp.loss_head_backward={b}"]), 2)
                        for b in ("fused", "recompute"))
    held = V * H * 4 / 2 + (K + 1) * S * B * H * 4
    assert (fused.activations_gib_per_rank - recompute.activations_gib_per_rank) * GIB == pytest.approx(held)
