"""Per-rank peak memory and step time against sequence length under context parallelism, side by
side.

`python bench/context_scaling.py` runs cp = 1, 2 and 4 (torchrun, gloo, world = cp, one thread per
rank) and in each the window lengths of `--seqs` (default 1k .. 32k tokens), one micro-batch of one
sequence per step, through TrainStep.forward_backward (forward and backward of the trunk and the MTP
chain, the gradient sync and FSDP over cp included; no optimizer step). The model is the
`qwen4_exp_tiny` flavor (recipes/qwen4_exp_tiny.yaml: Gated DeltaNet, QSA, PLE, hyper-connections,
MoE with the aux loss, looped MTP K=3) in its sparse stage (`model.indexer_warmup_steps=0`, as the
256k recipes: the dense warm-up's KL target is quadratic in S) with QSA's gather form
(`model.qsa_form=gather`: `auto` switches to it at 8k tokens; the mask form's [S/cp, S] mask would
grow with S^2), fp32. The indexer's KL is off (`model.indexer_loss_coef=0`) unless `--indexer-kl`,
as its streamed target makes a 32k-token step several times slower on this CPU.

Memory: each rank's peak resident set during the step minus its resident set just before it (Linux
VmHWM, reset through /proc/self/clear_refs before each step), with glibc's mmap threshold fixed at
128 KiB so that freed tensors leave the resident set (MALLOC_MMAP_THRESHOLD_; otherwise the heap
keeps them and the peak of one length hides the next). It counts every byte the step touches:
activations kept for backward, the exchanges' gathered copies, transients, gradients and FSDP's
gathered parameters. Time: wall seconds of the step on the rank, the slowest rank; on a machine with
fewer cores than cp ranks (the 2-core CPU) the ranks share cores, so step times at cp = 4 are not a
speed-up measure.

Ends with the diagonal (S and cp grown together: per-rank memory should stay flat) and
`diagonal_max_over_min=<x>`. Flags: --seqs, --cps, --flavor, --set KEY=VALUE (more config
overrides).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import run_bench, run_under_torchrun  # noqa: E402

NARROW = [f"model.{kv}" for kv in (
    "hidden_size=32", "head_dim=8", "linear_key_head_dim=8", "linear_value_head_dim=8",
    "indexer_head_dim=8",
    "intermediate_size=32", "moe_intermediate_size=32", "shared_expert_intermediate_size=32",
    "ple_embed_dim=16", "hc_lowrank=8")] + ["data.vocab_size=512"]
"""The default widths: the flavor's layers, experts, heads, streams and budget at a quarter of its
widths (hidden 32, head and state dims 8, vocabulary 512), so that the whole run takes about 6
minutes on the 2-core CPU (`--width flavor`: the flavor's own, 2.7x the memory and time per
token)."""
SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
CPS = (1, 2, 4)
K = 3


def overrides(flavor: str, seq: int, cp: int, extra, indexer_kl: bool = False) -> list:
    return [f"flavor={flavor}", f"data.seq_len={seq}", f"model.max_seq_len={seq + 256}",
            f"model.indexer_loss_coef={1.0 if indexer_kl else 0.0}",
            "model.qsa_form=gather",
            "model.indexer_warmup_steps=0", f"mtp.num_steps={K}", "mtp.num_layers=1",
            "mtp.style=looped",
            "data.vocab_size=2048", "train.micro_batch_size=1", "train.grad_accum_steps=1",
            "train.dtype=fp32",
            "logging.wandb=false", "eval.interval=0", "device=cpu",
            "run.dir=/tmp/tandem_bench_unused", f"parallel.cp={cp}", *extra]


def _status(key: str) -> int:
    """/proc/self/status's `key` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _settle() -> int:
    """Free what can be freed, reset the peak, and return the resident set now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def worker(out_path, args):
    import torch.distributed as dist

    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    opts = json.loads(args[0])
    torch.set_num_threads(1)
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for seq in [opts["seqs"][0]] + opts["seqs"]:  # the first length twice: a warm-up, not reported
        cfg = load_config(None, overrides(opts["flavor"], seq, cp, opts["set"],
                                          opts["indexer_kl"]))
        pstate = init_parallel(cfg, resolve_device("cpu"))
        torch.manual_seed(0)
        model = build_model(cfg, pstate)
        if opts["chunk_elems"]:
            for module in model.modules():
                if hasattr(module, "chunk_elems"):
                    module.chunk_elems = opts["chunk_elems"]
        tr = TrainStep(cfg, model, pstate)
        model.train()
        g = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=g)
        batches = [{"tokens": tokens, "loss_mask": torch.ones(1, seq),
                    "doc_ids": torch.zeros(1, seq + 1).long()}]
        coefs = depth_coefficients(cfg.mtp, 0)
        counts = tr.global_target_counts(batches)
        if dist.is_initialized():
            dist.barrier()
        before = _settle()
        start = time.perf_counter()
        loss = tr.forward_backward(batches, counts, coefs)
        seconds = time.perf_counter() - start
        peak = _status("VmHWM") - before
        results[seq] = {"peak": peak, "seconds": seconds, "loss": float(loss.sum())}
        del tr, model, batches, loss
        if dist.is_initialized():
            dist.barrier()
    gathered = [results]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": gathered}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=list(SEQS))
    ap.add_argument("--cps", type=lambda s: [int(x) for x in s.split(",")], default=list(CPS))
    ap.add_argument("--flavor", default="qwen4_exp_tiny")
    ap.add_argument("--width", choices=("narrow", "flavor"), default="narrow",
                    help="NARROW, or the flavor's own")
    ap.add_argument("--qsa-chunk-elems", type=int, default=0,
                    help="QSA's streamed top-k / gather chunk (elements; default the model's 2^26)")
    ap.add_argument("--indexer-kl", action="store_true",
                    help="attach QSA's indexer KL (the loop's sparse stage; its streamed target is "
                         "slow on CPU)")
    ap.add_argument("--set", action="append", default=[], help="more config overrides, KEY=VALUE")
    a = ap.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # freed tensors leave the resident set
    extra = (NARROW if a.width == "narrow" else []) + a.set
    opts = json.dumps({"seqs": a.seqs, "flavor": a.flavor, "set": extra,
                       "chunk_elems": a.qsa_chunk_elems, "indexer_kl": a.indexer_kl})
    per_cp = {}
    wall = time.perf_counter()
    for cp in a.cps:
        if cp == 1:
            # one process without torchrun: the same TrainStep, no process group
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "r.json")
                run_single(out, opts)
                with open(out) as f:
                    per_cp[cp] = json.load(f)
        else:
            per_cp[cp] = run_under_torchrun(__file__, cp, [opts])
    mib = 2**20
    print(f"context scaling: flavor {a.flavor} at {a.width} widths (sparse QSA stage in its gather "
          "form, "
          f"indexer KL {'on' if a.indexer_kl else 'off'}, fp32, "
          f"1 sequence per micro-batch, "
          f"MTP K={K}), "
          f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
          "peak = max over ranks of the step's peak RSS over the RSS before it; time = slowest "
          "rank")
    print("overrides: " + " ".join(extra) + (f"; QSA chunk_elems={a.qsa_chunk_elems}"
                                             if a.qsa_chunk_elems else ""))
    head = f"{'S':>6s} " + " ".join(f"{'cp=' + str(cp) + ' MiB':>11s} {'s':>7s}" for cp in a.cps)
    print(head)
    table = {}
    for seq in a.seqs:
        cells = []
        for cp in a.cps:
            ranks = [r[str(seq)] for r in per_cp[cp]["ranks"]]
            peak, secs = max(r["peak"] for r in ranks) / mib, max(r["seconds"] for r in ranks)
            table[(seq, cp)] = (peak, secs)
            cells.append(f"{peak:11.1f} {secs:7.2f}")
        print(f"{seq:6d} " + " ".join(cells))
    print("per-rank peak at each S relative to cp=1: " + "; ".join(
        f"S={seq}: " + " ".join(f"cp{cp} {table[(seq, cp)][0] / table[(seq, a.cps[0])][0]:.2f}"
                                for cp in a.cps)
        for seq in a.seqs))
    diagonal = []
    for seq in a.seqs:  # S and cp grown together from each starting length
        chain = [(seq * cp // a.cps[0], cp) for cp in a.cps]
        if all(c in table for c in chain):
            peaks = [table[c][0] for c in chain]
            diagonal.append(max(peaks) / min(peaks))
            print("S and cp together: " + " -> ".join(f"S={s} cp={cp} {table[(s, cp)][0]:.1f} MiB"
                                                      for s, cp in chain)
                  + f" (max/min {max(peaks) / min(peaks):.2f})")
    worst = max(diagonal, default=float("nan"))
    print(f"diagonal_max_over_min={worst:.3f} wall={time.perf_counter() - wall:.0f}s")
    return worst


def run_single(out, opts):
    """cp = 1 in a fresh process (its own resident set, as each torchrun rank has)."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", out, opts],
                          env=env, capture_output=True, text=True, cwd=os.path.dirname(HERE))
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit("context_scaling.py cp=1 failed")


if __name__ == "__main__":
    run_bench(lambda: main(sys.argv[1:]), worker)
