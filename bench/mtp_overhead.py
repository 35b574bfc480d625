"""MTP overhead: step time and peak memory with K looped MTP steps vs K=0, on the same trunk.

Measured side by side in one run (steps interleaved, medians), next to what counting predicts:
- flop_ratio: FLOPs a training step executes for the K-step model over the plain LM's (flops.py's
  hardware FLOPs: matmuls and attention; a head costs 3x its forward with the default fused head
  backward, 4x where it recomputes its logits);
- layer_mem_ratio: the peak memory of the plain LM plus K extra trunk layers, measured as K times
  the peak-memory growth from adding one trunk layer (that layer's activations and its states), i.e.
  what MTP would cost if its depths were just K more layers with no K x vocab logits resident.

Peak memory is the allocator-level peak of live tensors (params, grads, optimizer state,
activations, temporaries) tracked by torch.distributed._tools.MemTracker, so it is exact on CPU too.

Then, for the K-step model, the same step under each `train.activation_checkpointing` mode (none,
full, selective): peak memory and step time relative to none.

    python bench/mtp_overhead.py [--trunk tiny|deep|both] [--steps N] [--no-checkpointing]
ends with: step_time_ratio=<x> flop_ratio=<y> peak_mem_ratio=<z> layer_mem_ratio=<w>
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.models import ModelConfig, MTPConfig, TandemModel  # noqa: E402
from tandem.trainer.cost import hardware_flops_per_token  # noqa: E402
from tandem.trainer.loss import depth_coefficients, one_batch_forward_backward  # noqa: E402
from tandem.trainer.optim import build_optimizer  # noqa: E402
from tandem.trainer.parallel.activation_checkpoint import MODES, apply_activation_checkpointing  # noqa: E402
from tandem.trainer.recipe import load_config  # noqa: E402


class Runner:
    """One model + optimizer, stepping on fixed synthetic tokens."""

    def __init__(self, cfg: ModelConfig, mtp: MTPConfig, batch: int, seq_len: int, seed: int = 0,
                 checkpointing: str = "none"):
        torch.manual_seed(seed)
        self.model = TandemModel(cfg, mtp).train()
        if checkpointing != "none":
            apply_activation_checkpointing(self.model, checkpointing)
        self.optimizer = build_optimizer(self.model, load_config(None, []).train)
        self.tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1),
                                    generator=torch.Generator().manual_seed(1))
        self.mtp = mtp

    def step(self) -> None:
        one_batch_forward_backward(self.model, self.tokens, depth_coefficients(self.mtp, 0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0

    def peak_memory(self) -> int:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.step()  # optimizer state exists before tracking, as in steady-state training
        tracker = MemTracker()
        tracker.track_external(self.model, self.optimizer)
        with tracker:
            self.step()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def measure(name: str, cfg: ModelConfig, k: int, batch: int, seq_len: int, steps: int) -> dict:
    plain_mtp = MTPConfig(num_steps=0)
    looped = MTPConfig(num_steps=k, num_layers=1, style="looped")
    plain, mtp = Runner(cfg, plain_mtp, batch, seq_len), Runner(cfg, looped, batch, seq_len)
    deeper = Runner(dataclasses.replace(cfg, num_layers=cfg.num_layers + 1), plain_mtp, batch,
                    seq_len)
    for r in (plain, mtp):
        r.step()  # warm-up
    t_plain, t_mtp = [], []
    for _ in range(steps):  # interleaved so machine noise hits both alike
        t_plain.append(plain.timed_step())
        t_mtp.append(mtp.timed_step())
    mem_plain, mem_mtp, mem_deeper = plain.peak_memory(), mtp.peak_memory(), deeper.peak_memory()
    result = {
        "step_time_ratio": statistics.median(t_mtp) / statistics.median(t_plain),
        "flop_ratio": hardware_flops_per_token(cfg, looped, seq_len)
        / hardware_flops_per_token(cfg, plain_mtp, seq_len),
        "peak_mem_ratio": mem_mtp / mem_plain,
        "layer_mem_ratio": (mem_plain + k * (mem_deeper - mem_plain)) / mem_plain,
    }
    print(f"{name}: layers={cfg.num_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size} K={k} "
          f"batch={batch}x{seq_len}: step K=0 {statistics.median(t_plain) * 1e3:.0f} ms, K={k} "
          f"{statistics.median(t_mtp) * 1e3:.0f} ms; peak K=0 {mem_plain / 2**20:.1f} MiB, K={k} "
          f"{mem_mtp / 2**20:.1f} MiB, +1 layer {mem_deeper / 2**20:.1f} MiB", flush=True)
    return result


def measure_checkpointing(name: str, cfg: ModelConfig, k: int, batch: int, seq_len: int,
                          steps: int) -> None:
    looped = MTPConfig(num_steps=k, num_layers=1, style="looped")
    modes = ("none", *MODES)
    runners = {mode: Runner(cfg, looped, batch, seq_len, checkpointing=mode) for mode in modes}
    times = {mode: [] for mode in modes}
    for r in runners.values():
        r.step()
    for _ in range(steps):
        for mode, r in runners.items():
            times[mode].append(r.timed_step())
    peaks = {mode: r.peak_memory() for mode, r in runners.items()}
    base_t, base_m = statistics.median(times["none"]), peaks["none"]
    print(f"{name}: activation checkpointing (K={k}): " + "; ".join(
        f"{mode} peak {peaks[mode] / 2**20:.1f} MiB (x{peaks[mode] / base_m:.3f}), step x"
        f"{statistics.median(times[mode]) / base_t:.3f}" for mode in modes), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trunk", choices=["tiny", "deep", "both"], default="both")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="skip the activation-checkpointing modes")
    parser.add_argument("--recipe", default=os.path.join(os.path.dirname(__file__), "..", "recipes",
                                                         "tiny.yaml"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    recipe = load_config(args.recipe)
    tiny, seq_len, k = recipe.model, recipe.data.seq_len, recipe.mtp.num_steps
    trunks = []
    if args.trunk in ("tiny", "both"):
        trunks.append(("tiny", tiny))
    if args.trunk in ("deep", "both"):
        trunks.append(("deep16", dataclasses.replace(tiny, num_layers=16)))
    result = {}
    for name, cfg in trunks:
        result = measure(name, cfg, k, args.batch, seq_len, args.steps)
        if not args.no_checkpointing:
            measure_checkpointing(name, cfg, k, args.batch, seq_len, args.steps)
        print(f"{name}: " + " ".join(f"{key}={value:.3f}" for key, value in result.items()),
              flush=True)
    print(" ".join(f"{key}={value:.3f}" for key, value in result.items()))


if __name__ == "__main__":
    main()
