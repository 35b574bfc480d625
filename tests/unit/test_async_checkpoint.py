"""Asynchronous checkpoints on NCCL/HCCL jobs (issue 20, item 1).

torch 2.13's `dcp.async_save` refuses a process group without a CPU backend ("A CPU backend must be
enabled for async save"), which is what a default group created with `nccl` or `hccl` alone is. The
CPU suite's gloo group always has one, so these tests build the GPU situation on CPU. Last, an
Ascend run's checkpoint (its NPU generator state) resumed on a machine without NPUs."""

import os
import types

import pytest
import torch
import torch.distributed as dist

from tandem.trainer.parallel.device import Device


class _Stop(Exception):
    pass


@pytest.mark.parametrize("kind,backend,expected", [("cuda", "nccl", "cpu:gloo,cuda:nccl"),
                                                   ("npu", "hccl", "cpu:gloo,npu:hccl"),
                                                   ("cpu", "gloo", "gloo")])
def test_default_group_gets_a_cpu_backend(monkeypatch, kind, backend, expected):
    """The default group Tandem creates maps CPU tensors to gloo beside the device's backend."""
    from tandem.trainer.parallel import layout

    seen = {}

    def fake_init(backend=None, **kwargs):
        seen["backend"] = backend
        raise _Stop

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    cfg = types.SimpleNamespace(parallel=types.SimpleNamespace(pp=1, dp=2, ep=1, tp=1,
                                                               sequence_parallel=False))
    with pytest.raises(_Stop):
        layout.build_parallel_state(cfg, Device(kind, backend, torch.device("cpu")), 2, 2)
    assert seen["backend"] == expected


def test_async_save_without_a_cpu_backend_in_the_default_group(monkeypatch, tmp_path):
    """A default group with a device backend only (`cuda:gloo` stands in for `nccl` on CPU: no CPU
    backend either) still saves asynchronously: async_save is handed a group with a CPU backend."""
    from torch.distributed import checkpoint as dcp

    from tandem.trainer import checkpoint as ckpt

    assert not dist.is_initialized()
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert torch.device("cpu") not in dist.distributed_c10d._get_default_group()._device_types
        # the writer's barriers would run on the device (cuda) with NCCL; one process needs none
        monkeypatch.setattr(ckpt, "_barrier", lambda: None)
        real, groups = dcp.async_save, []

        def recording_async_save(*args, **kwargs):
            groups.append(kwargs.get("process_group"))
            return real(*args, **kwargs)

        monkeypatch.setattr(dcp, "async_save", recording_async_save)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        writer = ckpt.CheckpointWriter(str(tmp_path), async_save=True)
        writer.save(1, model, optimizer, "a: 1\n", {})
        final = writer.finish()
        assert len(groups) == 1 and groups[0] is not None
        assert torch.device("cpu") in groups[0]._device_types
        assert os.path.exists(os.path.join(final, ckpt.MARKER))
    finally:
        dist.destroy_process_group()


def test_an_ascend_runs_rng_state_resumes_on_a_machine_without_npus(tmp_path):
    """A checkpoint saved on Ascend holds the NPU generator's state beside the CPU one: on a machine
    without torch_npu (`torch.npu` does not exist) the resume restores the rest and skips it. It
    failed with AttributeError, a traceback the CLI did not catch."""
    from tandem.trainer import checkpoint as ckpt

    assert getattr(torch, "npu", None) is None
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    final = ckpt.save_checkpoint(str(tmp_path), 1, model, optimizer, "a: 1\n", {"step": 1})
    rng = os.path.join(final, "rng", "rank0.pt")
    torch.manual_seed(7)
    state = {**torch.load(rng, weights_only=True), "torch": torch.get_rng_state(),
             "npu": torch.zeros(16, dtype=torch.uint8)}
    want = torch.rand(3)
    torch.save(state, rng)
    torch.manual_seed(0)
    assert ckpt.load_checkpoint(final, model, optimizer)["step"] == 1
    assert torch.equal(torch.rand(3), want)
