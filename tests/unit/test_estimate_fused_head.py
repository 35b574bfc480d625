"""--check counts what the fused head holds from forward to backward: one fp32 [vocab x hidden]
weight gradient for every loss it computes (told their incoming gradients, as the trainer does), and
a [tokens x hidden] input gradient per loss. Counted here from a real forward of a tiny model, by
the tensors autograd saves for backward, against the estimate's difference between the fused and the
recomputing head."""

from __future__ import annotations

import pytest
import torch

from tandem.models import TandemModel
from tandem.trainer.estimate import GIB, estimate
from tandem.trainer.loss import depth_coefficients, loss_gradient
from tandem.trainer.recipe import load_config

V, H, S, B, K = 320, 32, 16, 2, 2
BASE = [f"model.vocab_size={V}", f"data.vocab_size={V}", f"model.hidden_size={H}",
        "model.num_layers=2",
        "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=64",
        "model.num_experts=0",
        "model.max_seq_len=64", f"mtp.num_steps={K}", f"data.seq_len={S}",
        f"train.micro_batch_size={B}", "train.dtype=fp32", "device=cpu", "mtp.loss_chunk_tokens=8"]


def held_head_gradients(extra):
    """[vocab x hidden] fp32 tensors autograd keeps for backward in one training forward."""
    cfg = load_config(None, BASE + extra)
    torch.manual_seed(0)
    model = TandemModel(cfg.model, cfg.mtp).train()
    scales = loss_gradient(torch.full((K + 1,), 10.0), depth_coefficients(cfg.mtp, 0))
    held = []

    def pack(t):
        if t.shape == (V, H) and t.dtype == torch.float32 and not isinstance(t,
                                                                             torch.nn.Parameter) \
                and t.data_ptr() != model.lm_head.weight.data_ptr():
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, V, (B, S + K)), loss_grad_scales=scales)
    return len(held)


@pytest.mark.parametrize("extra,fused_losses",
                         [([], K + 1), (["mtp.loss.objective=acceptance"], 1)])
def test_estimate_counts_the_fused_heads_held_gradients(extra, fused_losses):
    assert held_head_gradients(extra + ["mtp.loss_head_backward=fused"]) == 1
    assert held_head_gradients(extra + ["mtp.loss_head_backward=recompute"]) == 0
    fused, recompute = (estimate(load_config(None, BASE + extra + [f"mtp.loss_head_backward={b}"]),
                                 1)
                        for b in ("fused", "recompute"))
    held = V * H * 4 + fused_losses * S * B * H * 4
    assert (fused.activations_gib_per_rank
            - recompute.activations_gib_per_rank) * GIB == pytest.approx(held)


def test_the_vocab_parallel_head_holds_its_shard_of_the_weight_gradient():
    fused, recompute = (estimate(load_config(None, BASE + ["parallel.tp=2",
                                                           f"mtp.loss_head_backward={b}"]), 2)
                        for b in ("fused", "recompute"))
    held = V * H * 4 / 2 + (K + 1) * S * B * H * 4
    assert (fused.activations_gib_per_rank
            - recompute.activations_gib_per_rank) * GIB == pytest.approx(held)


def test_the_trainer_promises_the_heads_gradients():
    """TrainStep.forward_backward tells the head each depth's loss gradient for the step (one held
    weight gradient, not one per depth) and takes the promise back afterwards; its gradients are the
    recomputing head's."""
    from tandem.trainer.parallel import ParallelState
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    grads, held = {}, {}
    for mode in ("recompute", "fused"):
        cfg = load_config(None, BASE + [f"mtp.loss_head_backward={mode}", "train.seed=3"])
        pstate = ParallelState(device=resolve_device("cpu"))
        trainer = TrainStep(cfg, build_model(cfg, pstate), pstate)
        g = torch.Generator().manual_seed(0)
        batches = [{"tokens": torch.randint(0, V, (B, S + 1), generator=g),
                    "loss_mask": torch.ones(B, S),
                    "doc_ids": torch.zeros(B, S + 1, dtype=torch.long)} for _ in range(2)]
        counts = trainer.global_target_counts(batches)
        params = {p.data_ptr() for p in trainer.model.parameters()}
        held[mode] = []

        def pack(t, mode=mode):
            if t.shape == (V, H) and t.dtype == torch.float32 and t.data_ptr() not in params:
                held[mode].append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.forward_backward(batches, counts, depth_coefficients(cfg.mtp, 0))
        grads[mode] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    assert len(held["fused"]) == 2 and len(held["recompute"]) == 0  # one per micro-batch's forward
    for name, ref in grads["recompute"].items():
        torch.testing.assert_close(grads["fused"][name], ref, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype,device,tp",
                         [("fp32", "cpu", 1), ("bf16", "cuda", 1), ("bf16", "cuda", 2),
                                             ("bf16", "cpu", 1), ("bf16", "cpu", 4)])
def test_the_head_chunk_is_counted_as_the_buffers_the_head_allocates(dtype, device, tp):
    """The logits chunk the estimate adds on the head's rank is what models/loss.py's
    `_ChunkBuffers` allocates for one pass: the logits in the compute dtype and, in bf16, the fp32
    softmax block (the whole chunk on an accelerator, at most CPU_SOFTMAX_BLOCK_BYTES on a CPU).
    Sized so that the CPU block is smaller than the chunk."""
    from tandem.models.loss import _ChunkBuffers
    from tandem.trainer.estimate_bytes import head_chunk_bytes

    cfg = load_config(None,
                      BASE + [f"train.dtype={dtype}", f"device={device}", "model.vocab_size=65536",
                                    "data.vocab_size=65536", f"parallel.tp={tp}"])
    chunk = 128
    # an accelerator's buffers on the meta device (any device but a CPU gets one block per chunk)
    buffers = _ChunkBuffers(chunk, 65536 // tp,
                            torch.bfloat16 if dtype == "bf16" else torch.float32,
                            torch.device("cpu" if device == "cpu" else "meta"))
    allocated = buffers.logits.nbytes + (buffers.block.nbytes if buffers.block is not None else 0)
    assert head_chunk_bytes(cfg, chunk) == allocated
