"""GPU check: the figures one accelerator (CUDA GPU or Ascend NPU) must show, in one run.

    python bench/gpu_check.py [--device auto|cuda|npu|cpu] [--quick] [--peak-tflops X]

1. bf16 training steps (the trainer's own step: TrainStep -> forward_backward, clipping, router-bias
   update, AdamW) of two configs, each at K=0 and at the recipe's K=3, on fixed random tokens: the
   tiny recipe, and a ~1B-active MoE derived from recipes/moe_4b_mtp_gpu.yaml (one device, no
   parallelism, seq 4096) whose expert count and micro-batch are sized with trainer/estimate.py to
   fit this device's memory. For each: step time, tokens/s, MFU (trainer/estimate.py's model FLOPs
   per token, 3x the forward, over the device's dense bf16 peak), the K=3/K=0 step-time ratio
   against the ratio of the FLOPs the steps execute (hardware FLOPs: the heads' recomputed logits
   included), and peak memory against estimate.py's prediction.
2. Speculative decoding on a trunk 16x deeper than its MTP layer (the tiny recipe at 16 layers, L=1,
   K=3), first trained with the real training loop on the embedded stdlib corpus so drafts mean
   something: acceptance length, spec and autoregressive tokens/s, speedup, speedup/acceptance, and
   whether the greedy speculative tokens equal autoregressive decoding's.
3. Serving Qwen4-Exp with vLLM (CUDA only; vLLM runs `qwen4_exp` nowhere else):
   `recipes/qwen4_exp_tiny.yaml` trained briefly with its MTP drafter, `tandem export --family
   qwen4_exp`, `tandem eval` greedy at K=3 with the serving draft convention, and the export served
   by vLLM (`tests/e2e/vllm_driver.py`, fp32, MTP speculation at K=3) from `--vllm-python` (default:
   $TANDEM_VLLM_PYTHON, else this interpreter when it imports vllm) on the same prompt ids: PASS
   when the greedy tokens are identical and vLLM's draft and accepted-token counters equal the
   evaluator's counted as vLLM counts them. Its time is reported apart from `runtime_s` (vLLM's
   start-up dominates it).
4. Speed next to acceptance (`bench/verify_cost.py`'s measurement, apart from `runtime_s`): for
   qwen4_exp (Gated DeltaNet + QSA) and the full-attention MoE family at their published widths (8
   and 16 layers, 64 experts; `--quick`: the test flavors), bf16 on an accelerator, batch 1 and 16,
   K=3, the evaluator's own decoder timing a 4-token verify forward against a 1-token forward per
   layer kind (`verify.<family>.b<B>. <kind>_ratio`), the drafter's step over a 1-token forward, and
   the break-even acceptance length (K * draft step + verify) / 1-token forward with the speedup at
   full acceptance.

Every figure is printed as `name = value` on its own line; targets (issue 13) get PASS/FAIL, judged
only on cuda/npu (n/a on CPU). The last line is `summary: key=value ...`. `--device cpu --quick`
shrinks every model, sequence and step count so CI runs all of it in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

T0 = time.perf_counter()  # runtime_s counts the torch import too

import torch  # noqa: E402

from tandem.models import flavors  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY_RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
MOE_RECIPE = os.path.join(ROOT, "recipes", "moe_4b_mtp_gpu.yaml")
K = 3
DRIVER = os.path.join(ROOT, "tests", "e2e", "vllm_driver.py")
QWEN4_RECIPE = os.path.join(ROOT, "recipes", "qwen4_exp_tiny.yaml")
TARGETS = {"mfu": 0.40, "k3_step_over_flop_ratio": 1.10, "speedup_over_acceptance": 0.80,
           "runtime_s": 480.0}

# One device, no parallelism, one micro-batch per step, bf16 autocast (fp32 master weights and
# AdamW); the training step alone (no in-loop evaluator, whose decoding a shrunk
# model.max_seq_len may not fit).
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.dp=1",
          "parallel.sequence_parallel=false", "eval.interval=0",
          "train.grad_accum_steps=1", "train.dtype=bf16", "train.activation_checkpointing=none"]
# --quick: the same recipes shrunk until a 2-core CPU steps them in milliseconds, and eager (the
# MoE recipe's regional compile costs a cold cache minutes there; the compiled layouts of
# tests/distributed/test_compile_layout.py check compiled training)
TINY_QUICK = ["data.seq_len=64", "train.micro_batch_size=2"]
MOE_QUICK = ["train.compile=false", "model.vocab_size=512", "model.hidden_size=64",
             "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.head_dim=32", "model.intermediate_size=128",
             "model.moe_intermediate_size=32", "model.num_experts=8", "model.top_k=2",
             "model.max_seq_len=128", "data.seq_len=64"]
# the test suite's `debug` model flavor (its layer count is the spec check's own), on a corpus slice
SPEC_QUICK = flavors.overrides("debug") + [
    "data.stdlib_max_bytes=200000", "data.vocab_size=512", "data.seq_len=32",
    "train.micro_batch_size=2", "train.warmup_steps=1", "model.max_seq_len=128"]

FIGURES: dict = {}


def show(name: str, value, fmt: str = ".4f", verdict: str = "") -> None:
    """Print one figure on its own line (n/a for None) and keep it for the summary."""
    FIGURES[name] = value
    text = "n/a" if value is None else (format(value, fmt) if isinstance(value,
                                                                         float) else str(value))
    print(f"{name} = {text}" + (f"  {verdict}" if verdict else ""), flush=True)


def judge(value, target: float, higher_is_better: bool, judged: bool) -> str:
    rel = ">=" if higher_is_better else "<="
    if not judged:
        return f"n/a (target {rel} {target:g}, judged on cuda/npu only)"
    if value is None:
        return f"n/a (target {rel} {target:g}: not measurable here)"
    ok = value >= target if higher_is_better else value <= target
    return f"{'PASS' if ok else 'FAIL'} (target {rel} {target:g})"


# --- the device ---------------------------------------------------------------------------------
def memory_capacity_gib(device) -> float:
    """The device's memory (host RAM on CPU): what the ~1B config is sized against."""
    if device.is_accelerator:
        return device.module.get_device_properties(device.device).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def current_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def free_memory(device) -> None:
    gc.collect()
    if device.is_accelerator:
        device.module.empty_cache()


# --- training steps -----------------------------------------------------------------------------
def measure_steps(recipe: str, overrides: list, device, warmup: int, steps: int) -> dict:
    """Build the model as the trainer does and time its training step on fixed random tokens."""
    from tandem.trainer.cost import hardware_flops_per_token, training_flops_per_token
    from tandem.trainer.estimate import estimate
    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import ParallelState
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    cfg = load_config(recipe, overrides)
    seq, mb = cfg.data.seq_len, cfg.train.micro_batch_size
    rss0 = 0.0 if device.is_accelerator else current_rss_gib()
    pstate = ParallelState(device=device)
    trainer = TrainStep(cfg, build_model(cfg, pstate), pstate)
    trainer.model.train()
    g = torch.Generator().manual_seed(cfg.train.seed)
    batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (mb, seq + 1), generator=g),
             "loss_mask": torch.ones(mb, seq),
             "doc_ids": torch.zeros(mb, seq + 1, dtype=torch.long)}
    batches = [{k: v.to(device.device) for k, v in batch.items()}]
    coefs = depth_coefficients(cfg.mtp, 0)

    def step() -> None:
        counts = trainer.global_target_counts(batches)
        trainer.forward_backward(batches, counts, coefs)
        trainer.clip_gradients()
        trainer.update_router_biases()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):  # kernels chosen, optimizer state allocated
        step()
    device.synchronize()
    device.reset_peak_memory()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        device.synchronize()
        times.append(time.perf_counter() - t0)
    # CPU: growth of the process's peak RSS over its RSS before
    peak = device.peak_memory_gb() - rss0
    trainer = batches = None  # the closure's references too: the next config needs the memory
    free_memory(device)
    step_s = statistics.median(times)
    return {"cfg": cfg, "step_s": step_s, "tokens_per_s": mb * seq / step_s, "peak_gib": peak,
            "est_gib": estimate(cfg).total_gib_per_rank,
            "flops_per_token": training_flops_per_token(cfg.model, cfg.mtp, seq),
            "hw_flops_per_token": hardware_flops_per_token(cfg.model, cfg.mtp, seq,
                                                           cfg.train.activation_checkpointing)}


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def size_moe(device, args) -> list:
    """Overrides of the ~1B-active config: the most experts (64, as the recipe, then 32, 16: the
    active parameters stay ~1.2B, top-6 of any) and then the largest micro-batch whose estimate.py
    prediction for K=3 fits `--mem-fraction` of this device's memory."""
    from tandem.trainer.estimate import estimate
    from tandem.trainer.recipe import load_config

    base = SINGLE + [f"device={device.type}",
                     f"mtp.num_steps={K}"] + (MOE_QUICK if args.quick else ["data.seq_len=4096"])
    budget = memory_capacity_gib(device) * args.mem_fraction
    experts = [None] if args.quick else [64, 32, 16]
    mbs = [args.micro_batch] if args.micro_batch else ([2, 1] if args.quick else [8, 4, 2, 1])
    choice = None
    for e in experts:
        for mb in mbs:
            ov = base + ([f"model.num_experts={e}"] if e else []) + [f"train.micro_batch_size={mb}"]
            est = estimate(load_config(MOE_RECIPE, ov))
            choice = (ov, est)
            if est.total_gib_per_rank <= budget:
                print(f"1b.sizing: {est.summary()} <= {budget:.1f} GiB ({args.mem_fraction:g} x "
                      f"{memory_capacity_gib(device):.1f} GiB)", flush=True)
                return ov
    print(f"1b.sizing: nothing fits {budget:.1f} GiB; trying the smallest ({choice[1].summary()})",
          flush=True)
    return choice[0]


def train_pair(name: str, recipe: str, overrides: list, device, args, judged: bool,
               target_config: bool) -> None:
    """K=0 and K=3 of one config at the same micro-batch; an out-of-memory halves it and starts
    over."""
    from tandem.trainer.recipe import load_config

    warmup, steps = (1, 2) if args.quick else (2, args.steps)
    while True:
        # the recipe's own micro-batch unless overridden (the tiny recipe's, off --quick)
        mb = load_config(recipe, overrides).train.micro_batch_size
        try:
            runs = {k: measure_steps(recipe, overrides + [f"mtp.num_steps={k}"], device, warmup,
                                     steps) for k in (0, K)}
            break
        except RuntimeError as exc:
            if not is_oom(exc) or mb == 1:
                raise
        free_memory(device)
        print(f"{name}: out of memory at micro-batch {mb}; retrying at {mb // 2}", flush=True)
        overrides = overrides + [f"train.micro_batch_size={mb // 2}"]
    cfg = runs[K]["cfg"]
    m = cfg.model
    show(f"{name}.overrides", json.dumps(overrides))
    print(f"{name}.config: layers={m.num_layers} hidden={m.hidden_size} experts={m.num_experts} "
          f"top{m.top_k} "
          f"vocab={m.vocab_size} seq={cfg.data.seq_len} micro_batch={cfg.train.micro_batch_size} "
          f"K={K}", flush=True)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device.peak_tflops() * 1e12
    for k, r in runs.items():
        show(f"{name}.k{k}.step_ms", 1e3 * r["step_s"], ".2f")
        show(f"{name}.k{k}.tokens_per_s", r["tokens_per_s"], ".1f")
        mfu = r["flops_per_token"] * r["tokens_per_s"] / peak if peak else None
        show(f"{name}.k{k}.mfu", mfu, ".4g", judge(mfu, TARGETS["mfu"], True,
                                                   judged) if target_config and k == K else "")
        show(f"{name}.k{k}.peak_mem_gib", r["peak_gib"], ".4g",
             "" if device.is_accelerator
             else "(peak RSS growth over the RSS before the model; process-wide)")
        show(f"{name}.k{k}.est_mem_gib", r["est_gib"], ".4g")
        show(f"{name}.k{k}.mem_over_estimate", r["peak_gib"] / r["est_gib"], ".3f")
    # step time follows what runs
    flop_ratio = runs[K]["hw_flops_per_token"] / runs[0]["hw_flops_per_token"]
    step_ratio = runs[K]["step_s"] / runs[0]["step_s"]
    show(f"{name}.flop_ratio_k3_over_k0", flop_ratio)
    show(f"{name}.step_ratio_k3_over_k0", step_ratio)
    show(f"{name}.tokens_per_s_ratio_k0_over_k3", runs[0]["tokens_per_s"] / runs[K]["tokens_per_s"])
    show(f"{name}.k3_step_over_flop_ratio", step_ratio / flop_ratio, ".4f",
         judge(step_ratio / flop_ratio, TARGETS["k3_step_over_flop_ratio"], False,
               judged) if target_config else "")


# --- speculative decoding -----------------------------------------------------------------------
def spec_decode(device, args, judged: bool, run_dir: str) -> None:
    """Train the 16-layer trunk + 1-layer MTP briefly with the real training loop, then decode with
    it."""
    from tandem.data_pipeline.batches import get_batch
    from tandem.eval.decode_eval import evaluate_decoding
    from tandem.eval.metrics import distinct_n
    from tandem.trainer.loop import run_training
    from tandem.trainer.parallel.device import autocast_context
    from tandem.trainer.recipe import explicit_keys, load_config
    from tandem.trainer.run import build_run

    steps = args.spec_train_steps if args.spec_train_steps is not None else (15 if args.quick
                                                                             else 300)
    n_prompts, prompt_len, new = (2, 16, 12) if args.quick else (8, 64, 64)
    overrides = (SPEC_QUICK if args.quick else []) + [
        "model.num_layers=16", "mtp.num_layers=1", f"mtp.num_steps={K}", f"device={device.type}",
        "train.dtype=bf16",
        f"train.max_steps={steps}", "eval.interval=0", "checkpoint.interval=0",
        "checkpoint.save_final=false",
        "logging.wandb=false", "logging.progress=false", f"eval.num_prompts={n_prompts}",
        f"run.dir={run_dir}"]
    if args.cache_dir:
        overrides.append(f"data.cache_dir={args.cache_dir}")
    cfg = load_config(TINY_RECIPE, overrides)
    depth = cfg.model.num_layers / cfg.mtp.num_layers
    show("spec.overrides", json.dumps(overrides))
    show("spec.trunk_layers_over_mtp_layers", depth, ".1f")
    if depth < 16:
        raise SystemExit("gpu_check: error: the spec-decode trunk must be >= 16x deeper than its "
                         "MTP module, got "
                         f"{depth}")
    t0 = time.perf_counter()
    trainer = build_run(cfg, explicit=explicit_keys(TINY_RECIPE, overrides))  # as `tandem train`
    record = run_training(trainer)
    show("spec.train_steps", steps)
    show("spec.train_seconds", time.perf_counter() - t0, ".1f")
    show("spec.train_loss_main", record["loss/main"])
    show(f"spec.train_loss_mtp_{K}", record[f"loss/mtp_{K}"])
    tokens = get_batch(trainer.valid_ds, list(range(n_prompts)))["tokens"]
    prompts = [row[:prompt_len].tolist() for row in tokens]  # held-out text, never trained on
    model = trainer.model.eval()
    # decode in the precision it trained in on accelerators (as the in-loop evaluator does); CPU
    # bf16 autocast is no serving setup, so CPU decodes in fp32
    precision = (
        autocast_context(device.type, torch.bfloat16)
        if device.is_accelerator
        else contextlib.nullcontext()
    )
    with torch.inference_mode(), precision:
        m, spec_runs, _ = evaluate_decoding(model, prompts, num_steps=K, max_new_tokens=new,
                                            batch_size=1,
                                            warmup=True, repeats=1 if args.quick else 3)
    a, s = m["acceptance_length"], m["speedup"]
    show("spec.prompts",
         f"{n_prompts} x {prompt_len} tokens, {new} new tokens, batch 1, greedy, K={K}")
    show("spec.acceptance_length", a)
    for i in range(1, K + 1):
        show(f"spec.accept_rate_pos_{i}", m[f"accept_rate/pos_{i}"])
    show("spec.spec_tokens_per_s", m["decode_tokens_per_s/spec"], ".1f")
    show("spec.ar_tokens_per_s", m["decode_tokens_per_s/ar"], ".1f")
    show("spec.speedup", s)
    show("spec.speedup_predicted", m["speedup_predicted"])
    show("spec.speedup_over_acceptance", s / a, ".4f",
         judge(s / a, TARGETS["speedup_over_acceptance"], True, judged))
    show("spec.identical_to_autoregressive", int(m["identical_to_autoregressive"]))
    # near 1 for varied text; low when continuations loop, which are easy to draft and inflate
    # acceptance
    show("spec.distinct_4", distinct_n([o for r in spec_runs for o in r.outputs], 4), ".4f")
    del trainer, model
    free_memory(device)


def vllm_interpreter(args):
    """The Python that runs vLLM: --vllm-python, $TANDEM_VLLM_PYTHON, or this one when it has
    vllm."""
    import importlib.util

    path = args.vllm_python or os.environ.get("TANDEM_VLLM_PYTHON", "")
    if path:
        return path
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def qwen4_vllm_serving(device, args, run_dir: str) -> None:
    """Section 3: a trained qwen4_exp_tiny export served by vLLM against Tandem's evaluator."""
    import subprocess

    py = vllm_interpreter(args)
    if device.type != "cuda" or py is None:
        why = "vLLM serves qwen4_exp on CUDA only" if device.type != "cuda" else ("no vLLM (pass "
                                                                                  "--vllm-python)")
        show("qwen4_serve.verdict", None, verdict=f"n/a ({why})")
        return
    t0 = time.perf_counter()
    n_prompts, new = 8, 32
    run, hf, records = (os.path.join(run_dir, x) for x in ("q4run", "q4hf", "q4eval.jsonl"))
    steps = 20 if args.quick else 200
    cli = [sys.executable, "-m", "tandem.trainer.cli"]
    env = dict(os.environ, WANDB_MODE="disabled")
    # fp32, as the recipe and the vLLM driver's default: `tandem eval` decodes in the run's
    # train.dtype, and bf16 near-ties against vLLM's fp32 would flip greedy tokens
    train = cli + ["train", QWEN4_RECIPE, f"run.dir={run}", "device=cuda", "train.dtype=fp32",
                   f"train.max_steps={steps}",
                   "eval.interval=0", f"checkpoint.interval={steps}", "logging.progress=false"]
    if args.cache_dir:
        train.append(f"data.cache_dir={args.cache_dir}")
    steps_run = [train, cli + ["export", "--checkpoint", run, "--out", hf, "--family", "qwen4_exp"],
                 cli + ["eval", "--checkpoint", run, "--device", "cuda", "--num-prompts",
                        str(n_prompts), "--num-steps",
                        str(K), "--max-new-tokens", str(new), "--draft-convention", "serving",
                        "--output", records]]
    for cmd in steps_run:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            show("qwen4_serve.verdict", None, verdict=f"FAIL ({cmd[3]} exited {proc.returncode}: "
                 f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''})")
            return
    rows = [json.loads(x) for x in open(records)]
    prompts, outputs = [r["prompt_ids"] for r in rows], [r["output_ids"] for r in rows]
    # Tandem's rounds counted as vLLM counts them: every proposed draft, accepted until the first
    # miss
    tandem_counts = [sum(r["drafts"] for r in rows), sum(r["accepted_all"] for r in rows)]
    prompts_file = os.path.join(run_dir, "q4prompts.json")
    with open(prompts_file, "w") as f:
        json.dump(prompts, f)
    from tandem.data_pipeline.tokenizer import load_tokenizer

    eos = load_tokenizer(hf).eod_id
    proc = subprocess.run([py, DRIVER, hf, prompts_file, "--k", str(K), "--max-tokens", str(new),
                           "--max-model-len", "512", "--memory", "0.3"] + (["--eos",
                                                                            str(eos)] if eos
                                                                           is not None else []),
                          capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("VLLM_RESULT ")]
    show("qwen4_serve.seconds", time.perf_counter() - t0, ".1f")
    if proc.returncode != 0 or not line:
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        show("qwen4_serve.verdict", None, verdict=f"FAIL (vLLM exited {proc.returncode}: {tail})")
        return
    got = json.loads(line[-1][len("VLLM_RESULT "):])
    vm = got["metrics"]
    vllm_counts = [vm["num_drafts"], vm["num_accepted_tokens"]]
    same = sum(a == b for a, b in zip(got["outputs"], outputs))
    show("qwen4_serve.identical_outputs", f"{same}/{len(outputs)}")
    show("qwen4_serve.acceptance_length_vllm", 1 + vllm_counts[1] / max(vllm_counts[0], 1))
    show("qwen4_serve.acceptance_length_tandem", 1 + tandem_counts[1] / max(tandem_counts[0], 1))
    ok = same == len(outputs) and vllm_counts == tandem_counts
    show("qwen4_serve.verdict", "PASS" if ok else "FAIL",
         verdict=f"(counts [drafts, accepted]: vLLM {vllm_counts}, "
         f"Tandem {tandem_counts})")


def verify_cost(device, args) -> None:
    """Section 4: per-layer-kind cost of a (K+1)-token verify over a 1-token forward, and
    break-even."""
    from bench.verify_cost import KINDS, build, cost_model, measure

    t0 = time.perf_counter()
    size, prompt_len, reps = ("tiny", 32, 3) if args.quick else ("real", 4096, 20)
    dtype = torch.bfloat16 if device.is_accelerator else torch.float32
    for family in ("qwen4_exp", "moe"):
        model, _ = build(family, size, prompt_len + 4 * K + 16, device.device, dtype)
        for batch in (1, 16):
            try:
                m = measure(model, batch, [K], prompt_len, reps, 2, device.device)
            except RuntimeError as exc:
                if not is_oom(exc):
                    raise
                show(f"verify.{family}.b{batch}.break_even", None, verdict="n/a (out of memory)")
                free_memory(device)
                continue
            name = f"verify.{family}.b{batch}"
            one, ver = m["split"][0], m["split"][K]
            for kind in (*KINDS, "total"):
                if m["layers"].get(kind) or kind in ("head", "total"):
                    show(f"{name}.{kind}_ratio", ver[kind] / max(one[kind], 1e-12))
            c1, cd, cv = m["one"], m["draft_step"], m["verify"][K]
            be, top = cost_model(c1, cd, cv, K)
            show(f"{name}.one_ms", 1e3 * c1, ".3f")
            show(f"{name}.verify_over_one", cv / c1)
            show(f"{name}.draft_step_over_one", cd / c1)
            show(f"{name}.break_even", be, ".4f",
                 f"(acceptance length at which K={K} pays; at most {K + 1})")
            show(f"{name}.max_speedup", top)
            exact = m["rollback_exact"]
            show(f"{name}.rollback_exact", None if exact is None else int(exact),
                 verdict="" if exact is not None else
                 "(a repeated 1-token forward differs in its last bits: nothing to compare)")
        del model
        free_memory(device)
    show("verify.seconds", time.perf_counter() - t0, ".1f")


# --- entry point --------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto",
                   help="auto (cuda, then npu, then cpu), cuda, npu or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes and step counts (CI on CPU)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="dense bf16 peak TFLOP/s of the device for MFU (default: the known-device "
                        "table)")
    p.add_argument("--steps", type=int, default=5,
                   help="timed training steps per run (after 2 warm-up steps)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="the ~1B config's micro-batch (default: sized to fit)")
    p.add_argument("--mem-fraction", type=float, default=0.8,
                   help="share of device memory the ~1B config's estimated peak may take when "
                        "sizing it")
    p.add_argument("--spec-train-steps", type=int, default=None,
                   help="training steps of the spec-decode model")
    p.add_argument("--cache-dir", default="", help="the stdlib corpus cache (data.cache_dir)")
    p.add_argument("--vllm-python", default="",
                   help="interpreter of a vLLM (CUDA) environment for section 3")
    args = p.parse_args(argv)
    for flag, value, ok in (("--steps", args.steps, args.steps >= 1),
                            ("--micro-batch", args.micro_batch,
                                                                       args.micro_batch >= 0),
                            ("--mem-fraction", args.mem_fraction, 0 < args.mem_fraction <= 1),
                            ("--peak-tflops", args.peak_tflops, args.peak_tflops >= 0)):
        if not ok:
            p.exit(2, f"gpu_check: error: {flag}={value} is out of range\n")
    return p, args


def main(argv=None) -> int:
    p, args = parse_args(argv)
    if args.device not in ("auto", "cpu", "cuda", "npu"):
        p.exit(2, f"gpu_check: error: --device {args.device!r} must be auto, cpu, cuda or npu\n")
    from tandem.trainer.config_checks import ConfigError
    from tandem.trainer.parallel.device import resolve_device

    try:
        device = resolve_device(args.device, dtype="bf16")
    except ConfigError as exc:  # no such device here, or no bf16 on it: before any work
        message = str(exc).replace(f"config key 'device'={args.device!r}",
                                   f"--device {args.device}")
        p.exit(2, f"gpu_check: error: {message}\n")
    if args.quick and not device.is_accelerator:
        # ops this small only pay for intra-op threads (and thrash a shared CPU)
        torch.set_num_threads(1)
    judged = device.is_accelerator
    name = device.module.get_device_name(device.device) if judged else "cpu"
    peak = args.peak_tflops or device.peak_tflops()
    print(f"gpu_check: device={device.type} ({name}) torch={torch.__version__} dtype=bf16 "
          f"quick={args.quick} "
          f"peak={f'{peak:g} TFLOP/s' if peak else 'unknown (pass --peak-tflops)'}; targets "
          f"{'judged' if judged else 'n/a: judged on cuda/npu only'}", flush=True)

    tiny = SINGLE + [f"device={device.type}"] + (TINY_QUICK if args.quick else [])
    train_pair("tiny", TINY_RECIPE, tiny, device, args, judged, target_config=False)
    train_pair("1b", MOE_RECIPE, size_moe(device, args), device, args, judged, target_config=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as run_dir:
        spec_decode(device, args, judged, run_dir)
    runtime = time.perf_counter() - T0
    show("runtime_s", runtime, ".1f",
         judge(runtime, TARGETS["runtime_s"], False, judged and not args.quick))
    with tempfile.TemporaryDirectory(prefix="gpu_check_q4_") as run_dir:
        qwen4_vllm_serving(device, args, run_dir)
    verify_cost(device, args)
    keys = {"mfu_1b": "1b.k3.mfu", "mfu_1b_k0": "1b.k0.mfu",
            "tokens_per_s_1b_k0": "1b.k0.tokens_per_s",
            "tokens_per_s_1b_k3": "1b.k3.tokens_per_s", "flop_ratio_1b": "1b.flop_ratio_k3_over_k0",
            "k3_step_over_flop_ratio": "1b.k3_step_over_flop_ratio",
            "mem_over_estimate_1b": "1b.k3.mem_over_estimate",
            "acceptance_length": "spec.acceptance_length", "speedup": "spec.speedup",
            "speedup_over_acceptance": "spec.speedup_over_acceptance",
            "identical_to_autoregressive": "spec.identical_to_autoregressive",
            "runtime_s": "runtime_s", "qwen4_vllm_serving": "qwen4_serve.verdict",
            **{f"break_even_{f}_b{b}": f"verify.{f}.b{b}.break_even" for f in ("qwen4_exp", "moe")
               for b in (1, 16)}}
    def shown(value):
        return "n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else value

    print("summary: " + " ".join(f"{k}={shown(FIGURES[v])}" for k, v in keys.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
