"""Step time of the flagship layout in miniature with `train.compile` against without, side by side.

`python bench/layout_compile.py` launches tp2 x ep2 x pp2 + SP (1F1B, FSDP2 over the two expert-parallel
batch ranks) on 8 CPU ranks under torchrun (gloo), builds the same model twice in every rank, eager and
compiled (trainer/parallel/compile.py), warms both up (the compiled one compiles there), then times
training steps of the two alternately, so machine noise hits both alike. A step is the trainer's
forward_backward over the rank's micro-batches, gradient clipping, router-bias update and AdamW, between
two barriers; rank 0 reports the median over the timed steps of each.

CPU figures on gloo: 8 processes share the machine's cores, so a step is mostly host overhead,
collective latency and small kernels, not the matmuls a GPU step is made of; the ratio says what
compile does to the layout's host-side cost and fused elementwise work here, not on an accelerator
(bench/gpu_check.py measures one where lent). Shared machines make single runs noisy: the spread
(min..max) of each side is printed beside its median.

    python bench/layout_compile.py [--steps 6] [--warmup 2] [--dtype fp32|bf16]
                                   [--ac none|full|selective] [--layout tp=2,ep=2,pp=2,sequence_parallel=true]
ends with: compiled_over_eager_step_time=<median compiled step time / median eager step time>
"""

from __future__ import annotations

import argparse
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
FLAGSHIP = "tp=2,ep=2,pp=2,sequence_parallel=true"
MBS, ACCUM, SEQ, VOCAB = 2, 4, 128, 2048
MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=2",
         "model.intermediate_size=512", "model.moe_intermediate_size=128", "model.num_experts=8", "model.top_k=2",
         "model.num_shared_experts=1", "model.first_k_dense=1", "model.balance=aux_free", "model.max_seq_len=256",
         "mtp.num_steps=3", "mtp.num_layers=1", f"data.seq_len={SEQ}", f"train.micro_batch_size={MBS}",
         f"train.grad_accum_steps={ACCUM}", "logging.wandb=false", "eval.interval=0", "device=cpu",
         "run.dir=/tmp/tandem_bench_unused"]


def _batches(step: int, dp_rank: int, dp_size: int):
    g = torch.Generator().manual_seed(step)
    n = MBS * ACCUM
    tokens = torch.randint(0, VOCAB, (n * dp_size, SEQ + 1), generator=g)[dp_rank * n:(dp_rank + 1) * n]
    return [{"tokens": tokens[i * MBS:(i + 1) * MBS], "loss_mask": torch.ones(MBS, SEQ),
             "doc_ids": torch.zeros(MBS, SEQ + 1, dtype=torch.long)} for i in range(ACCUM)]


# --- worker (under torchrun) -------------------------------------------------------------------------
def worker(out_path: str, layout: str, dtype: str, ac: str, warmup: int, steps: int) -> None:
    import torch.distributed as dist

    from tandem.trainer.config import load_config
    from tandem.trainer.loop import Trainer, build_model
    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device

    torch.set_num_threads(1)
    parallel = [f"parallel.{kv}" for kv in layout.split(",")]
    sides, mesh_state = {}, None
    for name, compiled in (("eager", False), ("compiled", True)):
        cfg = load_config(None, MODEL + parallel + [f"train.dtype={dtype}", f"train.activation_checkpointing={ac}",
                                                    f"train.compile={str(compiled).lower()}"])
        cfg.model.vocab_size = VOCAB
        mesh_state = mesh_state or init_parallel(cfg, resolve_device("cpu"))
        # one process group and mesh; each model keeps its own layout handles (pipeline schedule, ...)
        pstate = dataclasses.replace(mesh_state, extras=dict(mesh_state.extras))
        model = build_model(cfg, pstate)
        sides[name] = (cfg, pstate, Trainer.for_model(cfg, model.train(), pstate))

    def step(name: str, i: int) -> float:
        cfg, pstate, tr = sides[name]
        batches = _batches(i, pstate.dp_rank, pstate.dp_size)
        dist.barrier()
        start = time.perf_counter()
        counts = tr.global_target_counts(batches)
        pstate.all_reduce_dp(tr.forward_backward(batches, counts, depth_coefficients(cfg.mtp, i)))
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
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default=FLAGSHIP, help="parallel.* items, comma-separated (8 ranks)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--ac", default="none", choices=["none", "full", "selective"],
                    help="train.activation_checkpointing, on both sides")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side (compilation happens here)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        out, layout, dtype, ac, warmup, steps = a.worker
        worker(out, layout, dtype, ac, int(warmup), int(steps))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
               os.path.abspath(__file__), "--worker", out, a.layout, a.dtype, a.ac, str(a.warmup), str(a.steps)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"{a.layout} failed under torchrun")
        with open(out) as f:
            times = json.load(f)
    print(f"layout {a.layout} on 8 CPU ranks, {a.dtype}, activation_checkpointing={a.ac}, "
          f"{MBS * ACCUM} x {SEQ} tokens per batch rank, {a.steps} timed steps per side (interleaved)")
    print(f"{'side':10s} {'median s/step':>14s} {'min':>8s} {'max':>8s}")
    for name, ts in times.items():
        print(f"{name:10s} {statistics.median(ts):14.3f} {min(ts):8.3f} {max(ts):8.3f}")
    ratio = statistics.median(times["compiled"]) / statistics.median(times["eager"])
    print(f"compiled_over_eager_step_time={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
