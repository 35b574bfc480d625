"""The evaluator the training loop calls every `eval.interval` steps.

It runs real speculative decoding (and plain autoregressive decoding for the speed comparison) on a
fixed set of held-out prompts (the first `eval.prompt_len` tokens of the first `eval.num_prompts`
validation samples) plus teacher-forced validation losses/accuracies, and returns `eval/*` metrics.

Evaluation never changes training: it runs under no_grad/inference mode in eval mode (the previous
mode is restored), forks the global RNG (sampling draws from its own seeded generator), and restores
the routers' `tokens_per_expert` load counters (any forward increments them, and the aux-free bias
update of the next step reads them).

Parallel layouts: every rank calls `run()` and executes the same decode (its control flow depends
only on logits, identical across ranks when `model.logits` returns full-vocabulary logits); only
rank 0's numbers are logged. Under pipeline parallelism (`pstate.extras["pipeline"]`) no rank holds
the whole model, and under sequence parallelism the TP regions expect sequence-split activations that
single decode steps cannot provide; in both cases the evaluator is skipped with a one-time message and
nothing is logged (never a wrong number).
"""

from __future__ import annotations

import sys
from typing import Dict, List

import torch

from tandem.trainer.parallel.data import gathered_for_inference

from .metrics import evaluate_decoding, teacher_forced
from .spec_decode import unwrap

RESTORE_ROUTER_LOADS = True
"""Tests switch this off to show that the restore is what keeps training unchanged."""

PIPELINE_MESSAGE = "eval: speculative decoding under pipeline parallelism is not supported; skipped"
SEQUENCE_PARALLEL_MESSAGE = ("eval: speculative decoding under sequence parallelism is not supported "
                             "(decode steps are not split along the sequence); skipped")


class InLoopEvaluator:
    def __init__(self, cfg, model, valid_ds, tokenizer, pstate):
        self.cfg, self.model, self.valid_ds, self.tokenizer, self.pstate = cfg, model, valid_ds, tokenizer, pstate
        e = cfg.eval
        self.num_steps = e.num_steps or cfg.mtp.num_steps
        self.eos_id = getattr(tokenizer, "eod_id", None)
        self._warned = False
        self.prompts: List[List[int]] = []
        self.loss_batches: List[Dict[str, torch.Tensor]] = []
        if valid_ds is not None:
            from tandem.data_pipeline.dataset import get_batch

            mb = cfg.train.micro_batch_size
            for i in range(e.loss_batches):
                self.loss_batches.append(get_batch(valid_ds, list(range(i * mb, (i + 1) * mb))))
            prompt_len = max(1, min(e.prompt_len, cfg.data.seq_len))
            tokens = get_batch(valid_ds, list(range(e.num_prompts)))["tokens"]
            self.prompts = [row[:prompt_len].tolist() for row in tokens]

    def _say_once(self, message: str) -> None:
        if not self._warned and self.pstate.is_main:
            print(message, file=sys.stderr)
        self._warned = True

    def run(self, step: int) -> Dict[str, float]:
        if "pipeline" in self.pstate.extras:
            self._say_once(PIPELINE_MESSAGE)
            return {}
        if self.pstate.extras.get("sequence_parallel"):
            self._say_once(SEQUENCE_PARALLEL_MESSAGE)
            return {}
        if not self.prompts:
            self._say_once("eval: no validation split (data gives validation no samples); evaluator skipped")
            return {}
        model = self.model
        base = unwrap(model)
        device = base.embed_tokens.weight.device
        routers = [m.router for m in base.moe_layers()] if hasattr(base, "moe_layers") else []
        saved_loads = [r.tokens_per_expert.clone() for r in routers]
        was_training = model.training
        devices = [] if device.type == "cpu" else [device]
        e = self.cfg.eval
        try:
            with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad(), \
                    gathered_for_inference(model):
                model.eval()
                out = teacher_forced(model, self.loss_batches, device)
                dec, _, _ = evaluate_decoding(
                    model, self.prompts, num_steps=self.num_steps, max_new_tokens=e.max_new_tokens,
                    batch_size=e.batch_size, eos_id=self.eos_id, temperature=e.temperature, top_p=e.top_p,
                    seed=self.cfg.train.seed)
                out.update(dec)
        finally:
            model.train(was_training)
            with torch.no_grad():
                for r, saved in zip(routers, saved_loads if RESTORE_ROUTER_LOADS else []):
                    r.tokens_per_expert.copy_(saved)
        keep = {k: float(v) for k, v in out.items() if not k.startswith("time_per_")}
        return {f"eval/{k}": v for k, v in keep.items()}
