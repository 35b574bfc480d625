"""Context parallelism (parallel.cp) trains like one process: three optimizer steps under cp alone
and composed with tp + SP, ep, pp and dp (FSDP and all-reduce), with packed documents whose starts
fall on the chunk edges and one off them (worker.global_batch), give one process's per-depth losses
and parameters (the harness and tolerances of test_parallel_equivalence.py); and, on the model
itself, every window position's loss at every depth equals one process's, and a cp rank holding no
valid target contributes finite zeros and one process's gradients (context_worker.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests import processes
from tests.distributed import context_worker
from tests.distributed import test_parallel_equivalence as eq

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DOCS = "data.document_mask=true"
# worker.PRESETS["qwen4"]: Gated DeltaNet, QSA (selecting), PLE, hyper-connections
Q4 = "preset.qwen4=1"
LAYOUTS = {
    # (with padding across the chunk edges: the aux and z losses over the window leave it out)
    f"cp=2,{DOCS},{eq.AUX}": 2,
    # recomputed blocks repeat their exchanges in backward
    "cp=2,cp_sharding=contiguous,train.activation_checkpointing=full": 2,
    f"cp=4,{DOCS}": 4,
    # the teachers are the whole window's: depth k at t reads the trunk's at t + k, across chunk
    # edges
    f"cp=2,train.distill=argmax,{DOCS}": 2,
    "cp=2,mtp.loss.objective=acceptance": 2,
    # cp x tp + SP with the full-attention families' attention (the 8-rank layouts below run the
    # seed model's Gated DeltaNet and QSA), in fp32, where parameters are compared; cp x ep: the
    # seed model's below
    f"cp=2,tp=2,sequence_parallel=true,{DOCS}": 4,
    "cp=2,pp=2,pp_schedule=interleaved_1f1b": 4,
    "cp=2,dp=2,dp_mode=allreduce": 4,
    # Qwen4-Exp: the chunks' Gated DeltaNet carry and conv halos, QSA selecting over the gathered
    # window (and its KL over the rank's queries), PLE's n-gram and conv halos, the aux loss over
    # the window
    f"cp=2,{Q4},{DOCS}": 2,
    # MLA's per-head keys and values (wider and narrower than GQA's) gathered over the window
    f"cp=2,preset.mla=1,{DOCS}": 2,
    f"cp=2,ep=2,{Q4},{DOCS}": 4,
    # MTP depth 1's QSA selection (this rank's queries over the window's blocks) crosses a stage
    # boundary
    f"cp=2,pp=2,pp_layout=[4:0],pp_depth_stages=[1:0:1],{Q4},{DOCS}": 4,
    # the flagship's degrees with context parallelism on 8 ranks, on the seed model (every layer
    # kind; the full-attention families' pieces are each in a layout above), three at a time (all
    # four, 16 ranks, cost the suite's 2 cores a minute and a half): tp x ep + SP, a stage mesh of
    # cp x ep x tp with PLE's table split 8 ways and the router loads summed over it (16 s on the
    # shared launch), and tp x pp + SP, whose stages exchange activations cut by both tp and cp
    # (11 s)
    f"tp=2,ep=2,cp=2,sequence_parallel=true,{Q4},{DOCS}": 8,
    f"tp=2,pp=2,cp=2,sequence_parallel=true,{Q4},{DOCS}": 8,
}
BF16_LAYOUTS = {
    f"cp=2,{DOCS},{eq.BF16}": 2,
    f"cp=2,{Q4},{eq.BF16}": 2,
    # (cp x tp + SP: in fp32 above, where parameters are compared; its bf16 parts: cp alone here,
    # tp + SP in test_parallel_equivalence)
    f"cp=2,ep=2,{Q4},{eq.BF16}": 4,
}


@pytest.fixture(scope="module")
def runs(training_layout_runs):
    """LAYOUTS and BF16_LAYOUTS trained (tests/conftest.py: one launch per world size with the other
    modules')."""
    return training_layout_runs


references = eq.references


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(layout, runs, references, monkeypatch):
    monkeypatch.setattr(eq, "LAYOUTS", LAYOUTS)
    eq.test_layout_matches_single_process(layout, runs, references)


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS))
def test_context_parallel_bf16_layout_matches_single_process(layout, runs, references, monkeypatch):
    monkeypatch.setattr(eq, "BF16_LAYOUTS", BF16_LAYOUTS)
    # the hyper-connections normalise the fp32 streams in fp32 (test_qwen4_layouts.py)
    if Q4 in layout:
        monkeypatch.setattr(eq, "FP32_OUTPUTS", eq.FP32_OUTPUTS | {"RMSNorm"})
    eq.test_bf16_layout_matches_single_process(layout, runs, references)


# per-token checks on the model: (layout, cp ranks)
PER_TOKEN = {
    f"cp=2,{DOCS}": 2,
    f"cp=4,cp_sharding=contiguous,{DOCS}": 4,
    f"cp=2,{Q4},{DOCS}": 2,
    # 4-token chunks: PLE's 9-row conv halo spans three chunks before
    f"cp=4,{Q4},data.seq_len=32,{DOCS}": 4,
}


# in the suite's shared launches (shared_launch.py)
SHARED_JOBS = [(world, context_worker.__name__,
                [layout for layout, w in PER_TOKEN.items() if w == world])
               for world in sorted(set(PER_TOKEN.values()))]


@pytest.fixture(scope="module")
def per_token_runs(shared_jobs):
    return shared_jobs


@pytest.mark.parametrize("layout", list(PER_TOKEN))
def test_per_token_per_depth_losses_and_an_empty_rank(layout, per_token_runs):
    torch.set_num_threads(1)
    ref = context_worker.measure(layout)
    ranks = [torch.load(per_token_runs / f"{layout}.rank{r}.pt", weights_only=False)
             for r in range(PER_TOKEN[layout])]
    # every position of the window, every depth (0 = the trunk's head), on every rank's gathered
    # copy
    for r in ranks:
        torch.testing.assert_close(r["per_token"], ref["per_token"], rtol=1e-5, atol=1e-5)
    assert bool((ref["per_token"]
                 > 0).any(dim=-1).all()), "a depth or row without a single valid target"
    # cp rank 1 holds no valid target: finite zeros, and the sums over ranks are one process's
    assert torch.equal(ranks[1]["loss_sums"], torch.zeros_like(ranks[1]["loss_sums"]))
    torch.testing.assert_close(sum(r["loss_sums"] for r in ranks), ref["loss_sums"], rtol=1e-5,
                               atol=1e-5)
    # (a zero-initialised PLE conv passes no gradient to its input norm at step 0: nearly all others
    # do)
    flowing = [name for name, g in ref["grads"].items() if bool(g.abs().sum() > 0)]
    assert len(flowing) >= 0.95 * len(ref["grads"]), sorted(set(ref["grads"]) - set(flowing))
    # (per parameter: fp32 sums in another order move single elements)
    for name, g in ref["grads"].items():
        err = float((ranks[0]["grads"][name].double() - g.double()).norm())
        assert err <= 1e-4 * float(g.double().norm()) + 1e-10, f"{name}: gradient off by {err:.2e}"


CARRY_RANK = r'''
import torch, torch.distributed as dist
dist.init_process_group("gloo")
from tandem.trainer.parallel.context import ContextShards
for sharding in ("zigzag", "contiguous"):
    cs = ContextShards(dist.group.WORLD, sharding)
    g = torch.Generator().manual_seed(0)
    B, H, Dk, Dv, total = 2, 2, 4, 3, cs.total
    # a transition as Gated DeltaNet's chunk product: decay * prod(I - beta k k^T), not symmetric
    T = torch.eye(Dk).expand(B, total, H, Dk, Dk).clone()
    for _ in range(3):
        k = torch.nn.functional.normalize(torch.randn(B, total, H, Dk, 1, generator=g), dim=-2)
        T = (torch.eye(Dk) - 0.6 * k @ k.transpose(-1, -2)) @ T
    T = 0.9 * T
    F = torch.randn(B, total, H, Dk, Dv, generator=g)
    state, entering = torch.zeros(B, H, Dk, Dv), []
    for c in range(total):  # one process: the state entering each chunk of the window
        entering.append(state)
        state = T[:, c] @ state + F[:, c]
    expected = torch.stack(entering, 1)[:, cs.mine].reshape(B * len(cs.mine), H, Dk, Dv)
    got = cs.carry(T[:, cs.mine].reshape(-1, H, Dk, Dk), F[:, cs.mine].reshape(-1, H, Dk, Dv))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=sharding)
dist.destroy_process_group()
'''


def test_carry_is_the_sequential_fold_of_the_window():
    """ContextShards.carry (Gated DeltaNet's state entering each chunk) at cp=4, both shardings,
    against the one-process fold, on transitions that are neither symmetric nor near zero: the
    tiny model's decays and packed documents make the carried states nearly vanish in the
    per-token checks, which passed a transposed transition at cp=2."""
    proc = processes.command([sys.executable, "-c", CARRY_RANK], 4, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
