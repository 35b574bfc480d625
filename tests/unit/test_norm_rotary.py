"""RMSNorm and rotary embeddings with hand-written backwards (models/layers.py): forward bit for bit
as the decomposed formulas transformers uses, gradients as autograd's of those formulas in
float64."""

import pytest
import torch

from tandem.models.gated_deltanet import GatedRMSNorm
from tandem.models.layers import RMSNorm, RotaryEmbedding


def decomposed_rms_norm(x, w, eps, zero_centered, group_size):
    """The formula as transformers writes it (Qwen3 / Qwen3-Next), differentiated by autograd."""
    x32 = x.float()
    if group_size:
        x32 = x32.unflatten(-1, (-1, group_size))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if group_size:
        x32 = x32.flatten(-2)
    if zero_centered:
        return (x32 * (1.0 + w.float())).to(x.dtype)
    return w * x32.to(x.dtype)


def float64_grads(x, w, g, eps, zero_centered, group_size):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    xg = x64.unflatten(-1, (-1, group_size)) if group_size else x64
    y = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)
    y = y.flatten(-2) if group_size else y
    y = y * (1.0 + w64) if zero_centered else y * w64
    return torch.autograd.grad(y, (x64, w64), g.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered,group_size,transposed", [
    (False, 0, False), (False, 0, True), (True, 0, False), (True, 16, False), (False, 16, False)])
def test_rms_norm_forward_bitwise_and_gradients(dtype, zero_centered, group_size, transposed):
    torch.manual_seed(0)
    dim = 16 if transposed else 64
    norm = RMSNorm(dim, 1e-6, zero_centered=zero_centered, group_size=group_size)
    with torch.no_grad():
        norm.weight.normal_(0.0 if zero_centered else 1.0, 0.3)
    x = (
        torch.randn(3, 10, 4, 16, dtype=dtype).transpose(1, 2)
        if transposed
        else torch.randn(3, 10, dim, dtype=dtype)
    )
    x = (x * 3.0).requires_grad_()  # a per-row scale away from 1, so rstd matters
    out = norm(x)
    x_ref, w_ref = (
        x.detach().clone().requires_grad_(),
        norm.weight.detach().clone().requires_grad_(),
    )
    ref = decomposed_rms_norm(x_ref, w_ref, 1e-6, zero_centered, group_size)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    g = torch.randn(out.shape, dtype=out.dtype)
    gx, gw = torch.autograd.grad(out, (x, norm.weight), g)
    gx_ref, gw_ref = torch.autograd.grad(ref, (x_ref, w_ref), g)
    gx64, gw64 = float64_grads(x, norm.weight, g, 1e-6, zero_centered, group_size)
    assert gx.dtype == x.dtype and gw.dtype == norm.weight.dtype and gx.shape == x.shape
    for got, autograd_ref, exact in ((gx, gx_ref, gx64), (gw, gw_ref, gw64)):
        err = (got.double() - exact).abs().max() / exact.abs().max()
        ref_err = (autograd_ref.double() - exact).abs().max() / exact.abs().max()
        # fp32 arithmetic throughout; in bf16 x's gradient is rounded once, at the end
        assert err <= max(ref_err * 1.5, 1e-6 if dtype == torch.float32 else 4e-3), (err, ref_err)


def test_rms_norm_without_grad_and_gated_norm():
    torch.manual_seed(0)
    norm = GatedRMSNorm(16, 1e-6, "silu")
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x, gate = torch.randn(2, 5, 16, dtype=torch.bfloat16), torch.randn(2, 5, 16,
                                                                       dtype=torch.bfloat16)
    expected = (decomposed_rms_norm(x, norm.weight, 1e-6, False,
                                    0) * torch.nn.functional.silu(gate.float())).to(x.dtype)
    with torch.no_grad():
        assert torch.equal(norm(x, gate), expected)
    assert torch.equal(norm(x, gate), expected)  # the autograd path computes the same forward


def concatenating_rotary(x, cos, sin):
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    out = rot * cos + torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], dim=-1) * sin
    return torch.cat([out, rest], dim=-1) if rest.numel() else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_matches_the_concatenating_form_bit_for_bit(dtype, rotary_dim):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(16, rotary_dim, 10000.0, 64)
    positions = torch.randint(0, 64, (2, 9))
    x = torch.randn(2, 9, 3, 16, dtype=dtype).transpose(1, 2).requires_grad_()  # [B, N, S, D] view
    out = rotary(x, positions)
    cos = rotary.cos[positions].unsqueeze(1).to(dtype)
    sin = rotary.sin[positions].unsqueeze(1).to(dtype)
    x_ref = x.detach().clone().requires_grad_()
    ref = concatenating_rotary(x_ref, cos, sin)
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    assert torch.equal(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x_ref, g)[0])
    with torch.no_grad():
        assert torch.equal(rotary(x, positions), ref)


def saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn(*args)` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_keeps_only_its_input_and_rstd_for_backward(dtype):
    """Autograd's decomposed norm keeps fp32 x and the cast x_hat (8 or 6 bytes per element, fp32 or
    bf16); the Function keeps x in its own dtype and one fp32 rstd per row."""
    norm = RMSNorm(64)
    x = torch.randn(32, 64, dtype=dtype, requires_grad=True)
    expected = x.numel() * x.element_size() + 32 * 4 + norm.weight.numel() * 4
    assert saved_bytes(norm, x) == expected
    assert saved_bytes(decomposed_rms_norm, x, norm.weight, 1e-6, False,
                       0) > expected + x.numel() * 2
