"""Step time of the flagship layout in miniature with `train.compile` against without, side by side.

`python bench/layout_compile.py` launches tp2 x ep2 x pp2 + SP (1F1B, FSDP2 over the two
expert-parallel batch ranks) on 8 CPU ranks under torchrun (gloo), builds the same model twice in
every rank, eager and compiled (trainer/parallel/compile.py), warms both up (the compiled one
compiles there), then times training steps of the two alternately, so machine noise hits both alike.
A step is the trainer's forward_backward over the rank's micro-batches, gradient clipping,
router-bias update and AdamW, between two barriers; rank 0 reports the median over the timed steps
of each.

CPU figures on gloo: 8 processes share the machine's cores, so a step is mostly host overhead,
collective latency and small kernels, not the matmuls a GPU step is made of; the ratio says what
compile does to the layout's host-side cost and fused elementwise work here, not on an accelerator
(bench/gpu_check.py measures one where lent). Shared machines make single runs noisy: the spread
(min..max) of each side is printed beside its median.

    python bench/layout_compile.py [--steps 6] [--warmup 2] [--dtype fp32|bf16]
                                   [--ac none|full|selective] [--layout
                                   tp=2,ep=2,pp=2,sequence_parallel=true]
ends with: compiled_over_eager_step_time=<median compiled step time / median eager step time>
"""

from __future__ import annotations

import argparse
import json
import statistics

from side_by_side import Sides, moe_model, run_bench, run_under_torchrun, synthetic_batches

FLAGSHIP = "tp=2,ep=2,pp=2,sequence_parallel=true"
MBS, ACCUM, SEQ, VOCAB = 2, 4, 128, 2048
MODEL = moe_model(SEQ, MBS, ACCUM, mtp_steps=3)


def _batches(step: int, dp_rank: int, dp_size: int):
    return synthetic_batches(step, dp_rank, dp_size, MBS, ACCUM, SEQ, VOCAB)


# --- worker (under torchrun) ----------------------------------------------------------------------
def worker(out_path: str, layout: str, dtype: str, ac: str, warmup: int, steps: int) -> None:
    import torch.distributed as dist

    base = MODEL + [f"train.dtype={dtype}", f"train.activation_checkpointing={ac}"]
    sides = Sides(base, layout,
                  {"eager": ["train.compile=false"], "compiled": ["train.compile=true"]}, VOCAB)
    times = sides.alternate(warmup, steps, _batches)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default=FLAGSHIP,
                    help="parallel.* items, comma-separated (8 ranks)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--ac", default="none", choices=["none", "full", "selective"],
                    help="train.activation_checkpointing, on both sides")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps per side (compilation happens here)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        out, layout, dtype, ac, warmup, steps = a.worker
        worker(out, layout, dtype, ac, int(warmup), int(steps))
        return 0
    times = run_under_torchrun(__file__, 8, [a.layout, a.dtype, a.ac, str(a.warmup), str(a.steps)])
    print(f"layout {a.layout} on 8 CPU ranks, {a.dtype}, activation_checkpointing={a.ac}, "
          f"{MBS * ACCUM} x {SEQ} tokens per batch rank, {a.steps} timed steps per side "
          "(interleaved)")
    print(f"{'side':10s} {'median s/step':>14s} {'min':>8s} {'max':>8s}")
    for name, ts in times.items():
        print(f"{name:10s} {statistics.median(ts):14.3f} {min(ts):8.3f} {max(ts):8.3f}")
    ratio = statistics.median(times["compiled"]) / statistics.median(times["eager"])
    print(f"compiled_over_eager_step_time={ratio:.3f}")
    return 0


if __name__ == "__main__":
    run_bench(main)
