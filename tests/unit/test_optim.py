"""AdamW's kernels: the fused kernel (`auto`'s choice on CPU and CUDA) and the foreach one take the
same steps as torch's per-parameter AdamW (the independent reference) within float rounding, on the
trainer's two groups (decay and no-decay)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tandem.trainer.config_checks import ConfigError
from tandem.trainer.optim import build_optimizer
from tandem.trainer.recipe import load_config


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4))


def _train(model, optimizer, steps=4):
    torch.manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_kernels_step_like_per_parameter_adamw(kernel):
    cfg = load_config(None, [f"train.optimizer_kernel={kernel}", "train.lr=0.01"]).train
    model = _model()
    optimizer = build_optimizer(model, cfg)
    assert optimizer.defaults["fused"] is (True if kernel == "fused" else None)
    got = _train(model, optimizer)

    ref_model = _model()
    decay = [p for p in ref_model.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref_model.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    want = _train(ref_model, ref_opt)
    start = [p.detach() for p in _model().parameters()]
    for g, w, s in zip(got, want, start):
        assert not torch.equal(w, s)  # the steps moved every parameter
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_auto_is_fused_on_cpu_and_a_bad_kernel_is_refused():
    cfg = load_config(None, []).train
    assert cfg.optimizer_kernel == "auto"
    assert build_optimizer(_model(), cfg).defaults["fused"] is True
    with pytest.raises(ConfigError,
                       match="'train.optimizer_kernel'='adam8bit' must be auto, fused or foreach"):
        load_config(None, ["train.optimizer_kernel=adam8bit"])


def test_decay_steps_sets_the_cosine_length_apart_from_max_steps():
    """train.decay_steps: warm-up, then a cosine from lr to min_lr over decay_steps (not
    max_steps - warmup_steps), then min_lr to the end; checked against the formula by hand."""
    from tandem.trainer.optim import lr_at

    t = load_config(None, ["train.lr=1.0", "train.min_lr=0.1", "train.warmup_steps=2",
                           "train.max_steps=100", "train.decay_steps=10"]).train
    assert lr_at(t, 0) == pytest.approx(0.5) and lr_at(t, 1) == pytest.approx(1.0)
    assert lr_at(t, 2) == pytest.approx(1.0)
    # a schedule step between W - 1 and W (after a resume under another global batch) stays at lr
    assert lr_at(t, 0.5) == pytest.approx(0.75) and lr_at(t, 1.5) == pytest.approx(1.0)
    assert lr_at(t, 7) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))  # halfway: 0.55
    assert lr_at(t, 12) == pytest.approx(0.1) and lr_at(t, 60) == pytest.approx(0.1)
    default = load_config(None, ["train.lr=1.0", "train.min_lr=0.1", "train.warmup_steps=2",
                                 "train.max_steps=100"]).train
    assert lr_at(default, 7) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 5 / 98)))


def test_a_warm_up_as_long_as_the_run_is_named():
    """tiny.yaml shortened to 20 steps kept its 30-step warm-up: the rate rose to the last step
    (2e-3 of 3e-3) and never decayed, silently."""
    from tandem.trainer.optim import schedule_warning

    short = load_config(None, ["train.lr=3e-3", "train.warmup_steps=30", "train.max_steps=20"])
    assert schedule_warning(short.train) == (
        "warning: train.warmup_steps=30 >= train.max_steps=20: the learning rate rises through "
        "the whole run to 0.002 at its last step (train.lr=0.003) and never decays; lower "
        "train.warmup_steps")
    for steps in ("31", "0"):  # a warm-up that ends, and a run of no step
        ok = load_config(None, ["train.warmup_steps=30", f"train.max_steps={steps}"])
        assert schedule_warning(ok.train) == ""


def test_a_resume_says_when_it_changes_the_lr_schedule():
    """A resume with a longer train.max_steps re-plans the cosine (decay_steps 0), so an annealed
    run's LR rises again; a smaller global batch ends the run before its decay does. Both were
    silent; the resume line now names them (hand-computed: lr 1, min_lr 0.1, warm-up 2)."""
    from tandem.trainer.optim import schedule_note

    def train(*extra):
        return load_config(None, ["train.lr=1.0", "train.min_lr=0.1", "train.warmup_steps=2",
                                  *extra]).train

    six = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2, "decay_steps": 0, "max_steps": 6}
    # 6 steps done (annealed to 0.1), extended to 10: the cosine now runs over 8 steps, half done
    assert schedule_note(six, train("train.max_steps=10"), 6, 9) == (
        "; the LR schedule changed (train.max_steps 6 -> 10): the next step's LR is 0.55, 0.1 on "
        "the checkpoint's schedule; train.decay_steps=4 keeps the checkpoint's decay")
    assert schedule_note(six, train("train.max_steps=10", "train.decay_steps=4"), 6, 9) == ""
    assert schedule_note(six, train("train.max_steps=6"), 3, 5) == ""
    # a lower LR alone (0.1 + 0.2 (1 + cos pi/4) against 0.1 + 0.45 (1 + cos pi/4)):
    # train.decay_steps would change nothing, so the line does not suggest it
    assert schedule_note(six, train("train.max_steps=6", "train.lr=0.5"), 3, 5) == (
        "; the LR schedule changed (train.lr 1.0 -> 0.5): the next step's LR is 0.4414, 0.8682 on "
        "the checkpoint's schedule")
    # 3 steps of 2 samples, then 1 sample a step: step 6 runs at schedule step 4 (0-based)
    assert schedule_note(six, train("train.max_steps=6"), 3, 4) == (
        "; the last step (train.max_steps=6) falls at schedule step 5 of 6 planned, at LR 0.55 "
        "(train.min_lr=0.1)")


def test_a_resume_under_another_kernel_finds_each_step_count_where_it_looks():
    """load_state_dict leaves each AdamW step count where the checkpoint's kernel kept it: on the
    host for foreach, on the parameter's device for fused. A resume that switched to fused on an
    accelerator then handed the fused kernel host step counts; apply_settings moves them (and back
    to the host for foreach). A parameter on the meta device stands in for an accelerator's."""
    from tandem.trainer.optim import apply_settings

    param = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    optimizer = torch.optim.AdamW([{"params": [param]}, {"params": []}], foreach=True)
    optimizer.state[param] = {"step": torch.tensor(3.0), "exp_avg": torch.empty_like(param),
                              "exp_avg_sq": torch.empty_like(param)}
    apply_settings(optimizer, load_config(None, ["train.optimizer_kernel=fused"]).train)
    step = optimizer.state[param]["step"]
    assert optimizer.param_groups[0]["fused"] and step.device.type == "meta"
    assert step.dtype == torch.float32
    optimizer.state[param]["step"] = torch.tensor(3.0)
    apply_settings(optimizer, load_config(None, ["train.optimizer_kernel=foreach"]).train)
    assert optimizer.state[param]["step"].device.type == "cpu"


def test_a_resume_says_when_it_changes_the_qsa_stage_or_the_mtp_weight():
    """model.indexer_warmup_steps and mtp.loss.lambda_after may change on resume; a sparse run put
    back into the dense warm-up (indexer_only: every other weight held still) or a lambda moved
    back was silent."""
    from tandem.trainer.optim import stage_note

    qsa = ["model.full_attention_interval=2", "model.indexer_heads=2", "model.indexer_head_dim=16",
           "model.indexer_budget=8", "model.indexer_compress_ratio=4", "model.head_dim=16"]
    cfg = load_config(None, qsa + ["model.indexer_warmup_steps=10", "mtp.num_steps=2",
                                   "model.init_from=/some/trunk"])
    saved_model = {"indexer_warmup_steps": 4, "indexer_warmup": "auto"}
    saved_mtp = {"loss": {"lambda": 0.3, "lambda_after": {5: 0.1}}}
    assert stage_note(saved_model, saved_mtp, cfg.model, cfg.mtp, 6) == (
        "; the QSA stage changed: the next step is the dense warm-up (indexer_only), sparse under "
        "the checkpoint's model.indexer_warmup_steps=4, indexer_warmup=auto"
        "; the MTP loss weight changed: the next step's mtp.loss.lambda is 0.3, 0.1 on the "
        "checkpoint's schedule")
    assert stage_note(saved_model, saved_mtp, cfg.model, cfg.mtp, 12) == (
        "; the MTP loss weight changed: the next step's mtp.loss.lambda is 0.3, 0.1 on the "
        "checkpoint's schedule")
    same = load_config(None, qsa + ["model.indexer_warmup_steps=4", "mtp.num_steps=2",
                                    "mtp.loss.lambda_after={5: 0.1}"])
    assert stage_note(saved_model, saved_mtp, same.model, same.mtp, 6) == ""


def test_apply_settings_puts_the_new_weight_decay_on_the_matrices_only():
    from tandem.trainer.optim import apply_settings, build_optimizer
    from tandem.trainer.recipe import load_config
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, load_config(None, ["train.weight_decay=0.1"]).train)
    apply_settings(opt, load_config(None, ["train.weight_decay=0.05"]).train)
    by_param = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert by_param[id(p)] == (0.05 if p.ndim >= 2 else 0.0), name
