"""Every parallel layout trains like one process: same losses per depth, same updated parameters.

One torchrun launch per world size runs several layouts in sequence (tests/distributed/worker.py);
the single-process references run here, in the pytest process, from the same seed and data.
fp32 layouts (LAYOUTS) match exactly up to fp32 rounding; bf16 layouts (BF16_LAYOUTS) match the
one-process bf16 run within a tolerance derived below; every collective of every layout's training
steps is checked for device tensors and no float64.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# layout -> world size; batch ranks (dp*ep) decide which single-process reference applies. Each
# feature runs in the fewest layouts that check it (the suite's budget): a layout another one covers
# is left out, and the comment says which covers it. Load-balance and z-loss: the one-process run
# takes the mean aux loss over all its micro-batches, so every layout must scale each micro-batch's
# aux gradient by 1/(micro-batches in the global step), not 1/grad_accum_steps per rank (gradients
# are summed over dp*ep). Coefficients large enough that the old per-rank scale moves parameters by
# 0.39 relative (dp=2) instead of rounding noise.
AUX = "model.balance=aux_loss,model.aux_loss_coef=0.1,model.z_loss_coef=0.01"
LAYOUTS = {
    # tp, ep, dp and pp each alone, with the aux and z losses on: these also cover the plain tp=2,
    # ep=2 and pp=2 (the default aux-free balance runs in every layout below)
    f"dp=2,{AUX}": 2,
    # (fixed-capacity `ep_dispatch=padded`: the bf16 flagship, and exact in test_ep_dispatch)
    f"ep=2,{AUX}": 2,
    f"tp=2,{AUX}": 2,  # aux computed replicated on each tp rank: no tp factor
    # aux on the gathered logits, router grads summed over tp; with padding across the SP shard
    # edge, which the loads and the aux loss leave out (worker.global_batch)
    f"tp=2,sequence_parallel=true,data.document_mask=true,{AUX}": 2,
    f"pp=2,{AUX}": 2,  # micro-batches per rank = parallel.pp_microbatches
    # GPipe: every micro-batch's forward before any backward (1F1B interleaves them), in fp32,
    # where parameters are compared (its bf16 run below checks the step-0 gradient norm only)
    "pp=2,pp_schedule=gpipe": 2,
    f"ep=2,pp=2,data.document_mask=true,{AUX}": 4,
    # dp x ep, the production shape of expert parallelism: the experts FSDP-sharded over dp on top
    # of their ep shard, the aux loss over 4 batch ranks
    f"dp=2,ep=2,{AUX}": 4,
    # (plain tp x ep: this and the selective-checkpointing one below) in fp32, where parameters
    # are compared: all-reduce data parallelism over tp-sharded parameters, experts left out at dp=1
    "tp=2,ep=2,dp_mode=allreduce": 4,
    # ... and with dp > 1 (no other layout has dp > 1 and ep > 1 under all-reduce), with pieces
    # two stages of a rank share kept whole: a kept-whole MoE piece's experts are summed over dp
    # alone, not over dp x ep, whose ranks hold other experts (a sum over dp x ep passed the bf16
    # comparison of this layout; the same layout without ep runs in bf16 below)
    "ep=2,dp=2,pp=2,dp_mode=allreduce,pp_schedule=interleaved_1f1b,pp_layout=[2:2:0:0],"
    "pp_depth_stages=[2:1:3]": 8,
    # per-head q/k norms (Qwen3) under TP: replicated weights whose gradients are partial over tp;
    # with the vocab-parallel head's recomputing backward (the fused one, the default, runs
    # everywhere else)
    "tp=2,model.qk_norm=true,mtp.loss_head_backward=recompute": 2,
    # MLA (DeepSeek-V3's attention, with YaRN): the latent projections and norms are replicated
    # and see one rank's heads, so their gradients are partial over tp; under SP with documents and
    # a pipeline (covers plain SP)
    "tp=2,preset.mla=1": 2,
    "tp=2,pp=2,sequence_parallel=true,data.document_mask=true,preset.mla=1": 4,
    # activation checkpointing recomputes blocks (and their collectives) in backward
    "ep=2,pp=2,train.activation_checkpointing=full": 4,
    "tp=2,ep=2,sequence_parallel=true,train.activation_checkpointing=selective": 4,
    # the trunk under no_grad on every stage, several stages per rank (also covers the plain
    # interleaved schedule; pp_balance: test_cli_layouts' flagship and test_qwen4_layouts), kept in
    # bf16 beside the fp32 MTP module: its residual stream crosses the stage boundaries in bf16, as
    # one process computes it (an fp32 boundary failed the next stage's bf16 matmul; under bf16
    # training it computed what one process does not)
    "pp=2,pp_schedule=interleaved_1f1b,train.freeze_trunk=true,train.frozen_dtype=bf16": 2,
    # loss depths spread over the stages (pipeline_plan.py; list items separated by `:`): depth 1 on
    # the trunk's stage, the trunk's head and depth 2 after it (h_0 travels beside the chain)
    "pp=2,pp_layout=[4:0],pp_depth_stages=[1:0:1]": 2,
    # a pipeline rank with no gradients at all (the frozen trunk and its head on stage 0): the
    # global norm's collective
    "pp=2,pp_layout=[4:0],pp_depth_stages=[0:1:1],train.freeze_trunk=true": 2,
    "pp=2,pp_layout=[4:0],pp_depth_stages=[0:0:1],mtp.style=parallel,mtp.num_layers=2": 2,
    # a head tied to the embedding on a stage that embeds nothing (no looped MTP step there): the
    # stage holds the embedding too, so that the one parameter is summed over both stages; stage 0
    # holds only the dense layer 0, so rank 0, which logs, has no MoE layer (`moe/expert_path`
    # then comes from stage 1)
    "pp=2,pp_layout=[1:3],model.tie_embeddings=true,mtp.num_steps=0": 2,
    # two stages of one rank share the head / MTP module / embedding: kept whole, summed over dp /
    # ep (also covers plain pp x dp)
    "pp=2,dp=2,pp_schedule=interleaved_1f1b,pp_layout=[2:2:0:0],pp_depth_stages=[2:1:3]": 4,
    "ep=2,pp=2,pp_schedule=interleaved_1f1b,pp_layout=[2:2:0:0],pp_depth_stages=[2:1:3]": 4,
    # the teacher (the trunk's normed h_0) read on a stage before the trunk's head, under tp x pp x
    # SP (covers plain tp x pp with and without SP, and the acceptance objective's vocab-parallel
    # sums; at tp=2 alone it runs under context parallelism, test_context_parallel)
    "tp=2,pp=2,sequence_parallel=true,pp_layout=[4:0],pp_depth_stages=[1:0:1],"
    "mtp.loss.objective=acceptance": 4,
    # parallel.reshard_after_microbatch: the layouts above sync gradients every micro-batch (the
    # default); these keep FSDP's unsharded gradients through the step and sync once, in the last
    # backward; their every-micro-batch twins are the other side of test_sync_modes_differ
    "dp=2,reshard_after_microbatch=false": 2,
    "pp=2,dp=2,reshard_after_microbatch=false": 4,
    "dp=2": 2,
    "pp=2,dp=2": 4,
}
# bf16 (CPU autocast standing in for an accelerator's): every kind of layout and the combinations.
BF16 = "train.dtype=bf16"
BF16_LAYOUTS = {f"{layout},{BF16}": world for layout, world in {
    "tp=2,sequence_parallel=true": 2,  # (plain tp: the flagship below)
    # (1F1B: the pp x dp layouts; interleaved: the spread depths below)
    "pp=2,pp_schedule=gpipe": 2,
    "dp=2": 2,  # FSDP2 MixedPrecisionPolicy: bf16 all-gather, fp32 reduce-scatter
    "dp=2,dp_mode=allreduce": 2,
    "pp=2,dp=2": 4,  # FSDP's bf16 parameters make the stages exchange bf16 activations
    "tp=2,ep=2,dp_mode=allreduce": 4,
    # the flagship layout, syncless dispatch (covers tp x ep and tp x pp + SP), with MLA (its tp +
    # SP alone: the fp32 layouts; GQA in the flagship layout in bf16: test_piece_units.py)
    "tp=2,ep=2,pp=2,sequence_parallel=true,ep_dispatch=padded,preset.mla=1": 8,
    # spread depths
    "pp=2,pp_schedule=interleaved_1f1b,pp_layout=[2:2:0:0],pp_depth_stages=[2:1:3]": 2,
    # all-reduce data parallelism with pieces two stages of a rank share: kept whole, and computing
    # from compute-dtype copies of their fp32 parameters (data.cast_kept_whole), as FSDP's policy
    # gathers the rest
    "pp=2,dp=2,dp_mode=allreduce,pp_schedule=interleaved_1f1b,pp_layout=[2:2:0:0],"
    "pp_depth_stages=[2:1:3]": 4,
    # embedding, head and MTP module kept out of FSDP (two stages of a rank share them), experts too
    # (dp=1)
    "ep=2,pp=2,pp_schedule=interleaved_1f1b,pp_layout=[2:2:0:0],pp_depth_stages=[2:1:3]": 4,
    f"ep=2,{AUX}": 2,  # fp32 routing and aux/z-loss under bf16 experts (covers plain ep)
    "dp=2,ep=2": 4,  # experts gathered in bf16 by FSDP over dp, dispatched over ep
    "dp=2,reshard_after_microbatch=false": 2,  # one sync per step: fp32 unsharded accumulation
    # ... with bf16 reduce-scatters: accumulated in fp32, cast to bf16 for the one reduce-scatter
    "dp=2,reshard_after_microbatch=false,train.grad_reduce_dtype=bf16": 2,
}.items()}
# train.grad_reduce_dtype=bf16 sums a step's micro-batches in fp32 in both sync modes (FSDP2 kept
# the unsharded running sum in bf16 when the reduce and parameter dtypes matched): see
# test_bf16_reduce_accumulates_micro_batches_in_fp32. One MTP step: a module called K times per
# forward reduces its gradient in parts (one per backward hook that finds one), which adds roundings
# of its own to the one-sync mode.
ACCUMULATION = {f"{worker.ACCUM_CHECK}dp=2,{BF16},train.grad_reduce_dtype=bf16,mtp.num_steps=1,"
                f"reshard_after_microbatch={every}": 2 for every in ("true", "false")}
RTOL = 1e-5
# qk_norm sharpens attention, and fp32 rounding of the split matmuls then reaches ~4e-5 on a few
# weights after three Adam steps; run in float64 the same comparison gives 2e-6 (the norms and
# router still compute in fp32), so the gap is rounding. The bug this layout guards against
# (q/k-norm gradients not summed over tp) makes the replicas on the two tp ranks differ, which the
# replica check in `load` catches at RTOL.
#
# MLA's latent norms do the same: the step-2 gradient norm was 1.1e-5 off one process's (steps 0
# and 1: 1e-7 and 4e-7, so the gradients' plumbing is right from the start); with the parameters
# and the one-process run in float64 the gap fell tenfold (1.1e-6; parameters 2.3e-6 from 1.8e-5),
# which a missing sum or a wrong shard would not do.
PARAM_RTOL = {"tp=2,model.qk_norm=true,mtp.loss_head_backward=recompute": 1e-4,
              "tp=2,preset.mla=1": 1e-4}

# bf16 tolerance. bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 = 2e-3
# relative. The per-depth losses are means over ~100 tokens, so a run's bf16 roundings move them
# less; that scale is measured in the test as the gap between the one-process bf16 and fp32 runs. It
# is one sample of rounding noise and depends on the weights: 2.7e-4 over the 3 steps with the
# earlier torch.manual_seed init, 6.7e-5 with the seeded per-parameter init (3e-5 at step 0, where
# only the forward's roundings differ). Re-splitting one bf16 process's 8 samples from 4
# micro-batches of 2 into 2 of 4 already moves them by 1.2e-4 (fp32: 1e-7). A parallel layout rounds
# in other places: TP rounds its partial sums to bf16 before the all-reduce, and FSDP's bf16
# parameters keep the residual stream in bf16 where autocast alone keeps it fp32, so FSDP layouts
# round *more* than one process does (measured up to 5.4e-4: dp, ep, pp+dp; tp+SP 5.2e-4; pp and
# all-reduce DP 0 to 1e-5). The tolerance is the larger of 4x the measured gap and one bf16 rounding
# of the loss itself (2^-9), at step 0 and over all steps separately: a layout inside it is
# indistinguishable from bf16 noise. The losses alone are a weak check here: three steps move them
# by only ~5e-3 in all (a run whose optimizer does nothing differs by 4.6e-3), and clipping cancels
# a gradient's constant factor. A plumbing error this test exists for (a gradient not summed, a
# micro-batch scaled twice) shows in the step-0 gradient norm, compared with the one-process bf16
# run's within the same bound. Whether bf16 is in
# effect at all is checked separately (below). Parameters are not compared: after a few steps bf16
# rounding flips discrete decisions (which expert a near-tie token routes to, the sign in the
# aux-free bias rule, Adam's first updates ~ lr*sign(g) for tiny gradients), so even the one-process
# bf16 and fp32 runs end 0.09-1.0 apart (relative) on router weights and biases; replicas of a
# parameter across ranks must still agree (RTOL, in `load`).
BF16_GAP_FACTOR = 4.0
BF16_ROUNDING = 2.0**-9
# bf16 is in effect: every nn.Linear computed in bf16 on every rank, and the step-0 gradient norm
# (of identical weights) is off the fp32 run's by more than 2e-5 relative, 13x the fp32 layouts' own
# deviation over all steps (<1.5e-6); measured 8.9e-5..1.5e-3 (the pipeline layouts' 8.9e-5 since
# the fused head, the default, sums its bf16 weight gradient in fp32 over chunks: 1.1e-3 when
# recomputed, summed in bf16). Under FSDP's policy (dp x ep > 1) every other module holding
# parameters (norms, embeddings, experts) outputs bf16 too, FSDP-gathered or kept whole, and no
# expert dispatch moves fp32 (the vocabulary heads return fp32 loss sums by design; an fp32 norm
# weight of a piece kept whole made its activations and their all-to-alls fp32).
BF16_EVIDENCE = 2e-5
# Modules holding parameters whose outputs may be fp32 under FSDP's bf16 policy (the vocabulary
# heads' loss sums; test_qwen4_layouts adds the hyper-connections' norms over the fp32 streams)
FP32_OUTPUTS = {"OutputHead", "VocabParallelHead"}
# Parameters after three Adam steps: tp layouts reach 1.7e-5 on the vocab-parallel embedding from
# the seeded per-parameter init (its rarely-seen rows have gradients near Adam's eps, where the tp
# all-reduce's rounding is amplified); the same tp=2 comparison in float64 gives 8.6e-7 on every
# parameter, so this is fp32 rounding. A real layout bug (a missing gradient sum, a wrong shard) is
# orders of magnitude larger.
DEFAULT_PARAM_RTOL = 3e-5


def model_overrides(layout: str, drop=()) -> str:
    """The non-parallel part of a layout (`model.qk_norm=true`), which its reference run shares
    (minus the keys in `drop`)."""
    keys = [kv for kv in layout.split(",") if "." in kv.split("=")[0]
            and kv.split("=")[0] not in drop]
    return ",".join(keys)


def batch_ranks(layout: str) -> int:
    kv = dict(item.split("=") for item in layout.split(",") if "." not in item.split("=")[0])
    return int(kv.get("dp", 1)) * int(kv.get("ep", 1)) if "dp" in kv else int(kv.get("ep", 1))


def load_ranks(tmp_path, layout: str, world: int):
    return [torch.load(tmp_path / f"{layout}.rank{r}.pt", weights_only=False) for r in range(world)]


def load(tmp_path, layout: str, world: int):
    ranks = load_ranks(tmp_path, layout, world)
    params = {}
    for r in ranks:
        for name, value in r["params"].items():
            # replicas of one parameter (other tp/dp ranks, the embedding copy) agree
            if name in params:
                torch.testing.assert_close(value, params[name], rtol=RTOL, atol=1e-7,
                                           msg=f"{layout}: {name} replicas "
                                                                                          "differ")
            params[name] = value
    return ranks[0]["losses"], params


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


class _References(dict):
    """Single-process runs, keyed by (batch ranks, model overrides), computed on first use."""

    def __missing__(self, key):
        batch, model = key
        torch.set_num_threads(1)
        self[key] = worker.run_layout(",".join(["single"] + ([model] if model else [])),
                                      batch_size_for_ref=batch)
        return self[key]


@pytest.fixture(scope="module")
def references():
    return _References()


@pytest.fixture(scope="module")
def runs(training_layout_runs):
    """LAYOUTS, BF16_LAYOUTS and ACCUMULATION trained (tests/conftest.py: one launch per world
    size)."""
    return training_layout_runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, runs, references):
    ref = references[batch_ranks(layout), model_overrides(layout)]
    losses, params = load(runs, layout, LAYOUTS[layout])
    ref_losses = torch.tensor(ref["losses"], dtype=torch.float64)
    got = torch.tensor(losses, dtype=torch.float64)
    assert got.shape == ref_losses.shape
    worst_loss = float(((got - ref_losses).abs() / ref_losses.abs()).max())
    assert worst_loss < RTOL, f"{layout}: per-depth losses {got.tolist()} vs {ref_losses.tolist()}"
    assert set(params) == set(ref["params"]), set(params) ^ set(ref["params"])
    worst = max((rel_err(params[n], ref["params"][n]), n) for n in params)
    assert worst[0] < PARAM_RTOL.get(layout,
                                     DEFAULT_PARAM_RTOL), (f"{layout}: parameter {worst[1]} "
                                                           "relative error "
                                                                   f"{worst[0]:.2e}")
    # every step's gradient norm before clipping: clipping (every reference step's norm is above
    # train.grad_clip) and Adam cancel a gradient's constant factor in the losses and parameters
    norms = load_ranks(runs, layout, LAYOUTS[layout])[0]["grad_norms"]
    worst_norm = max_rel(norms, ref["grad_norms"])
    assert worst_norm < max(RTOL, PARAM_RTOL.get(layout, 0.0)), \
        f"{layout}: gradient norms {norms} vs {ref['grad_norms']}"
    check_logged_figures(layout, load_ranks(runs, layout, LAYOUTS[layout])[0], ref)
    print(f"{layout}: max loss rel err {worst_loss:.2e}, max param rel err {worst[0]:.2e} "
          f"({worst[1]}), max grad norm rel err {worst_norm:.2e}")


def check_logged_figures(layout: str, rank0: dict, ref: dict, rtol: float = RTOL) -> None:
    """What the logging rank records of the auxiliary losses (the MoE's aux + z loss, the QSA
    indexer's KL: the step's mean over every micro-batch and rank) and of the expert loads'
    balance (over every stage's MoE layers) is what one process logs."""
    assert [r.keys() for r in rank0["logged"]] == [r.keys() for r in ref["logged"]], \
        f"{layout}: logged {rank0['logged']} vs {ref['logged']}"
    # the experts' kernel over every stage's layers (`moe/expert_path`), whatever rank 0 holds
    assert rank0["expert_path"] == ref["expert_path"], (layout, rank0["expert_path"],
                                                        ref["expert_path"])
    for got, want in zip(rank0["logged"], ref["logged"]):
        for key in want:
            assert abs(got[key] - want[key]) <= rtol * abs(want[key]), \
                f"{layout}: {key} {got[key]} vs one process's {want[key]}"


def max_rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS))
def test_bf16_layout_matches_single_process(layout, runs, references):
    world = BF16_LAYOUTS[layout]
    ref = references[batch_ranks(layout), model_overrides(layout)]
    ref32 = references[batch_ranks(layout), model_overrides(layout, drop=("train.dtype",))]
    losses, params = load(runs, layout, world)  # also: replicas agree
    assert set(params) == set(ref["params"]), set(params) ^ set(ref["params"])
    gap, gap0 = max_rel(ref["losses"], ref32["losses"]), max_rel(ref["losses"][0],
                                                                 ref32["losses"][0])
    assert 0 < gap < 1e-2, f"one-process bf16 vs fp32 gap {gap:.2e}"
    worst, worst0 = max_rel(losses, ref["losses"]), max_rel(losses[0], ref["losses"][0])
    assert worst0 <= max(BF16_GAP_FACTOR * gap0, BF16_ROUNDING), \
        f"{layout}: step-0 losses {worst0:.2e} off bf16 (gap to fp32 {gap0:.2e})"
    assert worst <= max(BF16_GAP_FACTOR * gap,
                        BF16_ROUNDING), (f"{layout}: losses {worst:.2e} off bf16 (gap to fp32 "
                                                                f"{gap:.2e})")
    ranks = load_ranks(runs, layout, world)
    assert all(r["linear_dtypes"] == ["torch.bfloat16"] for r in ranks), [r["linear_dtypes"]
                                                                          for r in ranks]
    if batch_ranks(layout) > 1:
        for r in ranks:
            fp32 = {kind for kind,
                    dtypes in r["owner_dtypes"].items() if dtypes != ["torch.bfloat16"]}
            assert fp32 <= FP32_OUTPUTS, f"{layout}: outside bf16: {r['owner_dtypes']}"
            dispatch = {key for key in r["collectives"] if "all_to_all" in key[0]
                        and key[2] == "torch.float32"}
            assert not dispatch, f"{layout}: fp32 all-to-alls {dispatch}"
    norm, norm32 = ranks[0]["grad_norms"][0], ref32["grad_norms"][0]
    assert abs(norm
               - norm32) / norm32 > BF16_EVIDENCE, (f"{layout}: step-0 grad norm {norm} ~ fp32's "
                                                    f"{norm32}")
    # ... and the one-process bf16 run's (the same weights: bf16 rounding apart), which a gradient
    # off by a factor on a bf16-only path (reduced in bf16, kept whole, all-reduced) would miss
    norm16, gap_norm = ref["grad_norms"][0], max_rel(ref["grad_norms"][0], norm32)
    assert abs(norm - norm16) / norm16 <= max(BF16_GAP_FACTOR * gap_norm, BF16_ROUNDING), \
        f"{layout}: step-0 grad norm {norm} vs one-process bf16 {norm16} (fp32 {norm32})"
    print(f"{layout}: max loss rel err {worst:.2e} (step 0 {worst0:.2e}) vs one-process bf16; "
          "one-process "
          f"bf16-fp32 gap {gap:.2e} (step 0 {gap0:.2e}); step-0 grad norm off fp32 by "
          f"{abs(norm - norm32) / norm32:.2e}")


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(BF16_LAYOUTS))
def test_collectives_carry_no_float64_and_show_each_mechanism(layout, runs):
    """Ascend's HCCL has no fp64: no collective of the training steps (recorded on every rank)
    receives a float64 tensor, and each parallel mechanism of the layout communicates. (That
    NCCL/HCCL get tensors on the rank's device is not checked: on gloo every tensor is on the
    CPU.)"""
    world = {**LAYOUTS, **BF16_LAYOUTS}[layout]
    seen = {}
    for r in load_ranks(runs, layout, world):
        for (op, _, dtype), n in r["collectives"].items():
            assert dtype != "torch.float64", f"{layout}: {op} got a float64 tensor"
            seen[op] = seen.get(op, 0) + n
            seen[(op, dtype)] = seen.get((op, dtype), 0) + n
    ops = set(seen)
    # the recorder sees the collectives of every mechanism the layout uses
    kv = dict(item.split("=") for item in layout.split(","))
    assert "distributed.all_reduce" in ops, ops
    if kv.get("pp") == "2":  # activations and their gradients between stages
        assert {"distributed.isend", "distributed.irecv"} <= ops, ops
    if (int(kv.get("dp", 1)) * int(kv.get("ep", 1)) > 1) and kv.get("dp_mode") != "allreduce":
        assert {"distributed.all_gather_single", "distributed.reduce_scatter_single"} <= ops, ops
    if kv.get("ep") == "2":
        assert "_functional_collectives.all_to_all_single" in ops, ops
    if kv.get("tp") == "2" and kv.get("sequence_parallel") == "true":
        assert "_functional_collectives.all_gather_single" in ops, ops


@pytest.mark.parametrize("every,once", [("dp=2", "dp=2,reshard_after_microbatch=false"),
                                        ("pp=2,dp=2", "pp=2,dp=2,reshard_after_microbatch=false")])
def test_sync_modes_differ(every, once, runs):
    """The two parallel.reshard_after_microbatch modes really run differently (their sums agree,
    above): syncing every micro-batch reduce-scatters, and gathers again after resharding, more
    often than the one sync per step (GRAD_ACCUM = 2 micro-batches per step)."""
    def count(layout, op):
        return sum(n for (name, _, _),
                   n in load_ranks(runs, layout, LAYOUTS[layout])[0]["collectives"].items()
                   if name == f"distributed.{op}")
    for op in ("reduce_scatter_single", "all_gather_single"):
        assert count(every, op) > count(once, op) > 0, (op, count(every, op), count(once, op))


def test_layouts_of_one_mesh_shape_form_its_groups_once(runs):
    """The launch builds one device mesh per shape (worker.reuse_device_meshes), as a run builds its
    mesh once: of the layouts that share a shape, only the first forms process groups. A mesh per
    layout formed eight more gloo groups each time (12 threads and their sockets per rank), some
    thousands of threads by the end of a launch, and left compiled cases without the graphs an
    earlier case compiled. Pipeline layouts are left out: each forms its shared pieces' group."""
    formed = {}
    for layout, world in {**LAYOUTS, **BF16_LAYOUTS, **ACCUMULATION}.items():
        p = worker.make_cfg(layout.removeprefix(worker.ACCUM_CHECK), 1).parallel
        if p.pp == 1:
            before, after = load_ranks(runs, layout, world)[0]["process_groups"]
            shape = (world, p.cp, p.ep, p.tp)  # dp is what the world leaves
            formed.setdefault(shape, []).append(after > before)
    shared = {shape: f for shape, f in formed.items() if len(f) > 1}
    assert len(shared) >= 3 and all(sum(f) <= 1 for f in shared.values()), formed


def kept_fp32(name: str) -> bool:
    """Parameters a bf16 layout keeps whole in fp32 (trainer/parallel/data.fp32_parameters: what the
    recurrence and the stream mixing read): their gradients are fp32, summed by the gradient
    finisher."""
    return name.endswith(("router.weight", "A_log", "dt_bias", "hc_norm.weight"))


@pytest.mark.parametrize("layout", list(ACCUMULATION))
def test_bf16_reduce_accumulates_micro_batches_in_fp32(layout, runs):
    """Under bf16 reduce-scatters, a step's gradient is its micro-batches' gradients summed in fp32:
    exactly their fp32 sum with a sync every micro-batch (each micro-batch's bf16 reduction
    accumulated into the fp32 shards), and that sum rounded to bf16 once with one sync per step (the
    wire dtype of the step's one reduce-scatter). Rank 1 contributes exact zeros
    (worker.accumulated_gradients), so the data-parallel sums round nothing of their own. Summing in
    bf16, as FSDP2 did for one sync per step, leaves 19427 of 63424 elements off (measured); fp32
    rounding of the reference's sum would be 1e-7 relative."""
    got = torch.load(runs / f"{layout}.rank0.pt", weights_only=False)
    once = layout.endswith("reshard_after_microbatch=false")
    singles, step = got["singles"], got["step"]
    assert len(singles) == 4 and set(step) == set(singles[0]), set(step) ^ set(singles[0])
    for name, grad in step.items():
        want = torch.zeros_like(singles[0][name])
        for s in singles:  # in the order FSDP accumulates them
            want += s[name]
        if kept_fp32(name):  # fp32 values, summed in fp32 outside FSDP
            torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-9, msg=f"{layout}: {name}")
            continue
        # bf16 values
        assert all(torch.equal(s[name], s[name].bfloat16().float()) for s in singles), name
        if once:
            want = want.bfloat16().float()
        torch.testing.assert_close(grad, want, rtol=1e-6, atol=0, msg=f"{layout}: {name}")
