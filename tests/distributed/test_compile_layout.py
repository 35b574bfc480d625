"""train.compile under parallel layouts trains like the same layout run eagerly: tensor and sequence
parallelism (tp2 + SP, two ranks, with the load-balance and z losses; activation checkpointing
none / full / selective in fp32) and
expert parallelism under a pipeline (ep2 x pp2, four ranks, FSDP2 over the two expert-parallel
batch ranks; selective checkpointing in bf16). Together they cover the flagship
shape's pieces (tp2 x ep2 x pp2 + SP compiled on eight ranks costs the suite a minute of compiling
on two cores for no other path).

The reference is the same layout without compile and without checkpointing, in the same launch: the
same collectives in the same order, so what differs is compilation alone (that each eager layout
trains like one process is test_parallel_equivalence.py's). One torchrun launch per world size runs
every case (with the other equivalence modules' layouts, tests/conftest.py)
(tests/distributed/worker.py); the graphs one case compiles serve the next (the checkpointing modes
share their forward graphs), which keeps the test's time to one compilation per dtype and launch.

Tolerances. fp32: compiling re-fuses elementwise work and reorders its reductions; measured against
the eager layout after three AdamW steps: losses 1e-7, parameters 1.1e-5 relative (tp2 x ep2 x pp2 +
SP, when it ran in fp32; the eager layout is itself 4.3e-5 off one process there, so the rounding is
the layout's scale). A compiled block that lost a gradient (the SP embedding's, before compile.py
waited on its asynchronous output), or a recomputation that replayed another graph, is off by O(1)
or fails outright. bf16: the bound of test_parallel_equivalence.py, 4x the gap between the eager
layout in bf16 and in fp32 (or one bf16 rounding of the loss); inductor's fused kernels keep
intermediates in fp32, so they round less than eager bf16 (measured 2.4e-4 against a bound of 2e-3
on the flagship shape). Parameters are not compared in bf16 (rounding flips near-tied routing
decisions; see test_parallel_equivalence.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_parallel_equivalence import (
    AUX,
    BF16_EVIDENCE,
    BF16_GAP_FACTOR,
    BF16_ROUNDING,
    DEFAULT_PARAM_RTOL,
    RTOL,
    load,
    load_ranks,
    max_rel,
    rel_err,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BF16 = ",train.dtype=bf16"
# ep x pp: two layers, one per pipeline stage (a dense block, then a MoE block beside the MTP
# block): every kind of block graph with as few graphs per rank as that allows; compiling is most of
# the test's time.
# tp2 + SP with the load-balance and z losses (their AuxLossGrad inside the compiled MoE graph), on
# one MoE layer, whose graph the MTP block reuses: one graph to compile per rank (the dense block's
# compiles in the ep x pp case)
TP_SP = f"tp=2,sequence_parallel=true,model.num_layers=1,model.first_k_dense=0,{AUX}"
LAYOUTS = {TP_SP: 2, "ep=2,pp=2,model.num_layers=2": 4}
# Which checkpointing modes run compiled, per layout and dtype. Compiling is the cost (each rank
# compiles its blocks once per dtype; the modes share those graphs), so ep x pp compiles in bf16
# only, its production precision, where a lost gradient or a replayed wrong graph is O(1) off; the
# tight fp32 comparison, which also catches rounding-sized faults, runs every mode at tp2 + SP.
# (tp2 + SP compiled in bf16: its fp32 cases here and ep x pp's bf16 one, with the throughput
# bench's compiled bf16 runner in one process, tests/e2e/test_bench_smoke.py.)
MODES = {(TP_SP, ""): ("none", "full", "selective"),
         ("ep=2,pp=2,model.num_layers=2", BF16): ("selective",)}
# the eager twins: each compiled case's, and a bf16 case's fp32 one (the bf16 bound's scale)
EAGER = {f"{layout}{dtype}": LAYOUTS[layout] for layout, bf16 in MODES for dtype in {bf16, ""}}
CASES = {}  # compiled layout -> its eager twin
for (_base, _dtype), _modes in MODES.items():
    for _ac in _modes:
        CASES[f"{_base},train.compile=true,train.activation_checkpointing={_ac}{_dtype}"] = (
            f"{_base}{_dtype}"
        )


COMPILED = {case: EAGER[eager] for case, eager in CASES.items()}  # compiled layout -> world size


@pytest.fixture(scope="module")
def runs(training_layout_runs):
    """EAGER and COMPILED trained (tests/conftest.py: one launch per world size, compiled layouts
    last)."""
    return training_layout_runs


def _assert_compiled(ranks, layout):
    # every block's forward dispatches to a compiled graph (dynamo fails past its limit)
    for r in ranks:
        c = r["compiled"]
        assert c["blocks"] > 0 and c["compiled_blocks"] == c["blocks"] and c["graphs"] > 0, (layout,
                                                                                             c)


@pytest.mark.parametrize("layout", [c for c in CASES if BF16 not in c])
def test_compiled_layout_matches_eager(layout, runs):
    eager, world = CASES[layout], EAGER[CASES[layout]]
    ref_losses, ref_params = load(runs, eager, world)
    losses, params = load(runs, layout, world)  # also: replicas of a parameter agree across ranks
    _assert_compiled(load_ranks(runs, layout, world), layout)
    got, want = torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses,
                                                                        dtype=torch.float64)
    assert got.shape == want.shape
    worst_loss = float(((got - want).abs() / want.abs()).max())
    assert params.keys() == ref_params.keys()
    worst = max((rel_err(params[n], ref_params[n]), n) for n in params)
    print(f"{layout}: losses {worst_loss:.2e}, parameters {worst[0]:.2e} ({worst[1]}) relative to "
          "eager")
    assert worst_loss < RTOL, f"{layout}: per-depth losses {got.tolist()} vs eager {want.tolist()}"
    assert worst[0] <= DEFAULT_PARAM_RTOL, (f"{layout}: parameter {worst[1]} relative error "
                                            f"{worst[0]:.2e}")


@pytest.mark.parametrize("layout", [c for c in CASES if BF16 in c])
def test_compiled_bf16_layout_matches_eager(layout, runs):
    eager, world = CASES[layout], EAGER[CASES[layout]]
    eager32 = eager.removesuffix(BF16)
    ref, ref32 = load_ranks(runs, eager, world)[0], load_ranks(runs, eager32, world)[0]
    losses, _ = load(runs, layout, world)
    ranks = load_ranks(runs, layout, world)
    _assert_compiled(ranks, layout)
    gap, gap0 = max_rel(ref["losses"], ref32["losses"]), max_rel(ref["losses"][0],
                                                                 ref32["losses"][0])
    assert 0 < gap < 1e-2, f"eager bf16 vs fp32 gap {gap:.2e}"
    worst, worst0 = max_rel(losses, ref["losses"]), max_rel(losses[0], ref["losses"][0])
    print(f"{layout}: losses {worst:.2e} (step 0 {worst0:.2e}) off eager bf16, whose gap to fp32 "
          f"is {gap:.2e}")
    assert worst0 <= max(BF16_GAP_FACTOR * gap0,
                         BF16_ROUNDING), f"{layout}: step-0 losses {worst0:.2e} off bf16"
    assert worst <= max(BF16_GAP_FACTOR * gap,
                        BF16_ROUNDING), f"{layout}: losses {worst:.2e} off bf16"
    norm, norm32 = ranks[0]["grad_norms"][0], ref32["grad_norms"][0]  # bf16 in effect under compile
    assert abs(norm
               - norm32) / norm32 > BF16_EVIDENCE, (f"{layout}: step-0 grad norm {norm} ~ fp32's "
                                                    f"{norm32}")
    # ... and the eager bf16 run's (the same weights, bf16 rounding apart): the losses alone would
    # miss a gradient the compiled graph loses or scales on a bf16-only path
    norm16, gap_norm = ref["grad_norms"][0], max_rel(ref["grad_norms"][0], norm32)
    assert abs(norm - norm16) / norm16 <= max(BF16_GAP_FACTOR * gap_norm, BF16_ROUNDING), \
        f"{layout}: step-0 grad norm {norm} vs eager bf16 {norm16} (fp32 {norm32})"
