"""Host memory and checkpoint size of MTP fine-tuning a Hugging Face MoE checkpoint, per FSDP rank.

    python bench/finetune_memory.py [--ranks 1,2,4] [--quick] [--workdir DIR] [--cache-dir DIR]

Builds a ~430M-parameter GLM-4.5-style MoE checkpoint locally (random weights, bf16 safetensors in
the `glm4_moe` layout `transformers` loads, the embedded corpus's tokenizer), then fine-tunes MTP
(`recipes/finetune_mtp.yaml`, frozen trunk, train.dtype=bf16 on CPU autocast) for one step under 1,
2 and 4 FSDP ranks (torchrun, gloo, CPU), and the same with a tiny checkpoint as the baseline
(interpreter, torch, data, process group). Prints per rank count the largest per-rank peak RSS over
the baseline's and the step checkpoint's size on disk, both as multiples of the fp32 model (4 bytes
x trunk + MTP parameters), next to trainer/estimate.py's per-rank estimate. The ranks run as a
user's would (no allocator environment variable): the trainer fixes glibc's mmap threshold itself
when fine-tuning (train.malloc_mmap_threshold), so the peak measures what they hold, not where
glibc's dynamic threshold left freed buffers (`--glibc-default`: train.malloc_mmap_threshold=0, to
measure that). Last line: `peak_rss_over_fp32_model=<2 ranks> checkpoint_over_fp32_model=<2 ranks>`.
`--quick` runs a small model at 2 ranks without the baseline run (the test that keeps this script
alive; its RSS figure is then the whole process's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

from side_by_side import run_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ~430M parameters: 10 layers (1 dense + 9 MoE with 16 experts of 704, top-2, 1 shared), vocab 32768
BIG = dict(vocab_size=32768, hidden_size=1024, num_layers=10, num_heads=16, num_kv_heads=4,
           intermediate_size=2816,
           moe_intermediate_size=704, num_experts=16, top_k=2, num_shared_experts=1,
           first_k_dense=1,
           router_score="sigmoid", max_seq_len=256)
QUICK = dict(BIG, vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
             intermediate_size=256, moe_intermediate_size=64, num_experts=8)
TINY = dict(BIG, vocab_size=1024, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
            intermediate_size=64, moe_intermediate_size=16, num_experts=4)
DATA = ["data.stdlib_max_bytes=200000", "data.vocab_size=512", "data.seq_len=32"]
RUN = ["train.max_steps=1", "train.micro_batch_size=1", "train.warmup_steps=0", "train.dtype=bf16",
       "eval.interval=0",
       "logging.wandb=false", "logging.progress=false", "checkpoint.interval=0", "mtp.num_steps=1",
       "mtp.num_layers=1", "mtp.moe=false"]
# The MTP layer is dense (mtp.moe=false) and fresh: a MoE layer under CPU bf16 autocast needs issue
# 11 item 1's routing fix (models/moe.py, another branch); the frozen trunk is MoE and runs in bf16.


def make_checkpoint(out: str, shape: dict, cache: str) -> int:
    """A random-weight GLM-4.5-style MoE trunk, saved as bf16 safetensors with the embedded corpus's
    tokenizer; returns the fine-tuned model's parameter count (trunk + one dense MTP layer)."""
    import torch

    from tandem.data_pipeline.stdlib_corpus import prepare_stdlib_corpus
    from tandem.models import ModelConfig, MTPConfig, TandemModel
    from tandem.trainer.hf.export import export_hf
    from tandem.trainer.recipe import load_config

    cfg = ModelConfig(**shape)
    torch.manual_seed(0)
    model = TandemModel(cfg, MTPConfig(num_steps=0)).to(torch.bfloat16)
    mtp = MTPConfig(num_steps=1, num_layers=1, moe=False)
    with torch.device("meta"):
        n = sum(p.numel() for p in TandemModel(cfg, mtp).parameters())
    data = load_config(None, DATA + [f"data.cache_dir={cache}"]).data
    tok = prepare_stdlib_corpus(data)[2]
    export_hf(model, out, "glm4_moe", overwrite=True, tokenizer=tok)
    del model
    return n


GLIBC_DEFAULT = False


def launch(ranks: int, ckpt: str, run_dir: str, cache: str, out: str) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own run: a rerun measures afresh
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}",
           os.path.abspath(__file__), "--worker", out,
           os.path.join(ROOT, "recipes", "finetune_mtp.yaml"),
           f"model.init_from={ckpt}", f"run.dir={run_dir}", f"data.cache_dir={cache}", *DATA, *RUN]
    if GLIBC_DEFAULT:
        # glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, so later
        # freed buffers (reads, all-gather outputs) stay resident in the heap and the peak depends
        # on allocation order (+-0.2 x the model between ranks and runs)
        cmd.append("train.malloc_mmap_threshold=0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # what a user gets
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"fine-tune under {ranks} ranks failed:\n{proc.stderr[-4000:]}")
    peaks = [json.load(open(f"{out}.rank{r}.json"))["maxrss_bytes"] for r in range(ranks)]
    step = os.path.join(run_dir, "checkpoints", "step_1")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step) for f in fs)
    return {"peak_rss": max(peaks), "checkpoint_bytes": size}


def worker(out: str, recipe: str, overrides) -> None:
    """Under torchrun: fine-tune, then record this rank's peak RSS."""
    import torch

    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    torch.set_num_threads(1)
    train(load_config(recipe, overrides))
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)


def estimated_states(ckpt: str, ranks: int, cache: str) -> float:
    """trainer/estimate.py's per-rank bytes for this fine-tune (states + activations + FSDP
    gathers)."""
    from tandem.trainer.estimate import estimate
    from tandem.trainer.hf.init_from import adopt_checkpoint_config
    from tandem.trainer.recipe import load_config

    cfg = load_config(os.path.join(ROOT, "recipes", "finetune_mtp.yaml"),
                      [f"model.init_from={ckpt}", f"data.cache_dir={cache}", "device=cpu", *DATA,
                       *RUN])
    cfg.data.vocab_size = 512
    adopt_checkpoint_config(cfg)
    return estimate(cfg, world_size=ranks).total_gib_per_rank * 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--quick", action="store_true", help="small model at 2 ranks (for the test)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--cache-dir", default="",
                    help="the embedded corpus's cache (default: WORKDIR/cache)")
    ap.add_argument("--glibc-default", action="store_true",
                    help="run the ranks with glibc's dynamic mmap threshold "
                         "(train.malloc_mmap_threshold=0; "
                         "default: the trainer's fixed 64 KiB for fine-tuning)")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], args.worker[2:])
        return 0
    global GLIBC_DEFAULT
    GLIBC_DEFAULT = args.glibc_default
    ranks = [2] if args.quick else [int(r) for r in args.ranks.split(",")]
    work = args.workdir or tempfile.mkdtemp(prefix="tandem_ftmem_")
    cache = args.cache_dir or os.path.join(work, "cache")
    n = make_checkpoint(os.path.join(work, "big"), QUICK if args.quick else BIG, cache)
    if not args.quick:
        make_checkpoint(os.path.join(work, "tiny"), TINY, cache)
    fp32 = 4 * n
    print(f"checkpoint: {n / 1e6:.0f}M parameters (trunk + 1 MTP layer), fp32 model "
          f"{fp32 / 2**30:.2f} GiB; "
          f"fine-tune: frozen bf16 trunk, MTP trains (fp32 master + AdamW), 1 step")
    print(f"{'ranks':>5} {'peak RSS - baseline':>20} {'x fp32 model':>12} {'estimate x fp32':>15} "
          f"{'checkpoint':>11} "
          f"{'x fp32 model':>12}")
    results = {}
    for r in ranks:
        big = launch(
            r,
            os.path.join(work, "big"),
            os.path.join(work, f"run_big_{r}"),
            cache,
            os.path.join(work, f"big{r}"),
        )
        # --quick: no baseline run, the whole process's peak
        base = (
            {"peak_rss": 0}
            if args.quick
            else launch(
                r,
                os.path.join(work, "tiny"),
                os.path.join(work, f"run_tiny_{r}"),
                cache,
                os.path.join(work, f"tiny{r}"),
            )
        )
        over = (big["peak_rss"] - base["peak_rss"]) / fp32
        est = estimated_states(os.path.join(work, "big"), r, cache) / fp32
        ckpt = big["checkpoint_bytes"] / fp32
        results[r] = (over, ckpt)
        print(f"{r:>5} {(big['peak_rss'] - base['peak_rss']) / 2**20:>17.0f} MiB {over:>12.3f} "
              f"{est:>15.3f} "
              f"{big['checkpoint_bytes'] / 2**20:>8.1f} MiB {ckpt:>12.3f}", flush=True)
    two = results.get(2, next(iter(results.values())))
    print(f"peak_rss_over_fp32_model={two[0]:.3f} checkpoint_over_fp32_model={two[1]:.3f}")
    return 0


if __name__ == "__main__":
    run_bench(main)
