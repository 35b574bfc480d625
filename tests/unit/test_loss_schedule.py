"""The weighted multi-step loss: weights, lambda schedule, global normalisation (hand-computed)."""

import pytest
import torch

from tandem.models import MTPConfig, MTPLossConfig
from tandem.trainer.loss import combine_losses, depth_coefficients, depth_weights, lambda_at


def mtp(**loss):
    return MTPConfig(num_steps=3, num_layers=1, loss=MTPLossConfig(**loss))


def test_explicit_weights_normalised_and_raw():
    assert depth_weights(mtp(weights=[2.0, 1.0, 1.0])) == pytest.approx([0.5, 0.25, 0.25])
    assert depth_weights(mtp(weights=[2.0, 1.0, 1.0], normalize=False)) == [2.0, 1.0, 1.0]


def test_geometric_weights():
    assert depth_weights(mtp(decay=0.5, normalize=False)) == [1.0, 0.5, 0.25]
    assert depth_weights(mtp(decay=0.5)) == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    assert depth_weights(mtp()) == pytest.approx([1 / 3] * 3)  # DeepSeek-V3: lambda * mean


def test_lambda_schedule_deepseek_style():
    cfg = mtp(lambda_=0.3, lambda_after={100: 0.1, 50: 0.2})
    assert [lambda_at(cfg, s) for s in (0, 49, 50, 99, 100, 10**6)] == [0.3, 0.3, 0.2, 0.2, 0.1,
                                                                        0.1]
    assert depth_coefficients(cfg, 100) == pytest.approx([1.0, 0.1 / 3, 0.1 / 3, 0.1 / 3])
    assert depth_coefficients(MTPConfig(num_steps=0), 5) == [1.0]


def test_combine_normalises_by_global_counts():
    sums = torch.tensor([10.0, 8.0, 6.0])
    counts = torch.tensor([5.0, 4.0, 2.0])
    # 10/5 + 0.3*(0.5*8/4 + 0.5*6/2) = 2 + 0.3*2.5
    got = combine_losses(sums, counts, [1.0, 0.15, 0.15])
    assert float(got) == pytest.approx(2.75)
    # micro-batch split: two halves with the same global counts add up to the whole
    a = combine_losses(torch.tensor([4.0, 3.0, 2.0]), counts, [1.0, 0.15, 0.15])
    b = combine_losses(torch.tensor([6.0, 5.0, 4.0]), counts, [1.0, 0.15, 0.15])
    assert float(a + b) == pytest.approx(2.75)


def test_combine_losses_with_a_depth_that_has_no_target_is_finite():
    from tandem.trainer.loss import combine_losses, loss_gradient
    sums = torch.tensor([6.0, 0.0], requires_grad=True)
    counts = torch.tensor([3, 0])  # e.g. windows shorter than depth + 2 tokens
    total = combine_losses(sums, counts, [1.0, 0.3])
    assert float(total.detach()) == pytest.approx(2.0)
    total.backward()
    assert torch.isfinite(sums.grad).all() and float(sums.grad[0]) == pytest.approx(1 / 3)
    assert torch.isfinite(loss_gradient(counts, [1.0, 0.3])).all()
