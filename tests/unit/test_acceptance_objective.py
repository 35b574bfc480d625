"""mtp.loss.objective=acceptance: -log sum_v min(p_v, q_v), checked against a hand-computed case, a
naive full-vocabulary formula, and the model's own logits. The loss computes in fp32 whatever the
input dtype (like the cross-entropy), hence fp32 tolerances against float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.models.loss import acceptance_loss_sum, chunked_acceptance_loss_sum


def _naive(h, teacher, w, targets, ce_weight):
    p = (teacher @ w.t()).softmax(-1).detach()  # the teacher is a target, not trained through
    q = (h @ w.t()).softmax(-1)
    loss = -torch.minimum(p, q).sum(-1).log()
    return (loss - ce_weight * q.log().gather(1, targets.unsqueeze(1)).squeeze(1)).sum()


def test_hand_computed_value_and_gradient():
    # identity head: the hidden states are the logits, so p and q are set directly
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.25, 0.55]], dtype=torch.float64)
    h = q.log().requires_grad_(True)
    loss = acceptance_loss_sum(h, p.log(), torch.eye(3, dtype=torch.float64), torch.tensor([0]),
                               0.0)
    # a = min(.5,.2) + min(.3,.25) + min(.2,.55) = 0.65
    assert float(loss.detach()) == pytest.approx(-math.log(0.65), abs=1e-6)
    loss.backward()
    # dL/dz_j = -(1/a) (1[q_j < p_j] q_j - q_j S), S = sum of q over {q < p} = 0.45
    expected = [-(0.2 - 0.2 * 0.45) / 0.65, -(0.25 - 0.25 * 0.45) / 0.65, (0.55 * 0.45) / 0.65]
    assert h.grad[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_mixed_cross_entropy_hand_computed():
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.25, 0.55]], dtype=torch.float64)
    loss = acceptance_loss_sum(q.log(), p.log(), torch.eye(3, dtype=torch.float64),
                               torch.tensor([2]), 0.5)
    assert float(loss) == pytest.approx(-math.log(0.65) - 0.5 * math.log(0.55), abs=1e-6)


@pytest.mark.parametrize("chunk", [0, 3, 7, 64])
def test_chunked_matches_naive_formula_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    n, hid, vocab = 11, 8, 37
    h = torch.randn(n, hid, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(n, hid, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hid, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    got = chunked_acceptance_loss_sum(h, teacher, w, targets, chunk, ce_weight=0.3)
    got_grads = torch.autograd.grad(got, (h, w))
    ref = _naive(h, teacher, w, targets, 0.3)
    ref_grads = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_disjoint_distributions_give_a_finite_loss():
    # p and q put their mass on different tokens: a ~ e^-60, -log a ~ 60, no inf / nan
    h = torch.tensor([[30.0, -30.0]], requires_grad=True)
    loss = acceptance_loss_sum(h, torch.tensor([[-30.0, 30.0]]), torch.eye(2), torch.tensor([0]),
                               0.0)
    assert math.isfinite(float(loss)) and 55 < float(loss) < 65
    loss.backward()
    assert torch.isfinite(h.grad).all()


def _tiny(objective: str, ce_weight: float = 0.0):
    from tandem.models import ModelConfig, MTPConfig, TandemModel

    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=32, moe_intermediate_size=8, num_experts=4, top_k=2,
                      max_seq_len=32)
    mtp = MTPConfig(num_steps=2, num_layers=1)
    mtp.loss.objective, mtp.loss.acceptance_ce_weight = objective, ce_weight
    torch.manual_seed(0)
    return TandemModel(cfg, mtp)


def test_model_depth_losses_equal_acceptance_of_its_own_logits():
    """Each MTP depth's loss is -log sum_v min(p, q) with q the depth's distribution at position t
    and p the trunk's at t+k (the position whose next token depth k drafts), from the model's
    logits."""
    from tandem.models.mtp import depth_target_mask

    model = _tiny("acceptance")
    ce = _tiny("ce")
    ce.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (2, 13), generator=g)
    mask = torch.ones(2, 12)
    out, out_ce = model(tokens, mask), ce(tokens, mask)
    # the main head: CE
    assert float(out.loss_sums[0]) == pytest.approx(float(out_ce.loss_sums[0]), rel=1e-6)
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        h0 = model.trunk(tokens[:, :12], positions)
        p_trunk = model.logits(0, h0).softmax(-1)
        for depth, h in model.depth_states(h0, tokens, positions):
            if depth == 0:
                continue
            q = model.logits(depth, h).softmax(-1)
            p = torch.cat([p_trunk[:, depth:], p_trunk[:, :depth]], dim=1)
            valid = depth_target_mask(mask, None, depth)
            expected = -torch.minimum(p, q).sum(-1).log()[valid].sum()
            assert float(out.loss_sums[depth]) == pytest.approx(float(expected), rel=1e-5)
            assert float(out.token_counts[depth]) == float(valid.sum())


def test_acceptance_gradient_reaches_mtp_not_the_teacher():
    """The trunk's final norm shapes only the teacher p (the MTP chain reads the pre-norm h_0), so
    with p detached the MTP losses give it no gradient, while the MTP layer gets one."""
    model = _tiny("acceptance")
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    out = model(tokens)
    out.loss_sums[1:].sum().backward()
    assert model.norm.weight.grad is None or float(model.norm.weight.grad.abs().sum()) == 0.0
    assert float(model.mtp.layers[0].eh_proj.weight.grad.abs().sum()) > 0


def test_config_keys_are_validated():
    from tandem.trainer.config_checks import ConfigError
    from tandem.trainer.recipe import load_config

    with pytest.raises(ConfigError, match="mtp.loss.objective='kl' must be ce or acceptance"):
        load_config("recipes/tiny.yaml", ["mtp.loss.objective=kl"])
    with pytest.raises(ConfigError, match="mtp.loss.acceptance_ce_weight=-1.0 must be >= 0"):
        load_config("recipes/tiny.yaml",
                    ["mtp.loss.objective=acceptance", "mtp.loss.acceptance_ce_weight=-1"])
    with pytest.raises(ConfigError,
                       match="train.distill.*must be none with mtp.loss.objective=acceptance"):
        load_config("recipes/tiny.yaml", ["mtp.loss.objective=acceptance", "train.distill=soft"])


def test_a_bf16_frozen_head_under_fp32_training():
    """train.frozen_dtype=bf16 with train.dtype=fp32: the frozen trunk's head weight and hidden
    states are bf16 and the MTP module's are fp32. Both teacher losses compute as fp32 on the bf16
    values (a bf16 weight against fp32 rows stopped the first step with a dtype error)."""
    from tandem.models.loss import chunked_soft_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    teacher = torch.randn(6, 8, generator=g).bfloat16()
    w = torch.randn(11, 8, generator=g).bfloat16()
    targets = torch.tensor([1, 2, 3, -100, 4, 5])
    got = chunked_acceptance_loss_sum(h, teacher, w, targets, 4, ce_weight=0.5)
    want = _naive(h.double(), teacher.double(), w.double(), targets.clamp(min=0), 0.5)
    want = want - _naive(h.double()[3:4], teacher.double()[3:4], w.double(), targets[:1] * 0, 0.5)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    soft = chunked_soft_cross_entropy_sum(h, teacher, w, 4, targets >= 0)
    p = (teacher.double() @ w.double().t()).softmax(-1)
    rows = -(p * (h.double() @ w.double().t()).log_softmax(-1)).sum(-1)
    assert float(soft) == pytest.approx(float(rows[targets >= 0].sum()), rel=1e-5)
    (got + soft).backward()
    assert h.grad.dtype == torch.float32 and torch.isfinite(h.grad).all()


def test_soft_cross_entropy_gradient_treats_the_teacher_as_constant():
    from tandem.models.loss import chunked_soft_cross_entropy_sum
    torch.manual_seed(0)
    n, hdim, v = 7, 5, 11
    h = torch.randn(n, hdim, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(n, hdim, dtype=torch.float64)
    w = torch.randn(v, hdim, dtype=torch.float64, requires_grad=True)
    valid = torch.tensor([1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    chunked_soft_cross_entropy_sum(h, teacher, w, 3, valid).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    p = torch.softmax(teacher @ w2.detach().T, -1)  # the teacher: no gradient
    ref = -(p * torch.log_softmax(h2 @ w2.T, -1)).sum(-1)[valid].sum()
    ref.backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(h.grad, h2.grad)
