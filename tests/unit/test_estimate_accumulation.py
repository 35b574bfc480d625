"""--check's memory in both gradient-sync modes (`parallel.reshard_after_microbatch`): one sync per
step holds every FSDP-managed parameter's unsharded fp32 gradient and gathered copy between
micro-batches, which the default (reduce-scatter and reshard every micro-batch) does not. The
difference is worked out here by hand from the parameter counts of the model itself (on the meta
device); the estimate's figures against measured peaks are bench/fsdp_accumulation_memory.py's."""

from __future__ import annotations

import pytest
import torch

from tandem.models import TandemModel
from tandem.trainer.estimate import GIB, estimate
from tandem.trainer.recipe import load_config

# a dense trunk of 6 equal layers, small activations (8 tokens per micro-batch) against the
# parameters
BASE = ["model.vocab_size=320", "data.vocab_size=320", "model.hidden_size=64", "model.num_layers=6",
        "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=256",
        "model.num_experts=0",
        "model.max_seq_len=64", "mtp.num_steps=1", "data.seq_len=8", "train.micro_batch_size=1",
        "train.grad_accum_steps=4", "train.dtype=bf16", "device=cpu"]


def both_modes(*extra, world: int):
    """(default estimate, one-sync estimate, the model's parameter counts by top-level piece /
    layer)."""
    est = {every: estimate(load_config(None, BASE + list(extra)
                                       + [f"parallel.reshard_after_microbatch={every}"]),
                           world) for every in ("true", "false")}
    with torch.device("meta"):
        model = TandemModel(load_config(None, BASE).model, load_config(None, BASE).mtp)
    counts = {}
    for name, p in model.named_parameters():
        key = (
            name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:2])
        )
        counts[key] = counts.get(key, 0) + p.numel()
    return est["true"], est["false"], counts


def test_one_sync_holds_unsharded_fp32_gradients_and_gathered_layers_dp2():
    every, once, n = both_modes(world=2)
    total = sum(n.values())
    layer = n["layers.0"]
    assert all(n[f"layers.{i}"] == layer for i in range(6))
    act = every.activations_gib_per_rank * GIB
    # fp32 gradients of every parameter unsharded instead of in halves: 4 x (total - total / 2)
    # bytes; bf16 copies of the 4 layers beyond the two the default already counts gathered, which
    # stand between micro-batches where the activations are freed: only their excess over the
    # activations
    grads = 4 * (total - total / 2)
    held = 2 * 4 * layer - act
    assert held > 0  # the case exercises both terms
    want = (grads + held) / GIB
    assert (
        once.accumulation_gib_per_rank == pytest.approx(want, rel=1e-9)
        and every.accumulation_gib_per_rank == 0
    )
    # the root group's bf16 gradients through backward and its fp32 reduce-scatter input after the
    # activations, the same in both modes (bf16 compute, fp32 reduce)
    root = n["embed_tokens"] + n["norm"] + n["lm_head"] + n["mtp"]
    assert every.grad_buffers_gib_per_rank == once.grad_buffers_gib_per_rank == \
        pytest.approx((2 * root + max(0, 4 * root - act)) / GIB, rel=1e-9)
    assert once.total_gib_per_rank - every.total_gib_per_rank == pytest.approx(want, rel=1e-9)
    # the default's --check says what the other mode would add
    assert every.single_sync_gib_per_rank == pytest.approx(want, rel=1e-9)
    assert "reshard_after_microbatch=false" in every.summary() and "accumulation=" in once.summary()
    for field in ("states_gib_per_rank", "activations_gib_per_rank", "gathered_gib_per_rank"):
        assert getattr(once, field) == getattr(every, field), field


def test_one_sync_under_a_pipeline_counts_the_stage_holding_most():
    """pp=2 x dp=2: layers 0-2 and the embedding on pp rank 0; layers 3-5, the final norm, the head,
    the MTP module and the embedding's copy on pp rank 1. A stage keeps other micro-batches'
    activations in flight while its gathered copies stand, so they count in full."""
    every, once, n = both_modes("parallel.pp=2", world=4)
    layer = n["layers.0"]
    last = [f"layers.{i}" for i in (3, 4, 5)] + ["embed_tokens", "norm", "lm_head", "mtp"]
    first = [f"layers.{i}" for i in (0, 1, 2)] + ["embed_tokens"]
    per_rank = [4 * sum(n[k] for k in keys) / 2 + 2 * 1 * layer for keys in (first, last)]
    assert once.accumulation_gib_per_rank == pytest.approx(max(per_rank) / GIB, rel=1e-9)
    root = n["embed_tokens"] + n["norm"] + n["lm_head"] + n["mtp"]
    act = every.activations_gib_per_rank * GIB
    assert every.grad_buffers_gib_per_rank == once.grad_buffers_gib_per_rank == \
        pytest.approx((2 * root + max(0, 4 * root - act)) / GIB, rel=1e-9)
    assert once.total_gib_per_rank - every.total_gib_per_rank == pytest.approx(max(per_rank) / GIB,
                                                                               rel=1e-9)


def test_allreduce_mode_holds_only_the_gathered_copies():
    """dp_mode=allreduce (torch's replicate): gradients are whole in both modes."""
    every, once, n = both_modes("parallel.dp_mode=allreduce", world=2)
    held = 2 * 4 * n["layers.0"] - every.activations_gib_per_rank * GIB
    assert once.accumulation_gib_per_rank == pytest.approx(held / GIB, rel=1e-9)
    assert once.total_gib_per_rank - every.total_gib_per_rank == pytest.approx(held / GIB, rel=1e-9)


@pytest.mark.parametrize("extra,world", [(("train.grad_accum_steps=1",), 2), ((), 1)])
def test_modes_agree_with_one_micro_batch_or_no_data_parallelism(extra, world):
    every, once, _ = both_modes(*extra, world=world)
    assert (
        once.total_gib_per_rank == every.total_gib_per_rank and every.single_sync_gib_per_rank == 0
    )


def test_activations_are_sized_by_the_compute_dtype_not_the_device():
    """An fp32 run's activations are estimated alike on a GPU and on a CPU (in fp32 nothing else
    in them depends on the device); the GPU's were estimated at bf16's bytes."""
    def activations(device, dtype):
        cfg = load_config(None, ["model.num_layers=2", f"device={device}", f"train.dtype={dtype}"])
        return estimate(cfg).activations_gib_per_rank

    assert activations("cuda", "fp32") == activations("cpu", "fp32")
    assert activations("cuda", "fp32") > 1.25 * activations("cuda", "bf16")


def test_full_activation_checkpointing_keeps_each_block_input_and_one_block():
    """train.activation_checkpointing=full: each block keeps its input streams (fp32 under
    hyper-connections) and one block's activations live during its recomputation; the estimate had
    no model of it and gave every mode the same activations (hand count, one process, one stage)."""
    def activations(mode, *extra):
        cfg = load_config(None, BASE + [f"train.activation_checkpointing={mode}", *extra])
        return estimate(cfg).activations_gib_per_rank * GIB

    none, full = activations("none"), activations("full")
    tokens, h, layers = 8, 64, 6 + 1  # the trunk's layers and the MTP depth
    per_block = 34 * tokens * h * 2 / 2  # bf16: Korthikanti et al.'s 34 s b h bytes per layer
    rest = none - per_block * layers  # the loss chunk and the fused head's buffers
    assert full == pytest.approx(tokens * h * 2 * layers + per_block + rest)
    hc = ["model.hc_count=4", "model.hc_lowrank=8"]
    per_hc_block = per_block + 16 * 4 * tokens * h * 2 / 2
    rest_hc = activations("none", *hc) - per_hc_block * layers
    assert activations("full", *hc) == pytest.approx(tokens * h * 4 * 4 * layers + per_hc_block
                                                     + rest_hc)


def test_pipeline_schedules_hold_the_micro_batches_torch_runs_them_with():
    """Micro-batches a pp rank holds at its peak, counted by hand from torch's schedules (pp 4, 16
    micro-batches, 3 virtual stages): 1F1B pp - rank; interleaved 1F1B (v - 1) pp + 2 (pp - 1 -
    rank) + 1 chunks of a third of the rank's layers (15 / 3 = 5 on rank 0: 1.25x 1F1B's 4);
    GPipe all 16. The estimate assumed 1F1B's pp whatever the schedule."""
    from tandem.trainer.parallel.validate import microbatches_held

    base = BASE + ["parallel.pp=4", "model.num_layers=12", "train.grad_accum_steps=16"]
    held = {s: [microbatches_held(load_config(None, base + [f"parallel.pp_schedule={s}",
                                                            "parallel.pp_virtual_stages=3"]), r)
                for r in range(4)] for s in ("1f1b", "interleaved_1f1b", "gpipe")}
    assert held == {"1f1b": [4, 3, 2, 1], "interleaved_1f1b": [5, 13 / 3, 11 / 3, 3],
                    "gpipe": [16] * 4}
    acts = {s: estimate(load_config(None, base + [f"parallel.pp_schedule={s}"]), 4)
            .activations_gib_per_rank for s in ("1f1b", "gpipe")}
    assert acts["gpipe"] > 3.5 * acts["1f1b"]


def test_a_pipeline_micro_batch_is_sized_by_the_sequences_the_schedule_gives_it():
    """Under a pipeline a micro-batch is the step's sequences over the pipeline micro-batches, not
    train.micro_batch_size: 8 x 1 at pp 4 runs 4 micro-batches of 2 sequences, as 2 x 4 does, and
    was estimated at 4x the activations; 6 x 2 interleaved runs 4 of 3, as 3 x 4 does."""
    from tandem.trainer.parallel.validate import microbatch_sequences

    base = BASE + ["parallel.pp=4", "model.num_layers=8", "data.seq_len=48"]

    def acts(*extra):
        cfg = load_config(None, base + list(extra))
        return microbatch_sequences(cfg), estimate(cfg, 4).activations_gib_per_rank

    assert acts("train.micro_batch_size=8", "train.grad_accum_steps=1") == acts(
        "train.micro_batch_size=2", "train.grad_accum_steps=4")
    interleaved = "parallel.pp_schedule=interleaved_1f1b"
    assert acts(interleaved, "train.micro_batch_size=6", "train.grad_accum_steps=2") == acts(
        interleaved, "train.micro_batch_size=3", "train.grad_accum_steps=4")
    assert acts(interleaved, "train.micro_batch_size=6", "train.grad_accum_steps=2")[0] == 3


def _torch_peak(pp: int, n: int, rank: int, units) -> float:
    """The peak of `units` (per micro-batch, per local stage) that pp rank `rank` holds when it runs
    the actions torch's ScheduleInterleaved1F1B orders for it: a forward adds its stage's, a
    backward frees them."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    v = len(units)
    stages = [types.SimpleNamespace(num_stages=pp * v, group_size=pp, group_rank=rank,
                                    stage_index=rank + c * pp, is_first=False, is_last=False)
              for c in range(v)]
    held = peak = 0
    for action in ScheduleInterleaved1F1B(stages, n, loss_fn=lambda *a: a).pipeline_order[rank]:
        if action is not None and action.computation_type == _ComputationType.FORWARD:
            held += units[action.stage_index // pp]
            peak = max(peak, held)
        elif action is not None and action.computation_type == _ComputationType.FULL_BACKWARD:
            held -= units[action.stage_index // pp]
    return peak


@pytest.mark.parametrize("pp, v, n", [(4, 3, 16), (4, 4, 16), (2, 2, 4), (4, 3, 4), (4, 2, 8)])
def test_interleaved_stages_of_unequal_size_peak_as_torch_orders_them(pp, v, n):
    """Under interleaved 1F1B the activations a rank holds at its peak are its stages' running sum
    over the forwards and backwards torch's schedule orders, not the mean stage times the count:
    the Qwen3.8-Flash placement at 3 stages per rank ([6] x 8 trunk layers, then the heads' stages)
    holds 90 layer-micro-batches on rank 0, where the mean's count said 60, because the heads'
    backwards run first and free nothing while the trunk's forwards go on."""
    from tandem.trainer.parallel.validate import activations_held

    cfg = load_config(None, BASE + [f"parallel.pp={pp}", "parallel.pp_schedule=interleaved_1f1b",
                                    f"parallel.pp_virtual_stages={v}", "model.num_layers=24",
                                    f"train.grad_accum_steps={n}"])
    for units in ([6, 6, 0, 1][:v], [1] * v, [0, 3, 1, 5][:v], [2, 0, 7, 4][:v]):
        for rank in range(pp):
            assert activations_held(cfg, rank, units) == _torch_peak(pp, n, rank, units), (units,
                                                                                          rank)
    if (pp, v, n) == (4, 3, 16):
        assert activations_held(cfg, 0, [6, 6, 0]) == 90 > 12 * 15 / 3


def test_allreduce_states_are_whole_on_every_data_parallel_rank():
    """dp_mode=allreduce (torch's replicate) keeps every rank's parameters, gradients and AdamW
    moments whole: its states equal one rank's without data parallelism. They were divided by dp
    as FSDP's are."""
    states = {world: estimate(load_config(None, BASE + ["parallel.dp_mode=allreduce"]), world)
              .states_gib_per_rank for world in (1, 4)}
    assert states[4] == states[1] > 0
    fsdp = estimate(load_config(None, BASE), 4).states_gib_per_rank
    assert fsdp == pytest.approx(states[1] / 4, rel=1e-9)


def test_a_frozen_trunks_check_counts_the_flops_its_run_does():
    """--check's model FLOPs per token, MFU's, are the run's: a frozen trunk's forward only (it
    printed the trained trunk's, 1.6x more on finetune_mtp.yaml)."""
    from tandem.trainer.cost import training_flops_per_token

    cfg = load_config(None, BASE + ["train.freeze_trunk=true"])
    want = training_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len, freeze_trunk=True)
    assert estimate(cfg).train_flops_per_token == want
    assert want < training_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len)


def test_fsdp_gathers_the_mtp_layers_experts_as_a_unit_of_their_own():
    """FSDP's gathered copies: a rank's two largest trunk layers and its root pieces, hand-counted
    from the model's parameters (one process, ep 2 over 2 ranks, bf16). The MTP layer's routed
    experts are FSDP units of their own, freed after their forward and split over ep: they were
    counted in the root pieces whole, once per ep rank."""
    from tandem.models import TandemModel

    moe = ["model.num_experts=8", "model.top_k=2", "model.moe_intermediate_size=64",
           "model.first_k_dense=0", "parallel.ep=2", "mtp.moe=true"]
    cfg = load_config(None, BASE + moe)
    with torch.device("meta"):
        model = TandemModel(cfg.model, cfg.mtp)
    layers, roots = {}, 0
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            key = name.split(".")[1]
            layers[key] = layers.get(key, 0) + p.numel() / (2 if ".experts." in name else 1)
        elif ".experts." not in name:
            roots += p.numel()
    assert any(".experts." in n and n.startswith("mtp.") for n, _ in model.named_parameters())
    want = 2 * (sum(sorted(layers.values())[-2:]) + roots)  # bf16 bytes
    assert estimate(cfg, 2).gathered_gib_per_rank * GIB == pytest.approx(want, rel=1e-9)


def test_tensor_parallelism_without_sequence_parallelism_keeps_the_norms_whole():
    """Korthikanti et al.'s per-layer activations at tp=2: 34 sbh / 2 bytes under sequence
    parallelism, (10 + 24 / 2) sbh without it (the norms' inputs are whole on every tp rank): the
    estimate split all 34 either way, 23% under at tp=2. 6 layers + 1 MTP depth, bf16, s*b=8, h=64
    (the rest of the activations, the head's, are the same in both)."""
    def activations(sp):
        cfg = load_config(None, BASE + ["parallel.tp=2", f"parallel.sequence_parallel={sp}"])
        return estimate(cfg, 2).activations_gib_per_rank * GIB

    assert activations("false") - activations("true") == pytest.approx(
        (6 + 1) * (22 - 17) * 8 * 64, rel=1e-9)
