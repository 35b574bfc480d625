"""Expert parallelism's two dispatches (`parallel.ep_dispatch`) side by side: step time and host
syncs.

`python bench/ep_dispatch.py` launches a small MoE model's training step under ep=2 (2 CPU ranks)
and then tp2 x ep2 + SP (4 ranks) under torchrun (gloo). Every rank builds the model twice, `exact`
(split sizes read back by the host, one sync per MoE layer per forward) and `padded` (fixed-capacity
blocks, counts on the device), warms both up, then times training steps of the two alternately, so
machine noise hits both alike. A step is the trainer's forward_backward over the rank's
micro-batches, gradient clipping, router-bias update and AdamW, between two barriers; rank 0 reports
the median of each. One more (untimed) step per side counts rank 0's device-to-host syncs in
forward_backward (all the model's and the loss's, not only the dispatch's;
tests/unit/test_decode_host_sync.py `HostSyncs`).

CPU figures on gloo say little about an accelerator: a CPU never waits on a "device", so the host
syncs cost nothing here, while `padded`'s larger all-to-all (ep x the rows when experts per rank >=
top_k) and its padding's memory traffic do cost; on a GPU the syncs stall the host's launch queue
(the pipeline schedule's thread included) and `padded` removes them. The figure to trust on a GPU is
this script's ratio measured there. Shared machines make single runs noisy: the spread (min..max) of
each side is printed beside its median.

    python bench/ep_dispatch.py [--steps 6] [--warmup 2] [--dtype fp32|bf16]
        [--layouts ep=2 tp=2,ep=2,...]
ends with one line per layout: padded_over_exact_step_time[<layout>]=<median padded / median exact>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from side_by_side import ROOT, Sides, moe_model, run_bench, run_under_torchrun, synthetic_batches

LAYOUTS = ["ep=2", "tp=2,ep=2,sequence_parallel=true"]
MBS, ACCUM, SEQ, VOCAB = 2, 2, 128, 2048
MODEL = moe_model(SEQ, MBS, ACCUM, mtp_steps=1)
SIDES = ("exact", "padded")


def _batches(step: int, dp_rank: int, dp_size: int):
    return synthetic_batches(step, dp_rank, dp_size, MBS, ACCUM, SEQ, VOCAB)


# --- worker (under torchrun) ----------------------------------------------------------------------
def worker(out_path: str, layout: str, dtype: str, warmup: int, steps: int) -> None:
    import torch.distributed as dist

    sys.path.insert(0, ROOT)  # the tests package (its helpers import `tests.eval_helpers`)
    from tests.unit.test_decode_host_sync import HostSyncs

    sides = Sides(MODEL + [f"train.dtype={dtype}"], layout,
                  {name: [f"parallel.ep_dispatch={name}"] for name in SIDES}, VOCAB)
    times = sides.alternate(warmup, steps, _batches)
    syncs = {}
    for name in SIDES:
        counter = HostSyncs()
        sides.step(name, warmup + steps, _batches, counter)
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
    result = run_under_torchrun(__file__, world, [layout, dtype, str(warmup), str(steps)])
    result["world"] = world
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=LAYOUTS,
                    help="parallel.* items, comma-separated, per run")
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
        print(f"layout {layout} on {r['world']} CPU ranks, {a.dtype}, {MBS * ACCUM} x {SEQ} tokens "
              "per batch rank, "
              f"{a.steps} timed steps per side (interleaved)")
        print(f"{'side':8s} {'median s/step':>14s} {'min':>8s} {'max':>8s} "
              f"{'fwd+bwd host syncs':>18s}  (rank 0, by "
              "kind)")
        for name in SIDES:
            ts, syncs = r["times"][name], r["syncs"][name]
            print(f"{name:8s} {statistics.median(ts):14.3f} {min(ts):8.3f} {max(ts):8.3f} "
                  f"{sum(syncs.values()):18d}  "
                  f"{syncs}")
        ratios.append((layout, statistics.median(r["times"]["padded"])
                       / statistics.median(r["times"]["exact"])))
    for layout, ratio in ratios:
        print(f"padded_over_exact_step_time[{layout}]={ratio:.3f}")
    return 0


if __name__ == "__main__":
    run_bench(main)
