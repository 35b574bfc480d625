"""FSDP memory under gradient accumulation: trainer/estimate.py's per-rank figure beside the
measured peak, in both `parallel.reshard_after_microbatch` modes, and what each mode communicates.

`python bench/fsdp_accumulation_memory.py [--pp]` trains a small MoE + MTP model (about 9M
parameters, parameter memory well above its activations, so the modes' difference is visible) for
two steps of 4 micro-batches under torchrun (gloo, CPU) at dp=2 (FSDP over two ranks; `--pp` adds
pp=2 x dp=2 on four), each in fp32 and bf16, each with a sync every micro-batch (`every`, the
default) and one per step (`once`, reshard_after_microbatch=false).

How the peak is measured: each of the steps after the first (AdamW's state already exists, as in
steady training) runs under `LiveTensorBytes`, a TorchDispatchMode that counts every storage an op
returns (forward and autograd's backward, FSDP's gathers, reduce-scatter buffers, optimizer
temporaries) from its creation until the storage is freed (a weakref on the storage), follows
`UntypedStorage.resize_` (FSDP2 frees and refills its unsharded parameters that way) and starts from
every tensor storage alive in the process when the step begins (sharded parameters, buffers, AdamW's
moments). Tensor bytes only: what torch.cuda.max_memory_allocated would report on a GPU, without
allocator slack or the process's other memory (its RSS would add glibc's heap retention, page
granularity and the libraries). One step's count is exact, but not repeatable to the MiB: a
collective's buffer that gloo's work thread holds last is freed when that thread lets it go, which
on a busy machine can be after the next micro-batch's allocations (the `every` mode's peak measured
102.8 to 105.9 MiB over runs of the fp32 case, which moved the difference between the modes from
0.98 to 0.67 of its estimate). The peak is therefore the least over `TRACKED_STEPS` steps, the one
no late free raised. (The CPU allocator's profiler events, which bench/qwen4_exp_trunk.py sums, miss
frees made outside the profiled thread here (gloo's work threads drop the collectives' buffers):
their running sum climbed by up to 30 MiB per step where the live storages did not.) The peak is the
largest over the ranks, as the estimate is for the rank holding most.

Printed per layout, dtype and mode: the estimate's total and its parts (states, activations, FSDP's
gathered copies, the root group's gradient buffers, the single-sync mode's accumulation), the
measured peak and measured / estimate; per layout and dtype the difference between the modes,
estimated and measured; and per mode the bytes one rank sends to the all-gathers and reduce-scatters
of a step (bench/comm_volume.py's counter) and the step time (CPU, gloo, a shared 2-core machine:
indicative only). Ends with `delta_measured_over_estimated=<worst>` and
`peak_over_estimate=<min>..<max>`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import run_bench, run_under_torchrun  # noqa: E402

MBS, ACCUM, SEQ, VOCAB = 2, 4, 64, 4096
BASE = [
    "model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=1024", "model.moe_intermediate_size=256", "model.num_experts=4",
    "model.top_k=2",
    "model.num_shared_experts=1", "model.first_k_dense=1", "model.balance=aux_free",
    "model.max_seq_len=128",
    f"model.vocab_size={VOCAB}", "mtp.num_steps=1", "mtp.num_layers=1", "mtp.loss_chunk_tokens=128",
    f"data.seq_len={SEQ}", f"train.micro_batch_size={MBS}", f"train.grad_accum_steps={ACCUM}",
    "train.grad_clip=1.0",
    "logging.wandb=false", "eval.interval=0", "device=cpu", "run.dir=/tmp/tandem_bench_unused",
]
TRACKED_STEPS = 3
"""Steps measured per case; the least peak counts (see the module docstring)."""
LAYOUTS = {"dp=2": 2}
PP_LAYOUTS = {"pp=2,dp=2": 4}
MODES = {"every": "true", "once": "false"}
MIB = 2**20


def overrides(layout: str, dtype: str, mode: str):
    return BASE + [f"parallel.{kv}" for kv in layout.split(",")] + [
        f"train.dtype={dtype}", f"parallel.reshard_after_microbatch={MODES[mode]}"]


def batches(step: int, pstate):
    g = torch.Generator().manual_seed(step)
    n = MBS * ACCUM
    full = torch.randint(0, VOCAB, (n * pstate.dp_size, SEQ + 1), generator=g)
    mine = full[pstate.dp_rank * n:(pstate.dp_rank + 1) * n]
    return [{"tokens": mine[i * MBS:(i + 1) * MBS], "loss_mask": torch.ones(MBS, SEQ),
             "doc_ids": torch.zeros(MBS, SEQ + 1, dtype=torch.long)} for i in range(ACCUM)]


def make_live_tensor_bytes():
    """`LiveTensorBytes()`: a dispatch mode whose `.peak` is the most bytes of tensor storage alive
    at once while it is active (see the module docstring)."""
    import gc
    import weakref

    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveTensorBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes, self.current, self.peak = {}, 0, 0

        def _set(self, key, nbytes: int) -> None:
            self.current += nbytes - self.sizes.get(key, 0)
            self.sizes[key] = nbytes
            self.peak = max(self.peak, self.current)

        def _free(self, key) -> None:
            self.current -= self.sizes.pop(key, 0)

        def track(self, t) -> None:
            if isinstance(t, DTensor):
                t = t.to_local()
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return
            st = t.untyped_storage()
            if st._cdata not in self.sizes:
                weakref.finalize(st, self._free, st._cdata)
                self._set(st._cdata, st.nbytes())

        def __enter__(self):
            gc.collect()
            for obj in gc.get_objects():  # everything alive when the step starts
                if isinstance(obj, torch.Tensor):
                    self.track(obj)
            self._resize = torch.UntypedStorage.resize_
            tracker, resize = self, self._resize

            def resize_(st, size):
                out = resize(st, size)
                if st._cdata not in tracker.sizes:
                    weakref.finalize(st, tracker._free, st._cdata)
                tracker._set(st._cdata, st.nbytes())
                return out

            torch.UntypedStorage.resize_ = resize_
            return super().__enter__()

        def __exit__(self, *exc):
            torch.UntypedStorage.resize_ = self._resize
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # let DTensor desugar into the local ops seen below
            if any(t is DTensor for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                self.track(t)
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):  # in-place / out= results
                self.track(t)
            return out

    return LiveTensorBytes()


# --- worker (under torchrun) ----------------------------------------------------------------------
def worker(out_path: str, cases) -> None:
    import torch.distributed as dist
    from comm_volume import make_counter

    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    torch.set_num_threads(1)
    results = {}
    for case in cases:
        layout, dtype, mode = case.split("|")
        cfg = load_config(None, overrides(layout, dtype, mode))
        pstate = init_parallel(cfg, resolve_device("cpu"))
        model = build_model(cfg, pstate)
        tr = TrainStep(cfg, model, pstate)
        model.train()

        def step(s: int, tracker=None) -> None:
            b = batches(s, pstate)
            counts = tr.global_target_counts(b)
            tr.forward_backward(b, counts, depth_coefficients(cfg.mtp, s))
            if tracker is not None:
                tracker.peak_fwd_bwd = tracker.peak
            tr.clip_gradients()
            tr.update_router_biases()
            tr.optimizer.step()
            tr.optimizer.zero_grad(set_to_none=True)

        step(0)
        tracked = []
        for s in range(1, 1 + TRACKED_STEPS):
            dist.barrier()
            tracker = make_live_tensor_bytes()
            with tracker:
                base = tracker.current
                step(s, tracker)
            tracked.append((tracker.peak, tracker.peak_fwd_bwd, base))
        peak, peak_fwd_bwd, base = min(tracked)  # the step no late free of gloo's raised
        dist.barrier()
        counter = make_counter()
        t0 = time.perf_counter()
        with counter:
            step(1 + TRACKED_STEPS)
        seconds = time.perf_counter() - t0
        row = {
            "peak": peak,
            "peak_fwd_bwd": peak_fwd_bwd,
            "base": base,
            "seconds": seconds,
            "all_gather": counter.bytes.get("all_gather", 0),
            "reduce_scatter": counter.bytes.get("reduce_scatter", 0),
        }
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        results[case] = rows
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


# --- driver ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", action="store_true", help="also pp=2 x dp=2 (4 processes)")
    ap.add_argument("--dtypes", default="fp32,bf16",
                    help="comma-separated compute dtypes to measure (fp32, bf16)")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1:])
        return 0
    from tandem.trainer.estimate import estimate
    from tandem.trainer.recipe import load_config

    dtypes = args.dtypes.split(",")
    if not dtypes or not set(dtypes) <= {"fp32", "bf16"}:
        ap.error(f"--dtypes: fp32 and/or bf16, got {args.dtypes!r}")
    layouts = dict(LAYOUTS, **(PP_LAYOUTS if args.pp else {}))
    results = {}
    for layout, world in layouts.items():
        cases = [f"{layout}|{dtype}|{mode}" for dtype in dtypes for mode in MODES]
        results.update(run_under_torchrun(__file__, world, cases))
    print(f"{'layout':10s} {'dtype':5s} {'mode':5s} {'estimate MiB':>12s} "
          f"{'(states act gathered grad_buf accum)':>36s} "
          f"{'measured MiB':>12s} {'meas/est':>8s} {'AG MB':>7s} {'RS MB':>7s} {'step s':>7s}")
    ratios, deltas = [], []
    for layout, world in layouts.items():
        for dtype in dtypes:
            est, meas = {}, {}
            for mode in MODES:
                e = estimate(load_config(None, overrides(layout, dtype, mode)), world)
                rows = results[f"{layout}|{dtype}|{mode}"]
                est[mode], meas[mode] = e.total_gib_per_rank * 2**30, max(r["peak"] for r in rows)
                ratios.append(meas[mode] / est[mode])
                parts = " ".join(f"{x * 1024:.1f}" for x in (e.states_gib_per_rank,
                                                             e.activations_gib_per_rank,
                                                             e.gathered_gib_per_rank,
                                                             e.grad_buffers_gib_per_rank,
                                                             e.accumulation_gib_per_rank))
                ag = max(r["all_gather"] for r in rows) / 1e6
                rs = max(r["reduce_scatter"] for r in rows) / 1e6
                secs = max(r["seconds"] for r in rows)
                print(f"{layout:10s} {dtype:5s} {mode:5s} {est[mode] / MIB:12.1f} {parts:>36s} "
                      f"{meas[mode] / MIB:12.1f} {meas[mode] / est[mode]:8.3f} {ag:7.2f} {rs:7.2f} "
                      f"{secs:7.2f}")
            d_est, d_meas = est["once"] - est["every"], meas["once"] - meas["every"]
            deltas.append(d_meas / d_est)
            print(f"{layout:10s} {dtype:5s} once - every: estimated {d_est / MIB:+.1f} MiB, "
                  "measured "
                  f"{d_meas / MIB:+.1f} MiB (measured / estimated {d_meas / d_est:.3f})")
    worst = max(deltas, key=lambda x: abs(x - 1))
    print(f"delta_measured_over_estimated={worst:.3f} "
          f"peak_over_estimate={min(ratios):.3f}..{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    run_bench(main)
