"""bench/gpu_check.py keeps running: its `--device cpu --quick` form steps both training configs at
K=0 and K=3 and decodes speculatively, and every figure it prints agrees with an independent
recomputation (FLOP ratios and memory estimates from the printed configs through
trainer/estimate.py, derived ratios from the printed raw figures, acceptance from the per-position
rates). No figure's size is asserted: timings on a shared CPU are noise. Bad --device values exit
before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from tandem.trainer.cost import hardware_flops_per_token, training_flops_per_token
from tandem.trainer.estimate import estimate
from tandem.trainer.recipe import load_config
from tests import processes

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
RECIPES = {
    "tiny": os.path.join(ROOT, "recipes", "tiny.yaml"),
    "1b": os.path.join(ROOT, "recipes", "moe_4b_mtp_gpu.yaml"),
}
PEAK_TFLOPS = 0.01  # a made-up CPU peak, so MFU is computed (and checkable) on CPU
K = 3


def _run(*args, timeout=600):
    return processes.command([sys.executable, SCRIPT, *args], timeout=timeout,
                             env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))


@pytest.fixture(scope="module")
def quick(corpus_cache):
    proc = _run("--device", "cpu", "--quick", "--peak-tflops", str(PEAK_TFLOPS), "--cache-dir",
                corpus_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures, verdicts = {}, {}
    for line in proc.stdout.splitlines():
        if " = " in line:
            name, rest = line.split(" = ", 1)
            value, _, verdict = rest.partition("  ")
            figures[name] = None if value == "n/a" else value
            verdicts[name] = verdict
    return proc.stdout.strip().splitlines(), figures, verdicts


def num(figures, name) -> float:
    assert figures[name] is not None, name
    return float(figures[name])


def close(a, b, digits=4) -> bool:
    """Equal to within the printed precision (relative, for ratios printed to `digits` decimals)."""
    return abs(a - b) <= 0.6 * 10 ** -digits * max(1.0, abs(b))


@pytest.mark.parametrize("name", ["tiny", "1b"])
def test_training_figures_agree_with_estimate(quick, name):
    _, f, verdicts = quick
    overrides = json.loads(f[f"{name}.overrides"])
    cfgs = {k: load_config(RECIPES[name], overrides + [f"mtp.num_steps={k}"]) for k in (0, K)}
    seq = cfgs[K].data.seq_len
    flops = {k: training_flops_per_token(c.model, c.mtp, seq) for k, c in cfgs.items()}  # MFU's
    hw = {k: hardware_flops_per_token(c.model, c.mtp, seq, c.train.activation_checkpointing) for k,
          c in cfgs.items()}
    # step times follow what runs
    assert close(num(f, f"{name}.flop_ratio_k3_over_k0"), hw[K] / hw[0])
    tokens_per_step = cfgs[K].train.micro_batch_size * seq
    for k in (0, K):
        step_s = num(f, f"{name}.k{k}.step_ms") / 1e3
        tps = num(f, f"{name}.k{k}.tokens_per_s")
        assert abs(tps - tokens_per_step / step_s) <= 0.05 + 1e-3 * tps
        mfu = flops[k] * tps / (PEAK_TFLOPS * 1e12)
        assert abs(num(f, f"{name}.k{k}.mfu") - mfu) <= 1e-3 * mfu
        est = estimate(cfgs[k]).total_gib_per_rank
        assert abs(num(f, f"{name}.k{k}.est_mem_gib") - est) <= 1e-3 * est
        ratio = num(f, f"{name}.k{k}.peak_mem_gib") / est
        assert abs(num(f, f"{name}.k{k}.mem_over_estimate") - ratio) <= 2e-3 * ratio + 1e-4
    step_ratio = num(f, f"{name}.k3.step_ms") / num(f, f"{name}.k0.step_ms")
    assert abs(num(f, f"{name}.step_ratio_k3_over_k0") - step_ratio) <= 1e-3 * step_ratio
    assert close(num(f, f"{name}.tokens_per_s_ratio_k0_over_k3"),
                 num(f, f"{name}.step_ratio_k3_over_k0"))
    assert close(num(f, f"{name}.k3_step_over_flop_ratio"),
                 num(f, f"{name}.step_ratio_k3_over_k0") / num(f, f"{name}.flop_ratio_k3_over_k0"),
                 3)
    if name == "1b":  # the ~1B config is the judged one: verdicts present, n/a on CPU
        assert verdicts["1b.k3.mfu"].startswith("n/a (target >= 0.4")
        assert verdicts["1b.k3_step_over_flop_ratio"].startswith("n/a (target <= 1.1")
        # derived from the GPU recipe: one device, no parallelism, the recipe's K=3 looped MTP
        assert (cfgs[K].parallel.tp, cfgs[K].parallel.pp, cfgs[K].parallel.ep) == (1, 1, 1)
        assert cfgs[K].mtp.num_steps == K and cfgs[K].train.dtype == "bf16"


def test_spec_decode_figures(quick):
    _, f, verdicts = quick
    cfg = load_config(RECIPES["tiny"], json.loads(f["spec.overrides"]))
    assert cfg.model.num_layers >= 16 * cfg.mtp.num_layers == 16
    assert num(f, "spec.trunk_layers_over_mtp_layers") == cfg.model.num_layers / cfg.mtp.num_layers
    a = num(f, "spec.acceptance_length")
    assert 1.0 <= a <= K + 1
    rates = [num(f, f"spec.accept_rate_pos_{i}") for i in range(1, K + 1)]
    # draft i is accepted only after every draft before it
    assert rates == sorted(rates, reverse=True)
    # 1 + accepted / drafts, each accepted draft counted at its position
    assert close(a, 1 + sum(rates), 3)
    speedup = num(f, "spec.spec_tokens_per_s") / num(f, "spec.ar_tokens_per_s")
    assert abs(num(f, "spec.speedup") - speedup) <= 0.01 * speedup
    assert close(num(f, "spec.speedup_over_acceptance"), num(f, "spec.speedup") / a, 3)
    # greedy speculative tokens == autoregressive
    assert f["spec.identical_to_autoregressive"] == "1"
    assert 0 < num(f, "spec.distinct_4") <= 1
    assert verdicts["spec.speedup_over_acceptance"].startswith("n/a (target >= 0.8")


def test_summary_line_repeats_the_figures(quick):
    lines, f, verdicts = quick
    assert lines[-1].startswith("summary: ")
    summary = dict(item.split("=", 1) for item in lines[-1][len("summary: "):].split())
    assert set(summary) >= {"mfu_1b", "k3_step_over_flop_ratio", "speedup_over_acceptance",
                            "acceptance_length", "mem_over_estimate_1b", "runtime_s"}
    assert abs(float(summary["mfu_1b"]) - num(f, "1b.k3.mfu")) <= 1e-3 * num(f, "1b.k3.mfu")
    assert abs(float(summary["speedup_over_acceptance"])
               - num(f, "spec.speedup_over_acceptance")) <= 1e-3
    assert summary["identical_to_autoregressive"] == "1"
    # section 3 (vLLM serving Qwen4-Exp) runs on CUDA only and says so here
    assert summary["qwen4_vllm_serving"] == "n/a" and verdicts["qwen4_serve.verdict"].startswith(
        "n/a ("
    )
    # on CPU nothing is judged: no PASS/FAIL anywhere
    assert not any(v.startswith(("PASS", "FAIL")) for v in verdicts.values())


@pytest.mark.parametrize("device,needle", [("tpu", "--device 'tpu' must be auto, cpu, cuda or npu"),
                                           ("cuda", "no CUDA device is visible")])
def test_bad_device_exits_before_any_work(device, needle, capsys):
    """In this process (the script's `main`; a process of its own would only add the imports)."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--device", device, "--quick"])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing measured, nothing printed
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: ") and needle in lines[0], err
