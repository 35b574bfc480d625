"""Speed next to acceptance: what a (K+1)-token verify forward costs over a 1-token forward, per
layer kind, and the acceptance length at which speculative decoding pays for itself.

    python bench/verify_cost.py [--families qwen4_exp,moe] [--size small|tiny|real] [--batches 1,16]
        [--ks 1,2,3] [--prompt-len N] [--reps 15] [--threads 1] [--device cpu|cuda|auto] [--dtype
        fp32|bf16] [--checkpoint DIR --suites humaneval,mt_bench] [--quick]

Everything runs through the evaluator's own decode path (eval/spec_decode.py `SpecDecoder`): one
decoder per (family, batch) prefills `--prompt-len` random tokens per row, drafts once (the
drafter's depth 1 catches up over the prompt), and then, from that state and without committing
anything, times

* the 1-token forward (`c_1`): `SpecDecoder.verify` at K=0, i.e. one autoregressive step (trunk over
  the newest token, final norm, head, argmax);
* the (K+1)-token verify (`c_verify(K)`): `SpecDecoder.verify` with its K set to k, over [x_m,
  d_1..d_k] (trunk, head, greedy acceptance), for every k of `--ks`; Gated DeltaNet runs its
  recurrent form here (models/gated_deltanet.py `_verify`: k+1 sequential state updates, every state
  kept for rollback);
* the draft round (`SpecDecoder.draft`, the `serving` convention: depth 1 over the one position
  committed since the last draft, depths 2..K one token each); `c_draft` = its time / K_max.

Nothing is committed, so every repetition starts from the same decoder state (the rollback contract,
models/state.py: a forward writes only positions past the committed prefix); the run checks it
(`rollback_exact`: the 1-token logits after all the verify forwards equal the first ones; n/a where
the same forward repeated at once already differs, as CUDA's bf16 kernels can) and counts
the recurrent steps each Gated DeltaNet layer runs per forward (`recurrent_steps`).

Per layer kind: forward hooks on the trunk's blocks, their token mixers (`linear_attention` = Gated
DeltaNet, `indexed_attention` = QSA, `full_attention`), their MLPs (`moe`, `dense_mlp`), PLE and the
embedding time each module call (with a device synchronize around it on an accelerator), summed by
kind over the layers; `residual` is the blocks' time outside those (hyper-connections or norms),
`head` the call's time outside the blocks and embedding (final norm, LM head, argmax, acceptance);
each kind's figure is its median over the repetitions and the split's `total` their sum. Totals for
the cost model are timed without hooks. Repetitions interleave every forward; medians. One thread by
default (`torch.set_num_threads`): the ops of one decode step are too small to share out, and a
shared CPU's other work stays out.

Cost model (per round of K drafts, one verify; host overhead such as the commit and the per-round
host read left out): speedup(L) = L * c_1 / (K * c_draft + c_verify(K)), L the acceptance length
(tokens a round yields per row, 1 <= L <= K+1); break-even L* = (K * c_draft + c_verify(K)) / c_1;
`max_speedup` = speedup at L = K+1 (every draft accepted). L* > K+1 means drafting K tokens can
never pay here.

Families (`--size`): `qwen4_exp` (Gated DeltaNet x3 then QSA, hyper-connections, PLE, MoE with a
gated shared expert; its drafter one QSA + MoE layer) and `moe` (the full-attention MoE family:
DeepSeek-V3-like, sigmoid router, GQA; its drafter one attention + MoE layer), each at
  tiny:  the test flavors `debug_qwen4` / `debug` (--quick); small: the published shapes
  (`qwen38_flash`, `moe_4b` in models/flavors.py) at a quarter of every width
         (hidden 640 / 512, heads or head dims halved twice over), 8 layers, 128 / 64 experts:
         seconds per forward on one CPU thread;
  real:  the published widths, 8 / 16 layers, 64 experts (an accelerator).
`L*@depth` rescales the measured blocks' share of c_1 and c_verify to the flavor's own layer count
(48 / 16; the drafter stays one layer): an estimate, printed beside the measured figure.

`--checkpoint DIR --suites humaneval,mt_bench`: the checkpoint's model is measured the same way at
batch 1, then `tandem eval --suite S` decodes each suite speculatively and autoregressively (batch
1, greedy); each suite's line puts the measured speedup next to the evaluator's prediction (its
measured phase times) and the cost model's (the acceptance length measured there, the costs measured
here).

Output: `cost ...`, `breakeven ...`, `suite ...` lines of key=value pairs (what the test parses),
then `summary: ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.eval.spec_decode import SpecDecoder, synchronize  # noqa: E402
from tandem.models import MTPConfig, TandemModel, flavors, gated_deltanet  # noqa: E402
from tandem.models.moe import MoE  # noqa: E402

KINDS = ("linear_attention", "indexed_attention", "full_attention", "moe", "dense_mlp", "ple",
         "residual", "embed", "head")
"""Where a forward's time goes (module docstring); `total` is their sum."""
MIXER_KIND = {"linear_attention": "linear_attention", "indexed_attention": "indexed_attention",
              "attention": "full_attention"}

# A quarter of the published widths (heads and head dims each halved where both exist), 8 layers.
SMALL = {
    "qwen4_exp": ("qwen38_flash", dict(
        hidden_size=640, num_layers=8, num_heads=12, num_kv_heads=1, head_dim=128,
        intermediate_size=160,
        moe_intermediate_size=160, shared_expert_intermediate_size=160, num_experts=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
        indexer_heads=2,
        indexer_head_dim=64, indexer_budget=64, hc_lowrank=80, ngram_vocab_base=100003,
        vocab_size=62080, eos_token_id=0)),
    "moe": ("moe_4b", dict(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
        intermediate_size=2736, moe_intermediate_size=176, vocab_size=25600)),
}
REAL = {"qwen4_exp": ("qwen38_flash", dict(num_layers=8, num_experts=64, ngram_vocab_base=1000003)),
        "moe": ("moe_4b", dict())}
TINY = {"qwen4_exp": ("debug_qwen4", dict()), "moe": ("debug", dict())}
FLAVOR_DEPTH = {"qwen4_exp": flavors.model_config("qwen38_flash").num_layers,
                "moe": flavors.model_config("moe_4b").num_layers}


def build(family: str, size: str, max_len: int, device: torch.device, dtype: torch.dtype,
          seed: int = 0):
    """A TandemModel of `family` at `size` (module docstring) with a K=3 looped 1-layer MTP drafter,
    in eval mode; (model, the flavor's own trunk depth)."""
    name, changes = {"tiny": TINY, "small": SMALL, "real": REAL}[size][family]
    base = flavors.model_config(name)
    cfg = flavors.model_config(name, **{**changes, "max_seq_len": max(max_len, base.max_seq_len)})
    torch.manual_seed(seed)
    with torch.device(device):
        model = TandemModel(cfg, MTPConfig(num_steps=3, num_layers=1))
    return model.to(dtype).eval(), FLAVOR_DEPTH[family] if size != "tiny" else cfg.num_layers


class KindTimer:
    """Forward hooks on the trunk's modules, timing each call by layer kind while `hooked()` is
    open."""

    def __init__(self, model: TandemModel, device: torch.device):
        self.device = device
        self.watch: List[Tuple[torch.nn.Module, str]] = [(model.embed_tokens, "embed")]
        for block in model.layers.values():
            self.watch.append((block, "block"))
            self.watch.append((block.mixer, MIXER_KIND[block.kind]))
            self.watch.append((block.mlp, "moe" if isinstance(block.mlp, MoE) else "dense_mlp"))
            if block.ple is not None:
                self.watch.append((block.ple, "ple"))
        self.layers = defaultdict(int)
        for _, kind in self.watch:
            self.layers[kind] += 1
        self.seconds: Dict[str, float] = defaultdict(float)
        self._start: Dict[int, float] = {}

    def _hooks(self, kind: str):
        def pre(module, args):
            synchronize(self.device)
            self._start[id(module)] = time.perf_counter()

        def post(module, args, out):
            synchronize(self.device)
            self.seconds[kind] += time.perf_counter() - self._start.pop(id(module))

        return pre, post

    @contextlib.contextmanager
    def hooked(self):
        handles = []
        for module, kind in self.watch:
            pre, post = self._hooks(kind)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def split(self, fn: Callable[[], object]) -> Dict[str, float]:
        """One call of `fn` under the hooks: seconds per kind (KINDS) and `total`."""
        self.seconds.clear()
        with self.hooked():
            total = timed(fn, self.device)
        parts = {k: self.seconds.get(k, 0.0) for k in KINDS}
        blocks = self.seconds.get("block", 0.0)
        parts["residual"] = blocks - sum(parts[k] for k in ("linear_attention", "indexed_attention",
                                                            "full_attention",
                                                             "moe", "dense_mlp", "ple"))
        parts["head"] = total - blocks - parts["embed"]
        parts["total"] = total
        return parts


def timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


@contextlib.contextmanager
def counting_recurrent_steps(counts: List[int]):
    """Record the steps (tokens) of every recurrent Gated DeltaNet call made inside."""
    real = gated_deltanet.recurrent_gated_delta_rule

    def counted(q_bhtk, *args, **kwargs):
        counts.append(q_bhtk.shape[2])
        return real(q_bhtk, *args, **kwargs)

    gated_deltanet.recurrent_gated_delta_rule = counted
    try:
        yield
    finally:
        gated_deltanet.recurrent_gated_delta_rule = real


@torch.inference_mode()
def measure(model: TandemModel, batch: int, ks: List[int], prompt_len: int, reps: int, warmup: int,
            device: torch.device, seed: int = 0) -> dict:
    """Costs of one decoder state of `model` at `batch` rows: medians over `reps` of the unhooked
    totals (`one`, `verify[k]`, `draft_step`) and of the hooked per-kind splits (`split[k]`, k = 0
    for one token), the recurrent steps per Gated DeltaNet call and the rollback check."""
    K = max(ks)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (batch, prompt_len), generator=g).tolist()
    dec = SpecDecoder(model, K, batch, prompt_len + 2 * K + 8)
    dec.prefill(prompts)
    dec.read_lengths()
    # depth 1 catches up over the prompt; later drafts see one new position
    drafts, _, _ = dec.draft()

    def forward(k: int):
        """SpecDecoder.verify with K = k: the trunk over [x_m, d_1..d_k], head, greedy
        acceptance."""
        dec.K = k
        try:
            return dec.verify(drafts[:, :k], None)
        finally:
            dec.K = K

    def logits_one() -> torch.Tensor:
        pos = dec.m.unsqueeze(1)
        dec.trunk_cache.span = dec.batch.span_to(dec.batch.m_hi)
        h = model.trunk(dec.seq.gather(1, pos), pos, dec.trunk_cache)
        return model.logits(0, h).float()

    before = logits_one()
    # the same forward again: on CUDA in bf16 it can differ in its last bits (the full-attention
    # family at batch 16 on an H200: 2.4e-4 in one attention layer's output, which a router can turn
    # into another expert), and then no rollback check can be exact
    repeatable = torch.equal(before, logits_one())
    steps: Dict[int, List[int]] = {}
    for k in [0] + ks:
        counts: List[int] = []
        with counting_recurrent_steps(counts):
            forward(k)
        steps[k] = counts
    timer = KindTimer(model, device)
    raw: Dict[str, List[float]] = defaultdict(list)
    splits: Dict[int, List[Dict[str, float]]] = defaultdict(list)
    for r in range(warmup + reps):
        order = [0] + ks if r % 2 == 0 else list(reversed([0] + ks))
        rep_raw = {f"v{k}": timed(lambda: forward(k), device) for k in order}
        rep_raw["draft"] = timed(dec.draft, device)
        rep_split = {k: timer.split(lambda: forward(k)) for k in order}
        if r >= warmup:
            for name, v in rep_raw.items():
                raw[name].append(v)
            for k, s in rep_split.items():
                splits[k].append(s)
    after = logits_one()
    med = statistics.median
    split = {k: {kind: med([s[kind] for s in splits[k]]) for kind in KINDS} for k in [0] + ks}
    for parts in split.values():
        parts["total"] = sum(parts.values())  # medians per kind, so that the split adds up
    return {"one": med(raw["v0"]), "verify": {k: med(raw[f"v{k}"]) for k in ks},
            "draft_step": med(raw["draft"]) / K,
            "split": split, "layers": dict(timer.layers), "steps": steps, "K": K,
            "rollback_exact": bool(torch.equal(before, after)) if repeatable else None}


def rollback_text(m: dict) -> str:
    """`measure`'s rollback check: 1 or 0, or n/a where a repeated 1-token forward differs."""
    return "n/a" if m["rollback_exact"] is None else str(int(m["rollback_exact"]))


def cost_model(c1: float, c_draft: float, c_verify: float, k: int) -> Tuple[float, float]:
    """(break-even acceptance length, speedup at L = k+1) of K=k drafts a round."""
    round_cost = k * c_draft + c_verify
    return round_cost / c1, (k + 1) * c1 / round_cost


def predicted_speedup(L: float, c1: float, c_draft: float, c_verify: float, k: int) -> float:
    return L * c1 / (k * c_draft + c_verify)


def at_depth(split: Dict[str, float], total: float, scale: float) -> float:
    """`total` with the blocks' share of the hooked split multiplied by `scale` (a deeper trunk)."""
    blocks = sum(v for kind, v in split.items() if kind not in ("embed", "head", "total"))
    return total * (1 + (scale - 1) * blocks / max(split["total"], 1e-12))


def report(family: str, batch: int, m: dict, ks: List[int], depth: int, bench_depth: int) -> dict:
    """Print the `cost` and `breakeven` lines of one measurement; returns {k: break-even}."""
    layers = m["layers"]
    for k in ks:
        for kind in (*KINDS, "total"):
            one, ver = m["split"][0][kind], m["split"][k][kind]
            if kind not in ("residual", "head", "total", "embed") and not layers.get(kind):
                continue
            print(f"cost family={family} batch={batch} K={k} kind={kind} "
                  f"layers={layers.get(kind, 0)} "
                  f"one_ms={1e3 * one:.6f} verify_ms={1e3 * ver:.6f} "
                  f"ratio={ver / max(one, 1e-12):.4f}")
    steps = m["steps"]
    gdn = layers.get("linear_attention", 0)
    for k in [0] + ks:
        print(f"recurrent_steps family={family} batch={batch} tokens={k + 1} calls={len(steps[k])} "
              f"steps={','.join(map(str, sorted(set(steps[k])))) or '-'} gdn_layers={gdn}")
    out = {}
    scale = depth / bench_depth
    for k in ks:
        c1, cd, cv = m["one"], m["draft_step"], m["verify"][k]
        be, top = cost_model(c1, cd, cv, k)
        c1_deep, cv_deep = at_depth(m["split"][0], c1, scale), at_depth(m["split"][k], cv, scale)
        be_deep, top_deep = cost_model(c1_deep, cd, cv_deep, k)
        print(f"breakeven family={family} batch={batch} K={k} c1_ms={1e3 * c1:.6f} "
              f"draft_step_ms={1e3 * cd:.6f} "
              f"verify_ms={1e3 * cv:.6f} verify_over_one={cv / c1:.4f} "
              f"draft_over_one={cd / c1:.4f} "
              f"break_even={be:.4f} max_speedup={top:.4f} depth={depth} "
              f"break_even_at_depth={be_deep:.4f} "
              f"max_speedup_at_depth={top_deep:.4f} rollback_exact={rollback_text(m)}")
        out[k] = be
    return out


def suites(args, device: torch.device) -> None:
    """Measured vs predicted speedup per suite on a checkpoint (module docstring)."""
    from tandem.trainer.checkpoint import load_model_from_checkpoint, resolve_checkpoint
    from tandem.trainer.eval_cli import eval_main

    model, cfg = load_model_from_checkpoint(resolve_checkpoint(args.checkpoint), str(device))
    model.eval()
    K = cfg.mtp.num_steps
    m = measure(model, 1, [K], args.prompt_len, args.reps, args.warmup, device)
    report("checkpoint", 1, m, [K], cfg.model.num_layers, cfg.model.num_layers)
    c1, cd, cv = m["one"], m["draft_step"], m["verify"][K]
    for suite in args.suites.split(","):
        out = io.StringIO()
        argv = ["--checkpoint", args.checkpoint, "--suite", suite, "--num-prompts",
                str(args.suite_prompts),
                "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "1", "--num-steps",
                str(K), "--device", str(device)]
        with contextlib.redirect_stdout(out):
            rc = eval_main(argv)
        if rc != 0:
            print(f"suite name={suite} error=eval_exit_{rc}")
            continue
        r = json.loads(out.getvalue().strip().splitlines()[-1])
        L = r["acceptance_length"]
        print(f"suite name={suite} prompts={r['num_prompts']} K={K} acceptance_length={L:.4f} "
              f"acceptance_length_lo95={r['acceptance_length_lo95']:.4f} "
              f"acceptance_length_hi95={r['acceptance_length_hi95']:.4f} "
              f"speedup={r['speedup']:.4f} speedup_predicted_eval={r['speedup_predicted']:.4f} "
              f"speedup_predicted_cost={predicted_speedup(L, c1, cd, cv, K):.4f} "
              f"break_even={cost_model(c1, cd, cv, K)[0]:.4f} "
              f"identical_to_autoregressive={int(bool(r.get('identical_to_autoregressive')))}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="qwen4_exp,moe", help="comma-separated: qwen4_exp, moe")
    p.add_argument("--size", choices=["tiny", "small", "real"], default="small")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--ks", default="1,2,3", help="draft lengths K whose verify forward is timed")
    p.add_argument("--prompt-len", type=int, default=256,
                   help="committed tokens per row before the timed forwards")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (1: stable on a shared CPU)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--checkpoint", default="",
                   help="with --suites: a trained run or step directory")
    p.add_argument("--suites", default="",
                   help="with --checkpoint: suites of `tandem eval --suite`")
    p.add_argument("--suite-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--quick", action="store_true",
                   help="tiny flavors, 32-token prompts, 3 repetitions (CI)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.prompt_len, args.reps, args.warmup = "tiny", 32, 3, 1
        args.batches = "1,4" if args.batches == "1,16" else args.batches
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ks = [int(k) for k in args.ks.split(",")]
    print(f"verify_cost: device={device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"size={args.size} "
          f"prompt_len={args.prompt_len} reps={args.reps} torch={torch.__version__}", flush=True)
    if args.checkpoint:
        suites(args, device)
        return 0
    summary = {}
    for family in args.families.split(","):
        model, depth = build(family, args.size, args.prompt_len + 4 * max(ks) + 16, device, dtype)
        for batch in [int(b) for b in args.batches.split(",")]:
            m = measure(model, batch, ks, args.prompt_len, args.reps, args.warmup, device)
            be = report(family, batch, m, ks, depth, model.cfg.num_layers)
            summary[f"break_even_{family}_b{batch}_k{max(ks)}"] = be[max(ks)]
        del model
    print("summary: " + " ".join(f"{k}={v:.4f}" for k, v in summary.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
