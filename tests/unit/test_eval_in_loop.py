"""The in-loop evaluator: eval/* keys logged, and training is bit-identical with and without it."""

import json
import re

import numpy as np
import pytest
import torch

from tests.conftest import DEBUG_MODEL, QUIET, TINY_DATA


def _train(run_dir, cache_dir, interval, steps=4, extra=()):
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    overrides = [f"run.dir={run_dir}", f"train.max_steps={steps}", *DEBUG_MODEL, *TINY_DATA,
                 f"eval.interval={interval}", "eval.num_prompts=3", "eval.prompt_len=8",
                 "eval.max_new_tokens=6", "eval.batch_size=2", "eval.loss_batches=1", *QUIET,
                 f"data.cache_dir={cache_dir}", "checkpoint.save_final=false",
                 # the recomputing head executes more FLOPs than the model's, so `hfu` and `mfu`
                 # differ
                 "mtp.loss_head_backward=recompute", *extra]
    train(load_config("recipes/tiny.yaml", overrides))
    return [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]


def _losses(records):
    keys = ("loss", "loss/main", "loss/mtp_1", "loss/mtp_2", "loss/mtp_3", "grad_norm")
    return [(r["step"],) + tuple(r[k] for k in keys) for r in records]


def test_evaluator_logs_eval_keys_and_leaves_training_unchanged(tmp_path, corpus_cache,
                                                               monkeypatch):
    # the step's memory peak is read after its evaluation (whose decoding caches a GPU peak holds;
    # it was read before): here the peak reads how many evaluations have run
    from tandem.eval.in_loop import InLoopEvaluator
    from tandem.trainer.parallel.device import Device

    runs, real_run = [], InLoopEvaluator.run
    monkeypatch.setattr(InLoopEvaluator, "run", lambda self, step: runs.append(step)
                        or real_run(self, step))
    monkeypatch.setattr(Device, "peak_memory_gb", lambda self: float(len(runs)))
    with_eval = _train(tmp_path / "a", corpus_cache, interval=2)
    assert [r["mem/peak_gb"] for r in with_eval] == [0.0, 1.0, 1.0, 2.0]
    monkeypatch.undo()
    # a made-up CPU peak (1 GFLOP/s) so the run also logs `mfu` and `hfu` (checked below)
    without = _train(tmp_path / "b", corpus_cache, interval=0, extra=["logging.peak_tflops=0.001"])
    assert _losses(with_eval) == _losses(without)  # exact equality, not allclose
    evals = [r for r in with_eval if "eval/acceptance_length" in r]
    assert [r["step"] for r in evals] == [2, 4]
    expected = {"eval/loss/main", "eval/acceptance_length", "eval/draft_acceptance_rate",
                "eval/speedup", "eval/seconds",
                "eval/decode_tokens_per_s/spec", "eval/decode_tokens_per_s/ar",
                "eval/speedup_predicted"}
    expected |= {"eval/distinct_2", "eval/distinct_4", "eval/T1/acceptance_length",
                 "eval/T1/draft_acceptance_rate"}
    for k in range(1, 4):
        expected |= {f"eval/loss/mtp_{k}", f"eval/accept_rate/pos_{k}", f"eval/tf_acc/mtp_{k}",
                     f"eval/T1/accept_rate/pos_{k}"}
    assert expected <= set(evals[0])
    # every acceptance figure, under every prefix, has its 95% interval beside it; no other key has
    # one
    figures = {k for k in evals[0]
               if re.search(r"(acceptance_length|acceptance_rate|accept_rate/pos_\d+)$", k)}
    assert {"eval/acceptance_length", "eval/T1/accept_rate/pos_3",
            "eval/T1/block/draft_acceptance_rate"} <= figures
    assert {k for k in evals[0] if k.endswith(("_lo95", "_hi95"))} == {
        f"{k}_{e}95" for k in figures for e in ("lo", "hi")
    }
    assert all(r[f"{k}_lo95"] <= r[k] <= r[f"{k}_hi95"] for r in evals for k in figures)
    # spec side only
    assert not any(k.startswith("eval/T1/") and ("speed" in k or "tokens_per_s" in k)
                   for k in evals[0])
    # the figures' values: test_block_verify's evaluator test compares them with evaluate_decoding
    assert evals[0]["eval/identical_to_autoregressive"] == 1.0
    assert not any(k.startswith("eval/") for r in without for k in r)
    samples = [json.loads(line) for line in open(tmp_path / "a" / "eval_samples.jsonl")]
    # eval.num_samples_logged=4 > 3 prompts
    assert [s["step"] for s in samples] == [2, 2, 2, 4, 4, 4]
    first = samples[0]
    assert isinstance(first["prompt"], str) and isinstance(first["continuation"], str)
    assert isinstance(first["T1/continuation"], str) and len(first["output_ids"]) == 6
    assert {"acceptance_length", "T1/acceptance_length"} <= set(first)
    samples = tmp_path / "b" / "eval_samples.jsonl"
    assert not samples.exists() or not open(samples).read()
    # utilisation: model FLOPs (3x the forward, heads included) and hardware FLOPs (the heads'
    # recomputed logits too) per token x tokens/s over the peak; no peak known on a CPU: neither key
    from tandem.trainer.cost import hardware_flops_per_token, training_flops_per_token
    from tandem.trainer.recipe import load_config

    cfg = load_config(str(tmp_path / "b" / "config.yaml"), [])
    model = training_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len)
    hardware = hardware_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len,
                                        cfg.train.activation_checkpointing)
    assert hardware > model
    for r in without:
        assert r["mfu"] == pytest.approx(model * r["tokens_per_s"] / 1e9, rel=1e-9)
        assert r["hfu"] == pytest.approx(hardware * r["tokens_per_s"] / 1e9, rel=1e-9)
    assert not any("mfu" in r or "hfu" in r for r in with_eval)


def test_samples_file_truncated_on_resume(tmp_path):
    from tandem.trainer.metrics import MetricsLogger
    from tandem.trainer.recipe import load_config

    cfg = load_config(None,
                      [f"run.dir={tmp_path}", "logging.wandb=false", "logging.progress=false"])
    log = MetricsLogger(cfg, True, 0, 10)
    for step in (2, 4, 6):
        log.log_samples(step, [{"prompt": "a", "continuation": "b"},
                               {"prompt": "c", "continuation": "d"}])
    log.close()
    MetricsLogger(cfg, True, 4, 10).close()  # resumed from the step-4 checkpoint
    assert [json.loads(line)["step"] for line in open(tmp_path / "eval_samples.jsonl")] == [2, 2, 4,
                                                                                            4]


def test_run_restores_rng_mode_weights_and_router_loads(tmp_path, corpus_cache, monkeypatch):
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_run

    overrides = [f"run.dir={tmp_path}", "train.max_steps=1", *DEBUG_MODEL, *TINY_DATA,
                 "eval.interval=1",
                 "eval.num_prompts=2", "eval.prompt_len=8", "eval.max_new_tokens=4",
                 "eval.temperatures=[0.7]",
                 "eval.loss_batches=1", *QUIET, f"data.cache_dir={corpus_cache}"]
    trainer = build_run(load_config("recipes/tiny.yaml", overrides))
    model, ev = trainer.model, trainer.evaluator
    model.train()
    routers = [m.router for m in model.moe_layers()]
    for i, r in enumerate(routers):
        r.tokens_per_expert.fill_(float(i + 1))
    loads = [r.tokens_per_expert.clone() for r in routers]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    # Control, read from outside at the end of the evaluation's forwards (before the restore):
    # they do count routed tokens, so the restore is what keeps training's loads unchanged
    evaluate, during = ev._evaluate, []

    def evaluate_and_read_loads(m, forced):
        out = evaluate(m, forced)
        during.extend(r.tokens_per_expert.clone() for r in routers)
        return out

    monkeypatch.setattr(ev, "_evaluate", evaluate_and_read_loads)
    out = ev.run(1)
    assert not all(torch.equal(now, load) for now, load in zip(during, loads))
    # sampling ran too
    assert "eval/T0.7/acceptance_length" in out and "eval/T1/acceptance_length" not in out
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(r.tokens_per_expert, load) for r, load in zip(routers, loads))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())


def test_no_mtp_module_no_evaluator_and_one_line_says_so(capsys):
    """At mtp.num_steps=0 the evaluator has no drafter to measure: no evaluator, and the run says
    why its eval.interval writes no eval/* records."""
    from tandem.trainer.parallel import ParallelState
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_evaluator

    cfg = load_config(None, ["mtp.num_steps=0", "eval.interval=5"])
    pstate = ParallelState(device=resolve_device("cpu"))
    assert build_evaluator(cfg, None, None, None, pstate) is None
    assert "eval.interval=5 with mtp.num_steps=0" in capsys.readouterr().err


class _Windows:
    """Validation windows of 8 tokens with their document ids (EOD = 0): by default three."""

    def __init__(self, rows=((5, 6, 0, 7, 8, 9, 10, 11, 12), (13, 14, 15, 16, 17, 18, 19, 20, 21),
                             (22, 0, 23, 0, 24, 25, 26, 27, 28))):
        self.rows = [list(r) for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = torch.tensor(self.rows[i])
        eod = (row == 0).long()
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": torch.ones(8),
                "doc_ids": torch.cumsum(eod, 0) - eod}


def test_validation_inputs_keep_to_one_document_and_read_each_window_once():
    """With data.document_mask a prompt is its window's last document within prompt_len tokens
    (the decoder read [5, 6, EOD, 7, 8] as one sequence); a split of 3 windows asked for 8 prompts
    and 4 loss batches of 2 gives each window once, and says so (a repeated window counted twice
    and narrowed the intervals over prompts)."""
    from tandem.eval.metrics import validation_inputs

    prompts, batches, note = validation_inputs(_Windows(), 8, 5, 4, 2, document_mask=True)
    assert prompts == [[7, 8], [13, 14, 15, 16, 17], [24]]
    assert [b["tokens"][:, 0].tolist() for b in batches] == [[5, 13], [22]]
    assert note == ("the validation split holds 3 windows: 3 prompts of eval.num_prompts=8 and 2 "
                    "loss batches of eval.loss_batches=4, each window once")
    prompts, _, note = validation_inputs(_Windows(), 2, 5, 1, 2, document_mask=False)
    assert prompts == [[5, 6, 0, 7, 8], [13, 14, 15, 16, 17]] and note == ""


def test_validation_prompts_of_chat_records_are_their_prompts():
    """A split of chat records (data.source=jsonl) is packed into windows that start mid-record,
    and whose last ones hold nothing but a response: the evaluator decoded from those, so a
    self-distilled drafter continued the trunk's own response (its acceptance inflated), and one
    held-out record gave three 'prompts'. Each record's prompt is a prompt, its last prompt_len
    tokens, once."""
    from tandem.data_pipeline.chat_dataset import ChatWindows
    from tandem.eval.metrics import validation_inputs

    records = [("a.jsonl:1", np.array([5, 6, 7, 8, 9, 10, 11, 0]),
                np.array([0, 0, 0, 1, 1, 1, 1, 1])),
               ("a.jsonl:2", np.array([12, 13, 14, 15, 0]), np.array([0, 0, 1, 1, 1])),
               ("a.jsonl:3", np.array([16, 17, 0]), np.array([0, 0, 0]))]  # cut off: no response
    windows = ChatWindows(records, seq_len=4, packing="pack", eod_id=0)
    assert len(windows) == 4 and windows[1]["tokens"].tolist() == [9, 10, 11, 0]
    prompts, _, note = validation_inputs(windows, 8, 2, 1, 2, document_mask=True, eod_id=0)
    assert prompts == [[6, 7], [12, 13], [16, 17]]
    assert note == "the validation split holds 3 records: 3 prompts of eval.num_prompts=8, each " \
                   "record once"


@pytest.mark.parametrize("document_mask", [True, False])
def test_validation_prompts_are_records_not_their_padding(document_mask):
    """jsonl records padded to their window (data.packing=pad), and a packed split's padded last
    window: every prompt was the EOD padding after a record shorter than eval.prompt_len (or,
    without document_mask, ended in it); a prompt is the record's text now."""
    from tandem.data_pipeline.chat_dataset import ChatWindows
    from tandem.eval.metrics import validation_inputs

    texts = [list(range(10, 20)), list(range(30, 45)), list(range(50, 62))]
    records = [(f"r{i}", np.array(t + [0]), np.ones(len(t) + 1, dtype=np.uint8))
               for i, t in enumerate(texts)]
    padded = ChatWindows(records, seq_len=32, packing="pad", eod_id=0)
    prompts = validation_inputs(padded, 3, 24, 1, 1, document_mask, eod_id=0)[0]
    assert prompts == texts
    # packed, a window's second record starts mid-window: the records' texts all the same
    packed = ChatWindows(records, seq_len=24, packing="pack", eod_id=0)
    prompts = validation_inputs(packed, 3, 12, 1, 1, document_mask, eod_id=0)[0]
    assert prompts == [texts[0], texts[1][:12], texts[2]]


PADDED = [[5, 6, 7, 0, 0, 0, 0, 0, 0], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
"""Two windows without chat records, the first ending in EOD (0) padding."""


@pytest.mark.parametrize("document_mask", [False, True])
def test_window_prompts_leave_out_the_trailing_eod_padding(document_mask):
    from tandem.eval.metrics import validation_inputs
    prompts = validation_inputs(_Windows(PADDED), 2, 8, 1, 2, document_mask, eod_id=0)[0]
    assert prompts == [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("in_layout", [False, True])
def test_the_evaluator_says_when_its_teacher_forced_windows_run_whole_under_cp(in_layout, capsys):
    """Under pp x cp the pipeline's driver runs the teacher-forced windows whole (cp times a
    training forward's rows, which `--check` does not size): the evaluator says so at start, with
    the way out; without a pipeline they stay split and nothing is said."""
    import types

    from tandem.eval.in_loop import InLoopEvaluator
    from tandem.trainer.recipe import load_config

    cfg = load_config(None, ["parallel.cp=2", "parallel.pp=2", "data.seq_len=8",
                             "eval.loss_batches=1", "train.micro_batch_size=2", "eval.prompt_len=4",
                             "eval.num_prompts=2"])
    pstate = types.SimpleNamespace(world_size=4, is_main=True)
    InLoopEvaluator(cfg, None, _Windows(PADDED), None, pstate,
                    types.SimpleNamespace(forces_in_layout=in_layout))
    said = capsys.readouterr().err
    if in_layout:
        assert "run whole" not in said
    else:
        assert ("eval: under pp x cp the teacher-forced windows run whole: a forward of 1 x 2 "
                "windows of data.seq_len=8 tokens") in said and "eval.loss_batches=0" in said
