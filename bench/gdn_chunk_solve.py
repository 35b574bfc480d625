"""Gated DeltaNet's per-chunk solve T = (I + A)^-1: accuracy on what real data puts into a chunk,
and forward + backward time at training shapes, for three ways of computing it side by side in one
run.

  power:    the series (I - A)(I + A^2)(I + A^4)... in log2(C) batched matmuls, autograd backward
            (what models/delta_rule.py used before; kept here only as the baseline)
  blocked:  models/delta_rule.unit_lower_inverse: forward substitution in 16 x 16 diagonal blocks,
            exact block-inverse merges, closed-form backward dA = -tril(T^T dT T^T, -1)
  trsolve:  torch.linalg.solve_triangular(I + A, I, unitriangular), torch's own backward
  trsolve+: the same forward with blocked's closed-form backward

(a) Accuracy: the module's chunked rule with each solve against its own token-by-token recurrence,
fp32, `max |chunked - recurrent| / max |recurrent|` of the outputs, at 16 key heads / 32 value heads
of dim 128 (each key head serves two value heads), batch 1, S = 256 (four chunks of 64). Inputs:
  random     i.i.d. keys, A = exp(A_log) in [0.01, 0.3], beta ~ U(0, 1)
  run        one token repeated at positions 40..139 (chunk boundaries inside), A in [0.01, 0.3]
  run_slow   the same with A in [0.001, 0.05]
  periodic   a period-3 token sequence, A in [0.001, 0.05]
  correlated keys around one direction (cosine ~0.8), beta 0.9, g = -0.01
(b) Time: forward + backward of the solve alone on A [B, H, T / C, C, C], A taken from random keys
(the cost does not depend on the values), fp32; one warm-up, then `--reps` repetitions alternating
the methods; medians, and `ratio = method / blocked` (> 1: slower than blocked). Then the whole
chunked rule (q, k, v of dim 128) forward + backward with the power series against blocked.

    python bench/gdn_chunk_solve.py [--heads 32] [--seq 4096] [--batch 1] [--reps 3] [--threads 1]
        [--device cpu|cuda] [--no-rule]
Last lines: `solve_fwd_bwd_s power=.. blocked=.. trsolve=.. trsolve+=..`, then the ratios to
blocked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.models import delta_rule  # noqa: E402

CHUNK = delta_rule.CHUNK


def power_series_inverse(a: torch.Tensor) -> torch.Tensor:
    """The baseline: (I + A)^-1 = sum_k (-A)^k through repeated squaring (exact in exact
    arithmetic)."""
    n = -a
    inv = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device) + n
    power, span = n, 2
    while span < a.shape[-1]:
        power = power @ power
        inv = inv + inv @ power
        span *= 2
    return inv


def trsolve_inverse(a: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(eye + a, eye.expand(a.shape), upper=False,
                                         unitriangular=True)


class _TrsolveClosedForm(torch.autograd.Function):
    """LAPACK's triangular solve forward with the module's closed-form backward."""

    @staticmethod
    def forward(ctx, a):
        t = trsolve_inverse(a)
        ctx.save_for_backward(t)
        return t

    backward = delta_rule._UnitLowerInverse.backward


METHODS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "power": power_series_inverse,
    "blocked": delta_rule.unit_lower_inverse,
    "trsolve": trsolve_inverse,
    "trsolve+": _TrsolveClosedForm.apply,
}


def with_solve(solve, fn, *args):
    """Run fn with the module's chunk solve replaced (the chunked rule looks it up at call time)."""
    saved = delta_rule.unit_lower_inverse
    delta_rule.unit_lower_inverse = solve
    try:
        return fn(*args)
    finally:
        delta_rule.unit_lower_inverse = saved


def adversarial(kind: str, hk: int, hv: int, s: int, d: int, device, seed: int = 0):
    """(q, k, v, g, beta) [1, hv, s, ...] with q/k normalised (q scaled), keys shared by hv // hk
    heads."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = rnd(1, hk, s, d), rnd(1, hk, s, d), rnd(1, hv, s, d)
    beta = torch.rand(1, hv, s, generator=gen)
    low, high = (0.001, 0.05) if kind in ("run_slow", "periodic") else (0.01, 0.3)
    g = -torch.empty(hv).uniform_(low, high, generator=gen)[None, :,
                                                            None] * F.softplus(rnd(1, hv, s))
    if kind in ("run", "run_slow"):
        for x in (q, k, v, beta, g):
            x[:, :, 40:140] = x[:, :, 40:41]
    elif kind == "periodic":
        for x in (q, k, v, beta, g):
            x[:, :, 3:] = x[:, :, :3].repeat(1, 1, s // 3, *([1] * (x.dim() - 3)))[:, :, :s - 3]
    elif kind == "correlated":
        k = rnd(1, hk, 1, d) + 0.5 * rnd(1, hk, s, d)
        beta, g = torch.full((1, hv, s), 0.9), torch.full((1, hv, s), -0.01)
    elif kind != "random":
        raise ValueError(kind)
    q = delta_rule.l2_normalize(q.repeat_interleave(hv // hk, 1)) * d ** -0.5
    k = delta_rule.l2_normalize(k.repeat_interleave(hv // hk, 1))
    return tuple(x.to(device) for x in (q, k, v, g, beta))


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=32, help="value heads")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-rule", action="store_true", help="skip the whole-rule timing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)  # noqa: E731

    print("(a) chunked vs recurrent, rel error of the outputs: 16 key / 32 value heads, dim 128, "
          "S=256, fp32")
    print(f"{'input':<11}" + "".join(f"{m:>11}" for m in ("power", "blocked", "trsolve")))
    for kind in ("random", "run", "run_slow", "periodic", "correlated"):
        q, k, v, g, beta = adversarial(kind, 16, 32, 256, 128, device)
        ref, _, _ = delta_rule.recurrent_gated_delta_rule(q, k, v, g, beta)
        errs = [rel_err(with_solve(METHODS[m], delta_rule.chunked_gated_delta_rule, q, k, v, g,
                                   beta)[0], ref)
                for m in ("power", "blocked", "trsolve")]
        print(f"{kind:<11}" + "".join(f"{e:>11.1e}" for e in errs))

    b, h, n = args.batch, args.heads, args.seq // CHUNK
    print(f"(b) solve forward+backward: A [{b}, {h}, {n}, {CHUNK}, {CHUNK}] fp32, {device}, "
          f"threads={torch.get_num_threads()}, median of {args.reps}")
    gen = torch.Generator().manual_seed(1)
    k = delta_rule.l2_normalize(torch.randn(b, h, n, CHUNK, 128, generator=gen)).to(device)
    a = (0.5 * k @ k.transpose(-1, -2)).tril(-1)
    grad = torch.randn(a.shape, generator=gen).to(device)

    def step(solve):
        x = a.clone().requires_grad_()
        solve(x).backward(grad)

    times = {m: [] for m in METHODS}
    for rep in range(args.reps + 1):
        for m, solve in METHODS.items():
            t = timed(lambda: step(solve), sync)
            if rep:
                times[m].append(t)
    med = {m: statistics.median(ts) for m, ts in times.items()}

    rule = {}
    if not args.no_rule:
        d = 128
        q = (delta_rule.l2_normalize(torch.randn(b, h, args.seq, d,
                                                 generator=gen)) * d ** -0.5).to(device)
        kk = delta_rule.l2_normalize(torch.randn(b, h, args.seq, d, generator=gen)).to(device)
        v = torch.randn(b, h, args.seq, d, generator=gen).to(device)
        g = (-0.1 * torch.rand(b, h, args.seq, generator=gen)).to(device)
        beta = torch.rand(b, h, args.seq, generator=gen).to(device)

        def rule_step(solve):
            xs = [x.clone().requires_grad_() for x in (q, kk, v, g, beta)]
            out, final = with_solve(solve, delta_rule.chunked_gated_delta_rule, *xs)
            (out.sum() + final.sum()).backward()

        rt = {m: [] for m in ("power", "blocked")}
        for rep in range(args.reps + 1):
            for m in rt:
                t = timed(lambda: rule_step(METHODS[m]), sync)
                if rep:
                    rt[m].append(t)
        rule = {m: statistics.median(ts) for m, ts in rt.items()}

    print("solve_fwd_bwd_s " + " ".join(f"{m}={t:.3f}" for m, t in med.items()))
    print("solve_ratio_to_blocked " + " ".join(f"{m}={t / med['blocked']:.2f}" for m,
                                               t in med.items()))
    if rule:
        print(f"rule_fwd_bwd_s (dim 128, S={args.seq}) power={rule['power']:.3f} "
              f"blocked={rule['blocked']:.3f} "
              f"ratio power/blocked={rule['power'] / rule['blocked']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
