"""Training throughput: Tandem vs transformers' Qwen3-MoE on the identical model, one process.

Both sides train the same architecture from random init (no download): fwd + bwd + AdamW (fused on
both: Tandem's `train.optimizer_kernel=auto` on CPU and transformers' Trainer default
`adamw_torch_fused`; same hyper-parameters), on the same fixed tokens, in fp32 or (`--dtype bf16`)
both under CPU bf16 autocast with fp32 weights. Repetitions are interleaved (Tandem K=0, Tandem K=K,
transformers, ...) so machine noise hits all alike; medians are reported.

`--compile` adds Tandem K=0 with its blocks compiled (`train.compile`: trunk/MTP blocks under
torch.compile, regional) to the interleaved runs; transformers always runs eager. Printed ratios
(tokens/s, same dtype on both sides): `tandem_eager_over_transformers_eager` (K=0) and, with
--compile, `tandem_compiled_over_transformers_eager` (K=0).

Config mapping (Tandem `ModelConfig` -> `transformers.Qwen3MoeConfig`):
  vocab_size -> vocab_size; hidden_size -> hidden_size; num_layers -> num_hidden_layers;
  num_heads / num_kv_heads / head_dim -> num_attention_heads / num_key_value_heads / head_dim;
  moe_intermediate_size -> moe_intermediate_size (intermediate_size is unused: every layer is MoE,
  first_k_dense=0 <-> decoder_sparse_step=1, mlp_only_layers=[]); num_experts -> num_experts;
  top_k -> num_experts_per_tok; router_score=softmax + norm_topk_prob <-> Qwen3-MoE's routing;
  num_shared_experts=0 (Qwen3-MoE has none); qk_norm=True (Qwen3); balance=none <->
  output_router_logits=False (no aux loss on either side); rope_theta, rms_norm_eps,
  max_seq_len -> max_position_embeddings; untied embeddings on both; SDPA attention on both.
K>0 adds Tandem's MTP module (K looped steps, 1 layer); transformers has no MTP and runs K=0.

`--head-backward` sets Tandem's mtp.loss_head_backward (default: Tandem's default). `fused` computes
the head's gradients in forward (no logits recompute, like transformers' single full-logits
cross-entropy); `recompute` pays one more head matmul and softmax per chunk for its bounded memory.
`--both-head-backwards` runs the other mode too (K=0 and K=K, interleaved) and prints
`head_backward_k<k>: fused_over_recompute=<tokens/s ratio>`.

    python bench/throughput.py [--steps N] [--k 3] [--dtype fp32|bf16] [--compile]
                               [--head-backward recompute|fused] [--both-head-backwards] [--layers 4
                               ...]
ends with: tandem_over_transformers=<tokens/s ratio at K=0, Tandem as configured (compiled with
--compile, else eager; --head-backward) over eager transformers, both in --dtype>
"""

from __future__ import annotations

import argparse
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
from tandem.trainer.parallel.compile import apply_compile  # noqa: E402
from tandem.trainer.recipe import load_config  # noqa: E402


def tandem_config(a) -> ModelConfig:
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                       num_heads=a.heads,
                       num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                       intermediate_size=a.moe_width,
                       moe_intermediate_size=a.moe_width, num_experts=a.experts, top_k=a.top_k,
                       num_shared_experts=0, first_k_dense=0, router_score="softmax",
                       norm_topk_prob=True,
                       balance="none", qk_norm=True, rope_theta=10000.0, rms_norm_eps=1e-6,
                       max_seq_len=a.seq_len + 1, expert_matmul=a.expert_matmul)


def hf_config(cfg: ModelConfig):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                          num_hidden_layers=cfg.num_layers,
                          num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                          head_dim=cfg.resolved_head_dim, intermediate_size=cfg.intermediate_size,
                          moe_intermediate_size=cfg.moe_intermediate_size,
                          num_experts=cfg.num_experts,
                          num_experts_per_tok=cfg.top_k, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], output_router_logits=False, rope_theta=cfg.rope_theta,
                          rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_seq_len,
                          tie_word_embeddings=False, attention_bias=False, use_cache=False,
                          attn_implementation="sdpa")


class TandemRunner:
    def __init__(self, cfg: ModelConfig, k: int, tokens: torch.Tensor, bf16: bool,
                 compiled: bool = False, head_backward: str = MTPConfig.loss_head_backward):
        torch.manual_seed(0)
        self.mtp = MTPConfig(num_steps=k, num_layers=1, style="looped",
                             loss_head_backward=head_backward)
        self.model = TandemModel(cfg, self.mtp).train()
        if compiled:
            apply_compile(self.model)
        self.optimizer = build_optimizer(self.model, load_config(None, []).train)
        self.tokens, self.bf16 = tokens, bf16

    def step(self) -> None:
        one_batch_forward_backward(self.model, self.tokens, depth_coefficients(self.mtp, 0),
                                   lambda: torch.autocast("cpu", dtype=torch.bfloat16,
                                                          enabled=self.bf16))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class HFRunner:
    def __init__(self, cfg: ModelConfig, tokens: torch.Tensor, bf16: bool):
        from transformers import Qwen3MoeForCausalLM

        torch.manual_seed(0)
        self.model = Qwen3MoeForCausalLM(hf_config(cfg)).train()
        t = load_config(None, []).train
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr,
                                           betas=(t.beta1, t.beta2), eps=t.eps,
                                           weight_decay=t.weight_decay, fused=True)
        self.tokens, self.bf16 = tokens, bf16

    def step(self) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(input_ids=self.tokens[:, :-1],
                              labels=self.tokens[:, :-1].clone()).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(runner) -> float:
    t0 = time.perf_counter()
    runner.step()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=3, help="MTP steps of the second Tandem model (>= 1)")
    p.add_argument("--steps", type=int, default=8,
                   help="timed repetitions per model (after one warm-up)")
    p.add_argument("--expert-matmul", default="auto", choices=["auto", "grouped", "loop"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: CPU autocast on both sides")
    p.add_argument("--compile", action="store_true",
                   help="also run Tandem K=0 with its blocks compiled")
    p.add_argument("--head-backward", default=MTPConfig.loss_head_backward,
                   choices=["recompute", "fused"],
                   help="Tandem's mtp.loss_head_backward (default: Tandem's default, "
                        f"{MTPConfig.loss_head_backward}; fused: head gradients in forward, no "
                        "logits recompute)")
    p.add_argument("--both-head-backwards", action="store_true",
                   help="also run Tandem K=0 and K=K with the other head backward, interleaved, "
                        "and print "
                        "the fused-over-recompute step-time ratios (which one should be the "
                        "default)")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler tables of one step of each")
    a = p.parse_args()
    if a.k < 1:
        raise SystemExit(f"--k={a.k}: the second Tandem model needs at least one MTP step (K=0 is "
                         "always run)")

    cfg = tandem_config(a)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    bf16 = a.dtype == "bf16"
    hb = a.head_backward
    runners = {"tandem_k0": TandemRunner(cfg, 0, tokens, bf16, head_backward=hb),
               f"tandem_k{a.k}": TandemRunner(cfg, a.k, tokens, bf16, head_backward=hb),
               "transformers": HFRunner(cfg, tokens, bf16)}
    other = "recompute" if hb == "fused" else "fused"
    if a.both_head_backwards:
        runners[f"tandem_k0_{other}"] = TandemRunner(cfg, 0, tokens, bf16, head_backward=other)
        runners[f"tandem_k{a.k}_{other}"] = TandemRunner(cfg, a.k, tokens, bf16,
                                                         head_backward=other)
    if a.compile:
        runners["tandem_k0_compiled"] = TandemRunner(cfg, 0, tokens, bf16, compiled=True,
                                                     head_backward=hb)
    n_t = sum(p.numel() for p in runners["tandem_k0"].model.parameters())
    n_h = sum(p.numel() for p in runners["transformers"].model.parameters())
    print(f"config: layers={a.layers} hidden={a.hidden} heads={a.heads}/{a.kv_heads} "
          f"experts={a.experts} "
          f"top{a.top_k} moe_width={a.moe_width} vocab={a.vocab} batch={a.batch}x{a.seq_len}; "
          "parameters "
          f"tandem {n_t / 1e6:.2f}M, transformers {n_h / 1e6:.2f}M; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"{a.dtype}{', tandem compiled too' if a.compile else ''}", flush=True)
    if n_t != n_h:
        raise SystemExit(f"config mapping broken: {n_t} vs {n_h} parameters")
    for r in runners.values():
        r.step()  # warm-up (and, compiled, the compilation: the second step recompiles once more)
        r.step()
    times = {name: [] for name in runners}
    for _ in range(a.steps):
        for name, r in runners.items():
            times[name].append(timed(r))
    tokens_per_step = a.batch * a.seq_len
    tps = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name}: {statistics.median(t) * 1e3:.0f} ms/step (min {min(t) * 1e3:.0f}, max "
              f"{max(t) * 1e3:.0f}), "
              f"{tps[name]:.0f} tokens/s", flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, r in runners.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                r.step()
            print(f"--- {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total",
                                                              row_limit=25))
    # on a shared machine the fastest repetitions are the least disturbed: their ratio as a
    # cross-check
    fastest = {name: min(t) for name, t in times.items()}
    print("fastest-step ratios: "
          + " ".join(f"{name}/transformers={fastest['transformers'] / fastest[name]:.3f}"
                                             for name in runners if name != "transformers"))
    if a.both_head_backwards:
        for k in (0, a.k):
            mine, theirs = tps[f"tandem_k{k}"], tps[f"tandem_k{k}_{other}"]
            fused, recompute = (mine, theirs) if hb == "fused" else (theirs, mine)
            print(f"head_backward_k{k}: fused_over_recompute={fused / recompute:.3f} (tokens/s, "
                  f"{a.dtype})")
    ratio_k = tps[f"tandem_k{a.k}"] / tps["transformers"]
    print(f"tandem_k{a.k}_over_transformers_k0={ratio_k:.3f}")
    # what the step-time ratio of K over 0 compares with: the FLOPs each step executes
    k_run, k0 = runners[f"tandem_k{a.k}"], runners["tandem_k0"]
    flops = [hardware_flops_per_token(cfg, r.mtp, a.seq_len) for r in (k_run, k0)]
    print(f"tandem_k{a.k}_over_k0: step_time={tps['tandem_k0'] / tps[f'tandem_k{a.k}']:.3f} "
          f"flop_ratio={flops[0] / flops[1]:.3f}")
    eager = tps["tandem_k0"] / tps["transformers"]
    print(f"tandem_eager_over_transformers_eager={eager:.3f} ({a.dtype})")
    if a.compile:
        compiled = tps["tandem_k0_compiled"] / tps["transformers"]
        print(f"tandem_compiled_over_transformers_eager={compiled:.3f} ({a.dtype})")
    print(f"tandem_over_transformers={compiled if a.compile else eager:.3f}")


if __name__ == "__main__":
    main()
