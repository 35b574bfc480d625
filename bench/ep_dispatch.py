"""Expert parallelism's two dispatches (`parallel.ep_dispatch`) side by side: step time and host syncs.

`python bench/ep_dispatch.py` launches a small MoE model's training step under ep=2 (2 CPU ranks) and
then tp2 x ep2 + SP (4 ranks) under torchrun (gloo). Every rank builds the model twice, `exact` (split
sizes read back by the host, one sync per MoE layer per forward) and `padded` (fixed-capacity blocks,
counts on the device), warms both up, then times training steps of the two alternately, so machine
noise hits both alike. A step is the trainer's forward_backward over the rank's micro-batches, gradient
clipping, router-bias update and AdamW, between two barriers; rank 0 reports the median of each. One
more (untimed) step per side counts rank 0's device-to-host syncs in forward_backward (all the model's
and the loss's, not only the dispatch's; tests/unit/test_decode_host_sync.py `HostSyncs`).

CPU figures on gloo say little about an accelerator: a CPU never waits on a "device", so the host syncs
cost nothing here, while `padded`'s larger all-to-all (ep x the rows when experts per rank >= top_k)
and its padding's memory traffic do cost; on a GPU the syncs stall the host's launch queue (the
pipeline schedule's thread included) and `padded` removes them. The figure to trust on a GPU is this
script's ratio measured there. Shared machines make single runs noisy: the spread (min..max) of each
side is printed beside its median.

    python bench/ep_dispatch.py [--steps 6] [--warmup 2] [--dtype fp32|bf16] [--layouts ep=2 tp=2,ep=2,...]
ends with one line per layout: padded_over_exact_step_time[<layout>]=<median padded / median exact>
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ["ep=2", "tp=2,ep=2,sequence_parallel=true"]
MBS, ACCUM, SEQ, VOCAB = 2, 2, 128, 2048
MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=2",
         "model.intermediate_size=512", "model.moe_intermediate_size=128", "model.num_experts=8", "model.top_k=2",
         "model.num_shared_experts=1", "model.first_k_dense=1", "model.balance=aux_free", "model.max_seq_len=256",
         "mtp.num_steps=1", "mtp.num_layers=1", f"data.seq_len={SEQ}", f"train.micro_batch_size={MBS}",
         f"train.grad_accum_steps={ACCUM}", "logging.wandb=false", "eval.interval=0", "device=cpu",
         "run.dir=/tmp/tandem_bench_unused"]
SIDES = ("exact", "padded")


def _batches(step: int, dp_rank: int, dp_size: int):
    g = torch.Generator().manual_seed(step)
    n = MBS * ACCUM
    tokens = torch.randint(0, VOCAB, (n * dp_size, SEQ + 1), generator=g)[dp_rank * n:(dp_rank + 1) * n]
    return [{"tokens": tokens[i * MBS:(i + 1) * MBS], "loss_mask": torch.ones(MBS, SEQ),
             "doc_ids": torch.zeros(MBS, SEQ + 1, dtype=torch.long)} for i in range(ACCUM)]


# --- worker (under torchrun) -------------------------------------------------------------------------
def worker(out_path: str, layout: str, dtype: str, warmup: int, steps: int) -> None:
    import torch.distributed as dist

    from tandem.trainer.config import load_config
    from tandem.trainer.loop import Trainer, build_model
    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device

    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
    from test_decode_host_sync import HostSyncs

    torch.set_num_threads(1)
    parallel = [f"parallel.{kv}" for kv in layout.split(",")]
    sides, mesh_state = {}, None
    for name in SIDES:
        cfg = load_config(None, MODEL + parallel + [f"train.dtype={dtype}", f"parallel.ep_dispatch={name}"])
        cfg.model.vocab_size = VOCAB
        mesh_state = mesh_state or init_parallel(cfg, resolve_device("cpu"))
        pstate = dataclasses.replace(mesh_state, extras=dict(mesh_state.extras))
        model = build_model(cfg, pstate)
        sides[name] = (cfg, pstate, Trainer.for_model(cfg, model.train(), pstate))

    def step(name: str, i: int, counter=None) -> float:
        cfg, pstate, tr = sides[name]
        batches = _batches(i, pstate.dp_rank, pstate.dp_size)
        dist.barrier()
        start = time.perf_counter()
        counts = tr.global_target_counts(batches)
        with counter or contextlib.nullcontext():
            losses = tr.forward_backward(batches, counts, depth_coefficients(cfg.mtp, i))
        pstate.all_reduce_dp(losses)
        tr.clip_gradients()
        tr.update_router_biases()
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - start

    times = {name: [] for name in sides}
    for i in range(warmup + steps):
        for name in sides:  # alternate, so drift in the machine's load hits both sides alike
            t = step(name, i)
            if i >= warmup:
                times[name].append(t)
    syncs = {}
    for name in sides:
        counter = HostSyncs()
        step(name, warmup + steps, counter)
        syncs[name] = dict(counter.counts)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "syncs": syncs}, f)
    dist.destroy_process_group()


def run_layout(layout: str, dtype: str, warmup: int, steps: int) -> dict:
    world = 1
    for kv in layout.split(","):
        key, _, value = kv.partition("=")
        if key in ("tp", "ep", "pp", "dp"):
            world *= int(value)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--worker", out, layout, dtype, str(warmup), str(steps)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"{layout} failed under torchrun")
        with open(out) as f:
            result = json.load(f)
    result["world"] = world
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=LAYOUTS, help="parallel.* items, comma-separated, per run")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        out, layout, dtype, warmup, steps = a.worker
        worker(out, layout, dtype, int(warmup), int(steps))
        return 0
    ratios = []
    for layout in a.layouts:
        r = run_layout(layout, a.dtype, a.warmup, a.steps)
        print(f"layout {layout} on {r['world']} CPU ranks, {a.dtype}, {MBS * ACCUM} x {SEQ} tokens per batch rank, "
              f"{a.steps} timed steps per side (interleaved)")
        print(f"{'side':8s} {'median s/step':>14s} {'min':>8s} {'max':>8s} {'fwd+bwd host syncs':>18s}  (rank 0, by kind)")
        for name in SIDES:
            ts, syncs = r["times"][name], r["syncs"][name]
            print(f"{name:8s} {statistics.median(ts):14.3f} {min(ts):8.3f} {max(ts):8.3f} {sum(syncs.values()):18d}  "
                  f"{syncs}")
        ratios.append((layout, statistics.median(r["times"]["padded"]) / statistics.median(r["times"]["exact"])))
    for layout, ratio in ratios:
        print(f"padded_over_exact_step_time[{layout}]={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
