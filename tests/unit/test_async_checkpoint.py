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


def test_an_async_save_is_committed_once_written_not_at_the_next_save(tmp_path):
    """An async save was committed only by the next save or the end of training: a checkpoint
    interval after it was written, `tandem eval`, a watcher or keep_last did not see it. Now the
    first `publish_written()` after its write commits it, once; a save still being written and a
    failed one are left to `finish()`."""
    from concurrent.futures import Future

    from tandem.trainer import checkpoint as ckpt
    from tandem.trainer.checkpoint_dirs import list_checkpoints

    model = torch.nn.Linear(4, 4)
    writer = ckpt.CheckpointWriter(str(tmp_path), keep_last=1, async_save=True)
    for step in (1, 2):
        writer.save(step, model, None, "a: 1\n", {})
        writer.pending[0].result()  # the background write, done
        assert [s for s, _ in list_checkpoints(str(tmp_path))[0]] == [step - 1] * (step > 1)
        writer.publish_written()
        assert [s for s, _ in list_checkpoints(str(tmp_path))[0]] == [step]  # keep_last pruned 1
        writer.publish_written()
    assert writer.finish() == os.path.join(str(tmp_path), "checkpoints", "step_2")
    assert [s for s, _ in list_checkpoints(str(tmp_path))[0]] == [2]
    # in flight, or failed: not committed here
    running, failed = Future(), Future()
    failed.set_exception(OSError("disk full"))
    for future in (running, failed):
        writer.pending, writer.published = (future, 3, str(tmp_path / "x")), False
        writer.publish_written()
        assert not writer.published and [s for s, _ in list_checkpoints(str(tmp_path))[0]] == [2]


def _marked(path, content: str = "1") -> None:
    from tandem.trainer.checkpoint_dirs import MARKER

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MARKER), "w") as f:
        f.write(content)


def test_a_steps_newest_whole_copy_is_the_one_read_and_settling_keeps_the_only_good_one(tmp_path):
    """A step saved again leaves, for a moment, its new copy (`.tmp_`) and the one it replaces
    (`.stale_`), both marked: the new one is the step. And when the new `step_N`'s marker never
    reached the disk (empty) beside a complete `.stale_step_N`, settling keeps the stale copy:
    it is the only good one."""
    from tandem.trainer import checkpoint_dirs as dirs

    root = tmp_path / "checkpoints"
    _marked(str(root / ".tmp_step_2"))
    _marked(str(root / ".stale_step_2"))
    assert dirs.list_checkpoints(str(tmp_path))[0] == [(2, str(root / ".tmp_step_2"))]
    _marked(str(root / "step_3"), content="")
    _marked(str(root / ".stale_step_3"))
    dirs.settle_saves(str(tmp_path))
    assert (3, str(root / ".stale_step_3")) in dirs.list_checkpoints(str(tmp_path))[0]
