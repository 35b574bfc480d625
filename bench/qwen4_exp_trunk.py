"""Qwen4-Exp trunk vs a full-attention trunk of equal active parameters: training step time, the QSA
layer's peak training memory against dense attention, and the indexer's selected fraction, per
length.

(a) Step time. The qwen4_exp trunk is the model section of `--recipe` (recipes/qwen4_exp_tiny.yaml:
Gated DeltaNet x3 + one QSA layer, 4 hyper-connection streams, PLE, zero-centred norms) with MTP off
(mtp.num_steps=0). The dense trunk keeps the hidden size, vocabulary, layer count and MoE (experts,
top-k, expert width, gated shared expert, router), and has every layer `attention` (Qwen3-style GQA
with q/k norms, the recipe's RoPE), hc_count 1, no PLE, plain norms. It is then widened until its
active parameters match the qwen4_exp trunk's (`--match`):
  shared_expert (default): the dense trunk's shared-expert width grows; its attention keeps the
      recipe's heads (4 x 32, 2 KV heads, the same shape as the QSA layer's), so the long-sequence
      cost of full attention is not inflated by extra heads;
  heads: the dense trunk's query heads grow (a multiple of the KV heads), the MoE stays exactly the
      recipe's.
Active parameters count every parameter one token's forward reads, once: the routed experts at top_k
/ num_experts of their weights, embedding tables (the token embedding, PLE's n-gram table) at the
rows one token reads (PLE: one row per n-gram head). They are matched and printed for the trunk
(blocks plus the final norm or hyper-connection mixer); the token embedding's row and the LM head
are identical on both sides and printed apart. A step is forward + backward of the language-model
loss (the MoE balance loss and, with QSA, the indexer's KL as the trainer's sparse stage runs them:
indexer_loss_coef from the recipe, no dense warm-up), with no optimizer step; fp32 by default,
`--dtype bf16` under autocast with fp32 weights (as train.dtype=bf16). Every length has the same
tokens per step (`--tokens`, default the longest length: 16x256, 4x1024, 1x4096). Lengths run one
after another; at each, one warm-up step per trunk, then `--reps` repetitions alternating the two
trunks; medians are reported: `ratio = qwen4_exp / dense` step time (< 1: the hybrid trunk is
faster).

(b) Peak memory of one layer's training step (forward + backward of a fixed random output gradient,
the input requiring grad): one IndexedAttention layer built as the recipe's QSA layer, in each form
(`auto`, and forced `mask` and `gather`), against one Attention layer with the same heads (4 query
heads x 32, 2 KV heads, q/k norms, partial RoPE), at the same lengths and batches as (a). Each QSA
form is measured with the indexer's KL (the trainer's sparse stage, `_kl`) and without it (the
attention alone, indexer_loss_coef 0): the KL's target is the main attention's distribution, which
attention_block_mass materialises a chunk of queries at a time ([B, heads, chunk, S] fp32, chunk
bounded by the layer's chunk_elems), so it can dominate the layer's memory. How memory is measured:
on CPU, torch.profiler with profile_memory records every allocation and free the c10 CPU allocator
makes (sizes in bytes, whatever the thread, autograd's backward included); the peak is the maximum
of their running sum over the step, counted from zero at its start (parameters, the input and the
output gradient already exist and are not counted; parameter gradients and every activation and
temporary are). It is exact and repeatable, unlike the process's RSS (page-granular, glibc keeps
freed heap), and counts torch tensors only: library-internal scratch (e.g. oneDNN's) is not seen. On
CUDA it is torch.cuda's max_memory_allocated over the step minus memory_allocated at its start
(through the device layer). One warm-up step runs before each measurement; `ratio = layer / dense
attention` peak.

(c) The selected fraction: the QSA layer's selection (top budget / ratio complete blocks plus the
incomplete tail, per query, from the layer's own indexer at its random initialisation) counted as
(query, key) pairs over the S (S + 1) / 2 causal pairs, averaged over the batch. With budget 64 it
is about 64 / ((S + 1) / 2) once S >> budget; at random init it depends on how many positions are
selected, not which.

    python bench/qwen4_exp_trunk.py [--recipe recipes/qwen4_exp_tiny.yaml] [--lengths 256,1024,4096]
        [--tokens 4096] [--reps 3] [--dtype fp32|bf16] [--device cpu|cuda|auto] [--match
        shared_expert|heads] [--threads N] [--quick]
On a shared CPU, `--threads 1` keeps OpenMP threads from spinning against other processes' work.
`--quick` (CI smoke): lengths 64,128, 128 tokens per step, 1 repetition. Per length the last lines
are
  seq=S batch=B step_ratio=R step_ratio_fastest=R' mem_ratio_auto=.. mem_ratio_mask=..
  mem_ratio_gather=.. (each also _kl) selected_fraction=F
after one `active_params qwen4_exp=N dense=M rel_diff=D` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.models import ModelConfig, MTPConfig, TandemModel  # noqa: E402
from tandem.models.block import make_token_mixer  # noqa: E402
from tandem.models.experts import GroupedExperts  # noqa: E402
from tandem.models.ple import NGramEmbedding  # noqa: E402
from tandem.models.qsa import IndexedAttention  # noqa: E402
from tandem.models.qsa_tokens import token_mask  # noqa: E402
from tandem.trainer.loss import depth_coefficients, one_batch_forward_backward  # noqa: E402
from tandem.trainer.parallel.device import Device, autocast_context, resolve_device  # noqa: E402
from tandem.trainer.recipe import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RECIPE = os.path.join(ROOT, "recipes", "qwen4_exp_tiny.yaml")
MATCH_TOLERANCE = 0.03
"""The dense trunk's active parameters must be within this relative distance of the qwen4_exp
trunk's."""
MIB = 2**20


# ---- configurations and active parameters --------------------------------------------------------
def active_params(model: nn.Module) -> Tuple[int, int]:
    """(trunk, embedding row + head) active parameters per token (see the module docstring)."""
    tables = {}
    for m in model.modules():
        if isinstance(m, NGramEmbedding):
            tables[id(m.ngram_embedding.weight)] = m.ngram_heads  # one row per n-gram head
        elif isinstance(m, GroupedExperts):
            cfg = model.cfg
            for p in (m.gate_proj, m.up_proj, m.down_proj):
                tables[id(p)] = ("experts", cfg.top_k / cfg.num_experts)
    trunk = outer = 0
    for name, p in model.named_parameters():
        kind = tables.get(id(p))
        if isinstance(kind, int):
            n = kind * p.shape[1]
        elif isinstance(kind, tuple):
            n = round(p.numel() * kind[1])
        else:
            n = p.numel()
        if name == "embed_tokens.weight":
            outer += p.shape[1]
        elif name.startswith("lm_head."):
            outer += p.numel()
        else:
            trunk += n
    return trunk, outer


def build(cfg: ModelConfig, device: str = "meta") -> TandemModel:
    with torch.device(device):
        return TandemModel(cfg, MTPConfig(num_steps=0))


def dense_config(qwen: ModelConfig, match: str, max_len: int) -> ModelConfig:
    """The full-attention trunk with the qwen4_exp trunk's active parameters (see the module
    docstring)."""
    base = dataclasses.replace(
        qwen, layer_types=["attention"] * qwen.num_layers, full_attention_interval=0, hc_count=1,
        ple_layers=[], zero_centered_norm=False, qk_norm=True, max_seq_len=max_len)
    target = active_params(build(qwen))[0]

    def active(**kw) -> int:
        return active_params(build(dataclasses.replace(base, **kw)))[0]

    if match == "shared_expert":
        w0 = base.resolved_shared_expert_size
        a0, a1 = (
            active(shared_expert_intermediate_size=w0),
            active(shared_expert_intermediate_size=w0 + 1),
        )
        width = max(1, round(w0 + (target - a0) / (a1 - a0)))
        return dataclasses.replace(base, shared_expert_intermediate_size=width,
                                   num_shared_experts=max(1, base.num_shared_experts))
    if match == "heads":
        hd, kv = base.resolved_head_dim, base.num_kv_heads
        heads = min(range(kv, 64 * kv + 1, kv),
                    key=lambda h: abs(active(num_heads=h, head_dim=hd) - target))
        return dataclasses.replace(base, num_heads=heads, head_dim=hd)
    raise SystemExit(f"--match={match!r}: expected shared_expert or heads")


# ---- (a) step time -------------------------------------------------------------------------------
class StepRunner:
    def __init__(self, cfg: ModelConfig, dev: Device, dtype, tokens_bs1: torch.Tensor):
        torch.manual_seed(0)
        self.mtp = MTPConfig(num_steps=0)
        # the trainer's sparse stage (forward's default) with the config's indexer KL, one
        # micro-batch
        self.model = TandemModel(cfg, self.mtp).to(dev.device).train()
        self.dev, self.dtype, self.tokens = dev, dtype, tokens_bs1.to(dev.device)

    def step(self) -> float:
        self.dev.synchronize()
        t0 = time.perf_counter()
        one_batch_forward_backward(self.model, self.tokens, depth_coefficients(self.mtp, 0),
                                   lambda: autocast_context(self.dev.type, self.dtype))
        self.model.zero_grad(set_to_none=True)
        self.dev.synchronize()
        return time.perf_counter() - t0


# ---- (b) peak memory -----------------------------------------------------------------------------
def cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """Peak of the running sum of the CPU allocator's allocations and frees while fn runs
    (profiler)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    if not events:
        raise RuntimeError("the profiler recorded no CPU allocations (profile_memory unsupported?)")
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def peak_bytes(dev: Device, fn: Callable[[], None]) -> int:
    if not dev.is_accelerator:
        return cpu_peak_bytes(fn)
    dev.synchronize()
    base = dev.module.memory_allocated(dev.device)
    dev.reset_peak_memory()
    fn()
    dev.synchronize()
    return dev.module.max_memory_allocated(dev.device) - base


def make_layer(cfg: ModelConfig, kind: str, dev: Device, form: str = "auto",
               kl_coef: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layer_cfg = dataclasses.replace(cfg, qsa_form=form, indexer_loss_coef=kl_coef)
    return make_token_mixer(layer_cfg, kind).to(dev.device).train()


def layer_peak(layer: nn.Module, dev: Device, dtype, b: int, s: int, hidden: int) -> int:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(b, s, hidden, generator=g).to(dev.device).requires_grad_()
    grad = torch.randn(b, s, hidden, generator=g).to(dev.device)
    positions = torch.arange(s, device=dev.device).expand(b, s)

    def step() -> None:
        with autocast_context(dev.type, dtype):
            y = layer(x, positions)
        y.backward(grad.to(y.dtype))

    step()  # warm-up: lazy initialisation stays out of the measurement
    x.grad = None
    layer.zero_grad(set_to_none=True)
    peak = peak_bytes(dev, step)
    x.grad = None
    layer.zero_grad(set_to_none=True)
    return peak


# ---- (c) selected fraction -----------------------------------------------------------------------
@torch.no_grad()
def selected_fraction(layer: IndexedAttention, dev: Device, b: int, s: int, hidden: int) -> float:
    """Selected (query, key) pairs over causal pairs, from the layer's own selection (the mask
    form's)."""
    x = torch.randn(b, s, hidden, generator=torch.Generator().manual_seed(3)).to(dev.device)
    positions = torch.arange(s, device=dev.device).expand(b, s)
    r = layer.compress_ratio
    n = s // r
    q_idx, raw = layer.indexer(x, positions, layer.rotary)
    scores = layer._block_scores(q_idx, raw[:, : n * r], positions[:, : n * r: r])
    blocks, count = layer.select_blocks(scores, positions)
    mask_bss = token_mask(r, blocks, count, positions, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=dev.device).tril()
    if (mask_bss & ~causal).any():
        raise RuntimeError("the QSA selection holds a non-causal (query, key) pair")
    return float(mask_bss.sum()) / (b * s * (s + 1) / 2)


# ---- main ----------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--set", nargs="*", default=[],
                   help="config overrides (key=value) applied to the recipe")
    p.add_argument("--lengths", default="256,1024,4096", help="comma-separated sequence lengths")
    p.add_argument("--tokens", type=int, default=0,
                   help="tokens per step at every length (0: the longest length)")
    p.add_argument("--reps", type=int, default=3,
                   help="timed repetitions per trunk and length (median)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: autocast, fp32 weights")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, npu or auto (the device layer's names)")
    p.add_argument("--match", default="shared_expert", choices=["shared_expert", "heads"],
                   help="the dense trunk's knob widened to match active parameters")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default)")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke: lengths 64,128, 128 tokens per step, 1 rep")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.lengths, a.tokens, a.reps = "64,128", 128, 1
    lengths = [int(x) for x in a.lengths.split(",")]
    tokens = a.tokens or max(lengths)
    if any(tokens % s for s in lengths):
        raise SystemExit(f"--tokens={tokens} must be a multiple of every length {lengths}")
    dev = resolve_device(a.device, dtype=a.dtype)
    dtype = dev.autocast_dtype(a.dtype)

    cfg = load_config(a.recipe, ["mtp.num_steps=0", *a.set])
    qwen = dataclasses.replace(cfg.model, max_seq_len=max(max(lengths) + 1, cfg.model.max_seq_len))
    if not qwen.uses_qsa:
        raise SystemExit(f"{a.recipe}: the model has no indexed_attention layer to measure")
    dense = dense_config(qwen, a.match, qwen.max_seq_len)
    (q_trunk, q_outer), (d_trunk, _) = active_params(build(qwen)), active_params(build(dense))
    q_total = sum(p.numel() for p in build(qwen).parameters())
    d_total = sum(p.numel() for p in build(dense).parameters())
    rel = d_trunk / q_trunk - 1
    print(f"{os.path.basename(a.recipe)} (mtp.num_steps=0): layers "
          f"{[qwen.layer_type(i) for i in range(qwen.num_layers)]}, "
          f"hidden {qwen.hidden_size}, hc_count {qwen.hc_count}, ple_layers {qwen.ple_layers}, "
          "experts "
          f"{qwen.num_experts} top{qwen.top_k} x{qwen.moe_intermediate_size} + shared "
          f"x{qwen.resolved_shared_expert_size}, "
          f"QSA budget {qwen.indexer_budget} / ratio {qwen.indexer_compress_ratio}", flush=True)
    print(f"dense trunk (--match {a.match}): {dense.num_layers} x attention, heads "
          f"{dense.num_heads}/{dense.num_kv_heads} x "
          f"{dense.resolved_head_dim}, shared expert x{dense.resolved_shared_expert_size}, "
          "hc_count 1, no PLE, plain "
          "norms")
    print(f"parameters: total qwen4_exp {q_total / 1e6:.3f}M, dense {d_total / 1e6:.3f}M; "
          "embedding row + LM head "
          f"(active, both) {q_outer}; torch {torch.__version__}, {dev.type}, "
          f"{torch.get_num_threads()} threads, "
          f"{a.dtype}")
    print(f"active_params qwen4_exp={q_trunk} dense={d_trunk} rel_diff={rel:+.4f}", flush=True)
    if abs(rel) > MATCH_TOLERANCE:
        raise SystemExit(f"active parameters differ by {rel:+.1%} (> {MATCH_TOLERANCE:.0%})")

    forms = [("dense", "attention", "auto", 0.0)]
    for form in ("auto", "mask", "gather"):
        forms += [(form, "indexed_attention", form, 0.0), (f"{form}_kl", "indexed_attention", form,
                                                           qwen.indexer_loss_coef)]
    results: List[Dict[str, float]] = []
    for s in lengths:
        b = tokens // s
        toks = torch.randint(0, qwen.vocab_size, (b, s + 1),
                             generator=torch.Generator().manual_seed(1))
        runners = {"qwen4_exp": StepRunner(qwen, dev, dtype, toks),
                   "dense": StepRunner(dense, dev, dtype, toks)}
        for r in runners.values():
            r.step()  # warm-up
        times: Dict[str, List[float]] = {name: [] for name in runners}
        for _ in range(a.reps):
            for name, r in runners.items():
                times[name].append(r.step())
        del runners
        med = {name: statistics.median(t) for name, t in times.items()}
        # on a shared machine the fastest repetitions are the least disturbed: their ratio as a
        # cross-check
        row = {"seq": s, "batch": b, "step_ratio": med["qwen4_exp"] / med["dense"],
               "step_ratio_fastest": min(times["qwen4_exp"]) / min(times["dense"])}
        print(f"seq {s} x batch {b}: step qwen4_exp {med['qwen4_exp'] * 1e3:.1f} ms "
              f"(min {min(times['qwen4_exp']) * 1e3:.1f}), dense {med['dense'] * 1e3:.1f} ms "
              f"(min {min(times['dense']) * 1e3:.1f}), ratio {row['step_ratio']:.3f} "
              f"(fastest steps {row['step_ratio_fastest']:.3f})", flush=True)

        peaks = {}
        for name, kind, form, coef in forms:
            layer = make_layer(qwen, kind, dev, form, coef)
            if name == "auto":
                auto_form = "gather" if layer._use_gather(b, s) else "mask"
            peaks[name] = layer_peak(layer, dev, dtype, b, s, qwen.hidden_size)
            del layer
        for name in peaks:
            if name != "dense":
                row[f"mem_ratio_{name}"] = peaks[name] / peaks["dense"]
        row["selected_fraction"] = selected_fraction(make_layer(qwen, "indexed_attention", dev),
                                                     dev, b, s, qwen.hidden_size)
        print(f"seq {s} x batch {b}: peak MiB dense attention {peaks['dense'] / MIB:.2f}; QSA "
              + ", ".join(
            f"{name}{'(' + auto_form + ')' if name.startswith('auto') else ''} "
            f"{peaks[name] / MIB:.2f}"
            for name in peaks
            if name != "dense") + f"; selected fraction {row['selected_fraction']:.4f}", flush=True)
        results.append(row)

    print(f"summary ({a.dtype}, {dev.type}, {tokens} tokens per step, median of {a.reps}; ratios "
          "qwen4_exp/dense "
          "step time and QSA layer/dense attention peak memory, _kl with the indexer's KL):")
    for row in results:
        print(" ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}" for k,
                       v in row.items()))


if __name__ == "__main__":
    main()
