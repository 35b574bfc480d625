"""Expert parallelism's two dispatches (`parallel.ep_dispatch`, trainer/parallel/tensor.py
ParallelExperts) on one MoE layer over ep=2 (2 processes on gloo): both equal the one-process layer
(outputs, input and parameter gradients); `padded` waits for the device nowhere in forward or
backward while `exact` reads its split sizes back; the shared expert's matmuls are issued while the
token copies are in flight; and each, compiled with train.compile's settings, traces into one graph
(no break, no recompile) that serves inputs whose split sizes differ, matching the one-process layer
on each. Each dispatch runs with the grouped expert kernel and with the per-expert loop
(`model.expert_matmul=loop`).

top_k=3 of 4 experts, 2 per rank: a token sends up to 2 copies to one rank, so `padded`'s capacity
(tokens x min(top_k, experts per rank)) is tighter than every copy (tokens x top_k) and is
reached."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.models import ModelConfig
from tandem.models.moe import MoE
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.recipe import load_config
from tests.distributed import worker
from tests.unit.test_decode_host_sync import HostSyncs

TOKENS, HIDDEN = 12, 32  # per rank
ROUTINGS = 3  # compiled runs, on inputs routed differently (`routing_inputs`)
# (dispatch, model.expert_matmul): the grouped kernel, and the per-expert loop (devices without the
# grouped kernel), which must pass over the padded dispatch's padding rows: the two ranks receive
# 2 x 2 blocks of TOKENS x 2 rows (96) for 2 x TOKENS x 3 copies (72), so there are always some
CASES = [("exact", "auto"), ("padded", "auto"), ("exact", "loop"), ("padded", "loop")]


def case_name(mode: str, matmul: str) -> str:
    return mode if matmul == "auto" else f"{mode},{matmul}"


def make_moe(expert_matmul: str = "auto") -> MoE:
    cfg = ModelConfig(hidden_size=HIDDEN, moe_intermediate_size=16, num_experts=4, top_k=3,
                      num_shared_experts=1, expert_matmul=expert_matmul)
    moe = MoE(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return moe


def data(world: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(world * TOKENS, HIDDEN, generator=g), torch.randn(world * TOKENS, HIDDEN,
                                                                         generator=g)


def routing_inputs(world: int) -> list:
    """The compiled runs' inputs (all ranks' rows): the test's data, its negation, and fresh
    draws."""
    x_all = data(world)[0]
    g = torch.Generator().manual_seed(2)
    return [x_all, -x_all] + [torch.randn(x_all.shape, generator=g) for _ in range(ROUTINGS - 2)]


def copies_per_source_and_destination(moe: MoE, x_all: torch.Tensor) -> tuple:
    """(source rank, destination rank) -> token copies, the exact dispatch's split sizes for x_all
    (rank r holds rows r*TOKENS.. and experts 2r, 2r+1)."""
    with torch.no_grad():
        _, indices, _ = moe.router(x_all)
    dest = indices // 2
    return tuple(int((dest[r * TOKENS:(r + 1) * TOKENS] == d).sum()) for r in range(2)
                 for d in range(2))


class OpOrder(TorchDispatchMode):
    """The names of the ops run while active, in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def matmuls_while_dispatching(names) -> int:
    """Matmuls issued between the token copies' all-to-all (the second: the counts go first) and the
    routed experts' first grouped matmul, which reads the copies that arrived."""
    start = [i for i, n in enumerate(names) if n.endswith("all_to_all_single")][1]
    end = names.index("tandem.grouped_mm", start)
    return sum(1 for n in names[start:end] if n in ("aten.mm", "aten.addmm"))


def _rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import init_device_mesh

    from tandem.trainer.parallel.compile import configure_compiler
    from tandem.trainer.parallel.expert import parallelize_moe
    from tandem.trainer.parallel.sharded_params import local

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    x_all, grad_all = data(world)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    result = {}
    for mode, matmul in CASES:
        moe = make_moe(matmul)
        parallelize_moe(moe, None, mesh, mesh, ep_dispatch=mode)
        mode = case_name(mode, matmul)
        x = x_all[rows].clone().requires_grad_()
        with OpOrder() as order:
            y = moe(x)
        with HostSyncs() as syncs:
            y2 = moe(x)
            (y2 * grad_all[rows]).sum().backward()
        result[mode] = {"syncs": dict(syncs.counts), "y": y.detach(), "y2": y2.detach(),
                        "grad_x": x.grad,
                        "grads": {n: local(p.grad).clone() for n, p in moe.named_parameters()},
                        "overlapped_matmuls": matmuls_while_dispatching(order.names)
                        if matmul != "loop" else None}
        # compiled as train.compile compiles (fullgraph off, which dynamo also reads as "graph-break
        # on `.tolist()`" unless configured otherwise): one graph, no break, for every routing; the
        # inputs below send different numbers of copies to each rank, which a graph specialised on
        # the split sizes would recompile for
        configure_compiler()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(moe.forward, backend=counter)
        outs = []
        for x_routed in routing_inputs(world):
            xs = x_routed[rows].clone().requires_grad_()
            ys = compiled(xs)
            (ys * grad_all[rows]).sum().backward()
            outs.append((ys.detach(), xs.grad))
        result[mode]["compiled"] = {"frames": counter.frame_count, "outs": outs}
    torch.save(result, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_padded_dispatch_is_exact_and_syncless(tmp_path):
    out = str(tmp_path / "result")
    worker.spawn_ranks(_rank, 2, out)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]

    ref = make_moe()  # one process, all tokens
    x_all, grad_all = data(2)
    x_all.requires_grad_()
    y_ref = ref(x_all)
    ref_routed = make_moe()  # the compiled runs' reference
    (y_ref * grad_all).sum().backward()
    for mode in (case_name(*case) for case in CASES):
        got = [r[mode] for r in ranks]
        torch.testing.assert_close(torch.cat([g["y"] for g in got]), y_ref.detach(), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(torch.cat([g["y2"] for g in got]), y_ref.detach(), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(torch.cat([g["grad_x"] for g in got]), x_all.grad, rtol=1e-5,
                                   atol=1e-6)
        for name, p in ref.named_parameters():
            if name.startswith("experts."):  # expert-sharded: rank r holds experts 2r, 2r+1
                grad = torch.cat([g["grads"][name] for g in got])
            else:  # replicated: each rank's gradient covers its own tokens
                grad = got[0]["grads"][name] + got[1]["grads"][name]
            torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
        # the shared expert's gate, up and down projections run while the copies travel
        if "loop" not in mode:  # (the loop's own matmuls are aten.mm too)
            assert all(g["overlapped_matmuls"] == 3 for g in got), [g["overlapped_matmuls"]
                                                                    for g in got]
        # compiled: one graph for all routings, equal to the one-process layer on each
        assert [g["compiled"]["frames"]
                for g in got] == [1, 1], (mode, [g["compiled"]["frames"] for g in got])
        splits = set()
        for i, x_routed in enumerate(routing_inputs(2)):
            xs = x_routed.clone().requires_grad_()
            ys = ref_routed(xs)
            (ys * grad_all).sum().backward()
            splits.add(copies_per_source_and_destination(ref_routed, xs.detach()))
            torch.testing.assert_close(torch.cat([g["compiled"]["outs"][i][0] for g in got]),
                                       ys.detach(),
                                       rtol=1e-5, atol=1e-6, msg=f"{mode} compiled, input {i}")
            torch.testing.assert_close(torch.cat([g["compiled"]["outs"][i][1] for g in got]),
                                       xs.grad,
                                       rtol=1e-5, atol=1e-6,
                                       msg=f"{mode} compiled input grad, input {i}")
        assert len(splits) == ROUTINGS, splits  # the all-to-alls' sizes differ between the runs
    assert all(r["padded"]["syncs"] == {} for r in ranks), [r["padded"]["syncs"] for r in ranks]
    assert all(r["exact"]["syncs"].get("tolist",
                                       0) > 0 for r in ranks), [r["exact"]["syncs"] for r in ranks]


def test_unknown_dispatch_is_a_one_line_error_naming_the_key():
    with pytest.raises(ConfigError,
                       match=r"^config key 'parallel.ep_dispatch'='fast' must be exact or padded$"):
        load_config(None, ["parallel.ep_dispatch=fast"])
