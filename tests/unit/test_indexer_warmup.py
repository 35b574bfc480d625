"""model.indexer_warmup: `joint` trains the whole model under dense attention during the QSA warm-up
(the indexer by its KL alone), `indexer_only` moves nothing but the indexers; `auto` picks
indexer_only only when model.init_from brings a trained trunk."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tandem.eval.metrics import teacher_forced
from tandem.models.config import ModelConfig
from tandem.models.qsa import IndexedAttention
from tandem.trainer.loop import micro_batches, run_training
from tandem.trainer.loss import depth_coefficients
from tandem.trainer.recipe import load_config
from tandem.trainer.run import build_run

# A Qwen4-Exp model in miniature whose 4 steps all fall in the dense warm-up.
QWEN4 = ["model.full_attention_interval=2", "model.hc_count=4", "model.hc_lowrank=8",
         "model.head_dim=16",
         "model.partial_rotary_factor=0.5", "model.linear_num_key_heads=2",
         "model.linear_num_value_heads=2",
         "model.linear_key_head_dim=16", "model.linear_value_head_dim=16", "model.indexer_heads=2",
         "model.indexer_head_dim=16", "model.indexer_budget=8", "model.indexer_compress_ratio=4",
         "model.indexer_warmup_steps=10", "train.max_steps=4", "train.lr=1e-2",
         "checkpoint.interval=0"]


def test_auto_resolves_from_init_from():
    assert ModelConfig().resolved_indexer_warmup == "joint"
    assert ModelConfig(init_from="/some/trunk").resolved_indexer_warmup == "indexer_only"
    assert ModelConfig(init_from="/some/trunk",
                       indexer_warmup="joint").resolved_indexer_warmup == "joint"
    with pytest.raises(ValueError, match="model.indexer_warmup"):
        load_config(None, QWEN4 + ["model.indexer_warmup=frozen"])


def _train(overrides, mode):
    """(the parameters and buffers that moved, the first batch's main loss before and after the 4
    steps, the logged indexer losses)."""
    cfg = load_config(None, overrides + QWEN4 + [f"model.indexer_warmup={mode}"])
    tr = build_run(cfg)
    # the MoE routers' aux-free biases are buffers: they decide the routing, so they count too
    state = lambda: dict(tr.model.named_parameters(), **dict(tr.model.named_buffers()))  # noqa: E731
    start = {n: p.detach().clone() for n, p in state().items()}
    # one batch measured before and after: the logged losses are of 4 different batches, whose
    # differences swamp 4 steps' progress on another corpus (another Python's standard library)
    # (in eval mode: a training-mode forward would count its tokens in the routers' loads)
    first = micro_batches(tr, 0)
    before = teacher_forced(tr.model.eval(), first)["loss/main"]
    tr.model.train()
    run_training(tr)
    moved = {n for n, p in state().items() if not torch.equal(p.detach(), start[n])}
    after = teacher_forced(tr.model.eval(), first)["loss/main"]
    with open(os.path.join(cfg.run.dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"loss/main"' in line]
    return moved, (before, after), [r.get("loss/indexer") for r in records]


def test_joint_trains_everything_and_indexer_only_only_the_indexers(tiny_overrides, tmp_path):
    moved, (before, after), indexer = _train(tiny_overrides, "joint")
    assert any(".indexer." in n for n in moved) and any(".indexer." not in n for n in moved)
    assert after < before - 0.05, (before, after)  # a from-scratch warm-up lowers the main loss
    assert all(x is not None and x > 0 for x in indexer)  # the indexers learn by their KL meanwhile

    only = tiny_overrides[:-1] + [f"run.dir={tmp_path / 'indexer_only'}"]
    moved, (_, frozen_after), _ = _train(only, "indexer_only")
    assert moved and all(".indexer." in n for n in moved), sorted(moved)
    assert frozen_after > after + 0.05, (frozen_after, after)


def _indexer_only_step(overrides, clip):
    """One indexer_only warm-up step: (its gradient norm, the indexers' gradients it leaves)."""
    cfg = load_config(None, overrides + QWEN4 + ["model.indexer_warmup=indexer_only",
                                                 f"train.grad_clip={clip}"])
    run = build_run(cfg)
    _, _, norm = run.step(micro_batches(run, 0), depth_coefficients(cfg.mtp, 0.0), 0.0)
    grads = {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None}
    return norm, grads


def test_indexer_only_clips_the_indexers_by_their_own_norm(tiny_overrides, tmp_path):
    """The language model's gradients are dropped before clipping: they neither count in the
    logged norm nor shrink the indexers' step (a norm over every gradient clipped the indexers by
    the trunk's norm)."""
    norm, raw = _indexer_only_step(tiny_overrides, 0.0)
    assert raw and all(".indexer." in n for n in raw), sorted(raw)
    by_hand = torch.cat([g.flatten() for g in raw.values()]).norm()
    assert norm == pytest.approx(float(by_hand), rel=1e-5)
    clip = norm / 4
    clipped_norm, clipped = _indexer_only_step(
        tiny_overrides[:-1] + [f"run.dir={tmp_path / 'clipped'}"], clip)
    assert clipped_norm == pytest.approx(norm, rel=1e-5)
    for n, g in raw.items():
        torch.testing.assert_close(clipped[n], g * (clip / norm), rtol=1e-4, atol=1e-9)


def test_the_loop_runs_the_warm_up_dense_and_the_rest_sparse(tiny_overrides):
    """The trainer hands the stage to every QSA forward of a step: dense for the warm-up's steps,
    sparse after them (in-loop evaluation off: training forwards only)."""
    cfg = load_config(None, tiny_overrides + QWEN4 + ["model.indexer_warmup_steps=2",
                                                      "eval.interval=0"])
    run = build_run(cfg)
    stages = []
    for layer in run.model.modules():
        if isinstance(layer, IndexedAttention):
            layer.register_forward_pre_hook(
                lambda _m, _args, kwargs: stages.append(kwargs.get("dense", False)),
                with_kwargs=True)
    run_training(run)
    per_step = len(stages) // 4
    assert per_step > 0 and len(stages) == 4 * per_step
    assert stages == [True] * (2 * per_step) + [False] * (2 * per_step)


def test_a_frozen_trunk_runs_sparse_in_the_warm_up():
    """train.freeze_trunk: the trunk's indexers do not train, so its attention stays sparse, as it
    is served, while the drafter's QSA layer warms up densely (the whole model attended densely,
    and the drafter learned from a trunk that is not the one served)."""
    from tests.eval_helpers import tiny_qwen4_model

    model = tiny_qwen4_model(2).train()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    stages = []
    for name, layer in model.named_modules():
        if isinstance(layer, IndexedAttention):
            layer.register_forward_pre_hook(
                lambda _m, _args, kwargs, name=name: stages.append(
                    (name.startswith("mtp."), kwargs.get("dense", False))), with_kwargs=True)
    tokens = torch.randint(2, 64, (1, 33), generator=torch.Generator().manual_seed(0))
    model(tokens, qsa_dense=True)
    assert {trunk for trunk, dense in stages if not dense} == {False}
    assert {mtp for mtp, dense in stages if dense} == {True}
