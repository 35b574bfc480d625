"""The in-loop evaluator on a parallel layout: speculative decoding of fixed prompts with weights
that make the MTP drafts mostly right (tests/eval_helpers.make_agreeing on the plain model, before
it is sharded), so acceptance is exercised. Run as a module on N ranks (`-m
tests.distributed.eval_worker OUT LAYOUT...`, tests/processes.py; layouts as in worker.py), or
`evaluate("single")` in one process for the reference. Rank 0 writes `OUT/<layout>.pt`: the eval/*
figures and the speculative greedy tokens of every prompt.

Every rank writes its Python stack (every thread) to `OUT/stacks/rank<r>.txt` if it dies of a fatal
signal (SIGSEGV, SIGABRT, ...) or is stopped by the launcher's SIGTERM after another rank died, so a
crash shows where each rank was (test_eval_layouts.crash_report prints the files).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from typing import List

import torch

from tests import processes
from tests.distributed import worker

MAX_NEW_TOKENS = 10
"""Tokens each prompt decodes: several rounds of K=2 drafts with the agreeing weights, every round
a rollback with the history-sensitive ones. Decode steps are most of a layout's seconds (8 tokens
instead of 14 took the 4-rank cp=2 x tp=2 layout from 28 s to 18 s), but the history weights need
length: a follower stage that drops the padded prefill's row_end changes the third prompt's tokens
from the 8th on (measured at pp=2, the other prompts unchanged over 14), so 10 leaves a margin."""
# 5 prompts in batches of 2: three batches, so two replicas split them unevenly (one pads a slot)
EVAL = ["eval.num_prompts=5", "eval.batch_size=2", f"eval.max_new_tokens={MAX_NEW_TOKENS}",
        "eval.loss_batches=1", "eval.interval=1"]
# Qwen4-Exp (worker.PRESETS["qwen4"]): prompts of 40 and 41 tokens batched with short ones, so the
# prefill is longer than the decoder's recurrent rings allow a stepwise forward (ring 4K+32 = 40
# slots minus the conv window): Gated DeltaNet takes its chunked form and every stage needs the
# short rows' row_end. Positions reach 41 + 10 + the draft margin, near the base's max_seq_len 64.
QWEN4_EVAL = ["model.max_seq_len=96"]
QWEN4_PROMPT_LENS = (40, 5, 6, 41, 7)
HISTORY = "weights=history"
"""Layout item (not a config key): the Qwen4-Exp weights of `make_history_sensitive` instead of the
agreeing ones, so that a wrong recurrent state on any stage changes the tokens."""
DRAFTER_CONTEXT = "weights=drafter_context"
"""Layout item: the agreeing weights with an MTP layer that also reads the hidden state and whose
attention over its cache counts (`make_drafter_context`), so the two drafting conventions draft
differently (the agreeing drafts follow the token alone, and are alike under both)."""


@torch.no_grad()
def make_drafter_context(model):
    """The MTP layer's combine passes the hidden state beside the embedding, and its attention
    output is 1000x the agreeing weights': greedy acceptance 1.18 drafting as served, 1.22 as
    trained (measured)."""
    H = model.cfg.hidden_size
    for layer in model.mtp.layers:
        hidden = slice(H, 2 * H) if layer.emb_first else slice(0, H)
        layer.eh_proj.weight[:, hidden] += torch.eye(H)
    for name, p in model.mtp.named_parameters():
        if name.endswith("o_proj.weight"):
            p.mul_(1000.0)
    return model


def is_qwen4(layout: str) -> bool:
    return "preset.qwen4=1" in layout.split(",")


def prompts(lens=(4, 5, 6, 7, 8)) -> List[List[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, worker.VOCAB, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def load_full_weights(model, full_state: dict):
    """Copy one-process weights into this rank's shards (TP/EP DTensors, FSDP shards, pipeline
    stages)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        src = full_state[name].to(p.dtype)
        if isinstance(p, DTensor):
            src = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(src)
    return model


@torch.no_grad()
def make_history_sensitive(model, seed: int):
    """Qwen4-Exp weights whose greedy tokens depend on the distant past: Gated DeltaNet's memory
    decays slowly (A = exp(-3): about 6% per token), every matrix is 10x its initial scale, and the
    embedding and head are well spread. Dropping the padded prefill's row_end on a stage (the short
    rows' state restarting from zero) changes the tokens here, where the agreeing weights hide it
    (measured: the hidden state moves by 1e-4 of its size). Drafts are rarely accepted (acceptance
    length ~1.05)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.fill_(-3.0)
        elif p.dim() >= 2 and not name.startswith(("embed_tokens", "lm_head")):
            p.mul_(10.0)
    model.embed_tokens.weight.copy_(torch.randn(model.embed_tokens.weight.shape, generator=g))
    model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g))
    return model


def evaluate(layout: str) -> dict:
    from tandem.eval.in_loop import InLoopEvaluator
    from tandem.trainer.parallel import ParallelState, init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.parallel.pipeline_decode import parallel_decoding
    from tandem.trainer.run import build_model
    from tests.eval_helpers import make_agreeing

    q4, history = is_qwen4(layout), HISTORY in layout.split(",")
    drafter_context = DRAFTER_CONTEXT in layout.split(",")
    items = [kv for kv in layout.split(",") if kv not in (HISTORY, DRAFTER_CONTEXT)]
    cfg = worker.make_cfg(",".join(items + EVAL + (QWEN4_EVAL if q4 else [])), worker.GRAD_ACCUM)
    device = resolve_device("cpu")
    single = ParallelState(device=device)
    pstate = single if layout.split(",")[0] == "single" else init_parallel(cfg, device)
    if history:
        full = make_history_sensitive(build_model(cfg, single), seed=1)
    else:
        full = make_agreeing(build_model(cfg, single), 0.05, seed=1)  # the one-process weights
        if drafter_context:
            make_drafter_context(full)
    model = full if pstate is single else load_full_weights(build_model(cfg, pstate),
                                                            full.state_dict())
    model.train()
    ev = InLoopEvaluator(cfg, model, None, None, pstate, parallel_decoding(cfg, model, pstate))
    ev.prompts = prompts(QWEN4_PROMPT_LENS) if q4 else prompts()
    ev.loss_batches = worker.rank_micro_batches(0, 0, 1, 1)
    # the most token rows one embedding lookup of this rank took (None without the embedding): the
    # teacher-forced windows' share, which context parallelism must keep split
    rows: List[int] = []
    embed = getattr(model, "embed_tokens", None)
    hook = (embed.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[1]))
            if embed is not None else None)
    out = ev.run(1)
    if hook is not None:
        hook.remove()
    return {"metrics": out, "outputs": ev.last_outputs, "samples": ev.last_samples,
            "widest_lookup": max(rows, default=None)}


def record_stacks(out_dir: str):
    """This rank's stack file (module docstring): faulthandler on fatal signals and on SIGTERM,
    which torchrun sends the surviving ranks when one fails (chained: the rank still terminates)."""
    stacks = os.path.join(out_dir, "stacks")
    os.makedirs(stacks, exist_ok=True)
    f = open(os.path.join(stacks, f"rank{os.environ.get('RANK', '0')}.txt"), "w")
    faulthandler.enable(file=f, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=f, all_threads=True, chain=True)
    processes.native_stacks_on_fatal_signal()  # native stacks to stderr, then faulthandler's
    return f  # kept open for the process's lifetime: faulthandler writes to its descriptor


def main(argv: List[str]) -> int:
    import torch.distributed as dist

    out_dir, layouts = argv[0], argv[1:]
    stack_file = record_stacks(out_dir)
    torch.set_num_threads(1)
    for layout in layouts:
        stack_file.write(f"layout {layout}\n")  # which one a stack below belongs to
        stack_file.flush()
        start = time.perf_counter()
        result = evaluate(layout)
        result["seconds"] = time.perf_counter() - start  # what each layout costs the shared launch
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{layout}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
