"""What the layout benches share: a torchrun launch of a bench's own worker, and two builds of one
model trained alternately on the same ranks (bench/ep_dispatch.py, bench/layout_compile.py; the
launch also serves bench/comm_volume.py and bench/fsdp_accumulation_memory.py).

A worker is the bench script itself run as `script --worker OUT ARGS...` on every rank; rank 0
writes its result to OUT as JSON, which `run_under_torchrun` returns to the driver. `run_bench` is
every such script's `__main__`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, NoReturn, Optional, Sequence

import torch

from tandem.trainer.parallel.layout import run_as_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_under_torchrun(script: str, world: int, args: Sequence[str]):
    """`script --worker OUT *args` on `world` CPU ranks (gloo, one thread each); rank 0's JSON
    result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}",
               os.path.abspath(script), "--worker", out, *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"{os.path.basename(script)} {' '.join(args)} failed under torchrun")
        with open(out) as f:
            return json.load(f)


def run_bench(main: Callable[[], object],
              worker: Optional[Callable[[str, List[str]], None]] = None) -> NoReturn:
    """A bench script's `__main__`: `worker(OUT, ARGS)` for a rank started as `script --worker OUT
    ARGS...` when the script passes its worker here (others parse `--worker` in `main`), else
    `main()`, whose int return is the exit code (0 for anything else). A torchrun rank leaves as
    `tandem`'s do (`run_as_process`: after gloo collectives the interpreter's finalisation can
    abort a rank whose results are already written)."""

    def entry() -> int:
        if worker is not None and sys.argv[1:2] == ["--worker"]:
            worker(sys.argv[2], sys.argv[3:])
            return 0
        code = main()
        return code if isinstance(code, int) else 0

    sys.exit(run_as_process(entry))


def moe_model(seq: int, mbs: int, accum: int, mtp_steps: int) -> list:
    """The layout benches' model: hidden 256, 4 layers (the first dense), 8 experts top-2 with a
    shared one, one looped MTP layer over `mtp_steps` depths, on CPU without logging or
    evaluation."""
    return ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=8",
            "model.num_kv_heads=2",
            "model.intermediate_size=512", "model.moe_intermediate_size=128", "model.num_experts=8",
            "model.top_k=2",
            "model.num_shared_experts=1", "model.first_k_dense=1", "model.balance=aux_free",
            "model.max_seq_len=256",
            f"mtp.num_steps={mtp_steps}", "mtp.num_layers=1", f"data.seq_len={seq}",
            f"train.micro_batch_size={mbs}",
            f"train.grad_accum_steps={accum}", "logging.wandb=false", "eval.interval=0",
            "device=cpu", "run.dir=/tmp/tandem_bench_unused"]


def synthetic_batches(step: int, dp_rank: int, dp_size: int, mbs: int, accum: int, seq: int,
                      vocab: int):
    """This batch rank's micro-batches of step `step`: random tokens, every target counted, one
    document."""
    g = torch.Generator().manual_seed(step)
    n = mbs * accum
    tokens = torch.randint(0, vocab, (n * dp_size, seq + 1),
                           generator=g)[dp_rank * n:(dp_rank + 1) * n]
    return [{"tokens": tokens[i * mbs:(i + 1) * mbs], "loss_mask": torch.ones(mbs, seq),
             "doc_ids": torch.zeros(mbs, seq + 1, dtype=torch.long)} for i in range(accum)]


class Sides:
    """One model per side, each built from `base` + the layout's `parallel.*` items + its own
    overrides, on one process group and mesh (each model keeps its own layout handles: pipeline
    schedule, ...)."""

    def __init__(self, base: List[str], layout: str, sides: Dict[str, List[str]], vocab: int):
        from tandem.trainer.parallel import init_parallel
        from tandem.trainer.parallel.device import resolve_device
        from tandem.trainer.recipe import load_config
        from tandem.trainer.run import build_model
        from tandem.trainer.step import TrainStep

        torch.set_num_threads(1)
        parallel = [f"parallel.{kv}" for kv in layout.split(",")]
        self.sides, mesh_state = {}, None
        for name, overrides in sides.items():
            cfg = load_config(None, base + parallel + overrides)
            cfg.model.vocab_size = vocab
            mesh_state = mesh_state or init_parallel(cfg, resolve_device("cpu"))
            pstate = dataclasses.replace(mesh_state)  # each model sets its own layout pieces
            model = build_model(cfg, pstate)
            self.sides[name] = (cfg, pstate, TrainStep(cfg, model.train(), pstate))

    def step(self, name: str, i: int, batches_for: Callable, counter=None) -> float:
        """One training step of side `name` between two barriers (forward_backward over the rank's
        micro-batches, clipping, router-bias update, AdamW): its wall time; `counter` (a context
        manager) wraps forward_backward."""
        import torch.distributed as dist

        from tandem.trainer.loss import depth_coefficients

        cfg, pstate, tr = self.sides[name]
        batches = batches_for(i, pstate.dp_rank, pstate.dp_size)
        dist.barrier()
        start = time.perf_counter()
        counts = tr.global_target_counts(batches)
        with counter or contextlib.nullcontext():
            losses = tr.forward_backward(batches, counts, depth_coefficients(cfg.mtp, i))
        pstate.all_reduce_replicas(losses)
        tr.clip_gradients()
        tr.update_router_biases()
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - start

    def alternate(self, warmup: int, steps: int, batches_for: Callable) -> Dict[str, List[float]]:
        """`warmup` untimed then `steps` timed steps per side, the sides taking turns step by step,
        so drift in the machine's load hits them alike: {side: timed seconds}."""
        times = {name: [] for name in self.sides}
        for i in range(warmup + steps):
            for name in self.sides:
                t = self.step(name, i, batches_for)
                if i >= warmup:
                    times[name].append(t)
        return times
