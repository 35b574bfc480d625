"""train.activation_checkpointing: the same losses, gradients and router loads as without it, fewer
saved activations, unchanged parameter names."""

from __future__ import annotations

import pytest
import torch

from tandem.trainer.config import load_config
from tandem.trainer.loop import build_model as build_sharded
from tandem.trainer.parallel import ParallelState
from tandem.trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from tandem.trainer.parallel.device import resolve_device


def build_model(cfg):
    """The trainer's one-process build (which applies cfg.train.activation_checkpointing itself)."""
    return build_sharded(cfg, ParallelState(device=resolve_device("cpu")))

OVERRIDES = ["model.vocab_size=300", "model.hidden_size=32", "model.num_layers=3", "model.num_heads=4",
             "model.num_kv_heads=2", "model.intermediate_size=64", "model.moe_intermediate_size=16",
             "model.num_experts=4", "model.first_k_dense=1", "model.max_seq_len=64", "mtp.num_steps=2",
             "data.vocab_size=260", "data.seq_len=24", "model.balance=aux_loss", "model.z_loss_coef=0.001"]


def _run(mode: str):
    cfg = load_config(None, OVERRIDES + [f"train.activation_checkpointing={mode}"])
    model = build_model(cfg)
    apply_activation_checkpointing(model, mode)
    model.train()
    tokens = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(0))
    saved_bytes = []

    def pack(t):
        saved_bytes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    out.loss_sums.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.router.tokens_per_expert.clone() for m in model.moe_layers()]
    return out.loss_sums.detach(), grads, loads, sum(saved_bytes), model


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_losses_gradients_and_router_loads(mode):
    ref_losses, ref_grads, ref_loads, ref_saved, ref_model = _run("none")
    losses, grads, loads, saved, model = _run(mode)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    # a recomputation must not count the routed tokens a second time
    for got, ref in zip(loads, ref_loads):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert float(sum(l.sum() for l in loads)) > 0
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref_model.named_parameters()]
    # the point of it: far fewer bytes saved for backward (full keeps block inputs only)
    assert saved < (0.5 if mode == "full" else 0.9) * ref_saved, (saved, ref_saved)


def test_mtp_blocks_are_wrapped_and_eval_bypasses_checkpointing():
    from tandem.trainer.parallel.activation_checkpoint import checkpointed_blocks

    cfg = load_config(None, OVERRIDES)
    model = build_model(cfg)
    apply_activation_checkpointing(model, "full")
    blocks = checkpointed_blocks(model)
    assert len(blocks) == 3 + 1 and all(b._tandem_checkpointed for b in blocks)
    assert model.mtp.layers[0].block in blocks
    with torch.no_grad():  # decoding: no recomputation machinery at all
        h = model.trunk(torch.zeros(1, 4, dtype=torch.long), torch.arange(4).unsqueeze(0))
    assert h.shape == (1, 4, 32)


def test_bad_mode_is_a_config_error():
    from tandem.trainer.config import ConfigError

    with pytest.raises(ConfigError, match="train.activation_checkpointing.*must be none, full or selective"):
        load_config(None, OVERRIDES + ["train.activation_checkpointing=some"])
