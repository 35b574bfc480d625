"""Which kernel the routed experts run: the grouped-matmul probe runs at each layer's own widths (a
kernel that accepts a tiny case can reject a real layer, as torch_npu's grouped matmul does for some
shapes, and the other way round), and a run says which path its layers take (a line at start and the
`moe/expert_path` metric). The device kernel is stood in for by a `torch._grouped_mm` that rejects
chosen widths, as the device's would."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tandem.models import experts as experts_module
from tandem.models.experts import GroupedExperts, expert_path, expert_paths

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                reason="torch._grouped_mm needs torch >= 2.9")

CPU = torch.device("cpu")


@pytest.fixture
def picky_kernel(monkeypatch):
    """A grouped kernel that rejects operands with a dimension in `rejected` (a fresh probe cache);
    `calls` counts the calls it ran."""
    real = torch._grouped_mm
    state = {"rejected": set(), "calls": 0}

    def grouped_mm(a, b, offs=None, **kw):
        if {*a.shape, *b.shape} & state["rejected"]:
            raise RuntimeError(f"grouped matmul: unsupported shape {tuple(a.shape)} x "
                               f"{tuple(b.shape)}")
        state["calls"] += 1
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    monkeypatch.setattr(experts_module, "_GROUPED_MM_WORKS", {})
    return state


def experts(inter: int, hidden: int = 32, matmul: str = "auto", seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    layer = GroupedExperts(4, hidden, inter, matmul)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.1)
    return layer


def routed_input(hidden: int = 32):
    torch.manual_seed(1)
    counts = torch.tensor([3, 0, 5, 2])
    return torch.randn(int(counts.sum()), hidden, requires_grad=True), counts


def loop_reference(layer: GroupedExperts, x, counts):
    ref = experts(layer.gate_proj.shape[1], layer.gate_proj.shape[2], "loop")
    ref.load_state_dict(layer.state_dict())
    xr = x.detach().clone().requires_grad_(True)
    out = ref(xr, counts)
    out.square().sum().backward()
    return out, xr.grad, ref.gate_proj.grad


@pytest.mark.parametrize("rejected,expect", [
    ({48}, {32: "grouped", 48: "loop"}),  # the tiny probe passes, one real width does not
    ({8}, {32: "grouped", 48: "grouped"}),  # the tiny probe fails, the real widths run
])
def test_probe_at_each_layers_widths(picky_kernel, rejected, expect):
    """Each layer takes the path its own widths allow: forward and backward run (the rejected width
    on the per-expert loop, the others on the grouped kernel) and equal the per-expert loop."""
    picky_kernel["rejected"] = rejected
    x, counts = routed_input()
    for inter, path in expect.items():
        layer = experts(inter)
        assert expert_path(layer, CPU, torch.float32) == path
        calls = picky_kernel["calls"]
        out = layer(x, counts)
        out.square().sum().backward()
        # forward's three projections and backward's two calls for each (the probe is cached by now)
        assert picky_kernel["calls"] - calls == (9 if path == "grouped" else 0), inter
        ref_out, ref_dx, ref_dgate = loop_reference(layer, x, counts)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, ref_dx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.gate_proj.grad, ref_dgate, rtol=1e-5, atol=1e-6)
        x.grad = None


def test_probe_is_cached_per_shape_and_dtype(picky_kernel):
    picky_kernel["rejected"] = {48}
    for inter in (32, 48, 32):
        expert_path(experts(inter), CPU, torch.float32)
    expert_path(experts(32), CPU, torch.bfloat16)
    assert experts_module._GROUPED_MM_WORKS == {("cpu", torch.float32, 32, 32): True,
                                                ("cpu", torch.float32, 32, 48): False,
                                                ("cpu", torch.bfloat16, 32, 32): True}


def test_probe_is_marked_as_dynamo_marks_a_constant_result():
    """The probe is marked for torch.compile without importing dynamo (experts
    `_constant_under_compile`): what dynamo's own decorator sets, and nothing else."""
    import torch._dynamo

    def probe():
        return True

    def written_out():
        return True

    torch._dynamo.assume_constant_result(probe)
    experts_module._constant_under_compile(written_out)
    assert vars(probe) == vars(written_out) == {"_dynamo_marked_constant": True}
    assert experts_module._grouped_mm_works._dynamo_marked_constant is True


def test_expert_paths_summary(picky_kernel):
    picky_kernel["rejected"] = {48}
    model = nn.ModuleList([experts(32), experts(48), experts(48), experts(16, matmul="loop")])
    value, line = expert_paths(model, CPU, torch.bfloat16)
    assert value == "mixed"
    assert line == ("MoE experts on cpu: grouped matmul in 1 of 4 layers, per-expert loop (a host "
                    "sync per layer) "
                    "in 3: model.expert_matmul=loop; the grouped kernel does not run hidden 32 x "
                    "expert width 48 "
                    "in bfloat16")
    assert expert_paths(nn.ModuleList([experts(32), experts(64)]), CPU, None)[0] == "grouped"
    assert expert_paths(nn.ModuleList([experts(48)]), CPU, None)[0] == "loop"
    assert expert_paths(nn.Linear(2, 2), CPU, None) == ("", "")
    with pytest.raises(RuntimeError,
                       match="model.expert_matmul=grouped: .* hidden 32 / expert width 48"):
        expert_paths(nn.ModuleList([experts(48, matmul="grouped")]), CPU, None)


def test_training_run_reports_its_expert_path(picky_kernel, tmp_path, capfd, corpus_cache):
    """A run whose expert width the kernel rejects trains on the per-expert loop and says so: one
    line at start, `moe/expert_path` in its records (before, the 8x8 probe passed and the first
    forward raised)."""
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config
    from tests.conftest import TINY_OVERRIDES

    picky_kernel["rejected"] = {32}  # model.moe_intermediate_size
    run = tmp_path / "run"
    train(load_config("recipes/tiny.yaml", TINY_OVERRIDES + [
        f"run.dir={run}", "train.max_steps=1", f"data.cache_dir={corpus_cache}",
        "checkpoint.save_final=false"]))
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert records[-1]["moe/expert_path"] == "loop"
    err = capfd.readouterr().err
    assert "MoE experts on cpu: grouped matmul in 0 of " in err
    assert "the grouped kernel does not run hidden 32 x expert width 32 in float32" in err
