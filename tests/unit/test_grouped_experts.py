"""Grouped experts (`torch._grouped_mm`) against the per-expert loop, and no host sync in a MoE
forward."""

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tandem.models import ModelConfig, MTPConfig, TandemModel
from tandem.models.experts import _grouped_mm_works
from tandem.models.moe import MoE, combine_expert_outputs, copy_positions, token_copies

pytestmark = pytest.mark.skipif(not _grouped_mm_works(torch.device("cpu"), torch.float32),
                                reason="torch._grouped_mm not available on this CPU build")


def cfg(matmul: str, **kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                intermediate_size=48,
                moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense=1, max_seq_len=64,
                router_score="softmax", balance="aux_loss", z_loss_coef=1e-3, expert_matmul=matmul)
    base.update(kw)
    return ModelConfig(**base)


def run(model, tokens, dtype):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = model(tokens, torch.ones(tokens.shape[0], tokens.shape[1] - 1),
                    torch.zeros_like(tokens))
        loss = out.loss_sums.sum()
    loss.backward()
    return out.loss_sums.detach(), {n: p.grad.clone() for n,
                                    p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_grouped_matches_loop_forward_and_backward(dtype, tol):
    """A whole model (trunk MoE layers and the MTP module's) with aux and z losses: losses and every
    gradient of the grouped path agree with the loop's to rounding, in fp32 and under bf16
    autocast."""
    torch.manual_seed(0)
    grouped = TandemModel(cfg("grouped"), MTPConfig(num_steps=2, num_layers=1))
    loop = copy.deepcopy(grouped)
    for m in loop.modules():
        if isinstance(m, MoE):
            m.experts.matmul = "loop"
    tokens = torch.randint(0, 97, (2, 17))
    lg, gg = run(grouped, tokens, dtype)
    ll, gl = run(loop, tokens, dtype)
    torch.testing.assert_close(lg, ll, rtol=tol, atol=tol)
    assert gg.keys() == gl.keys()
    for name in gg:
        scale = gl[name].abs().max().clamp(min=1e-3)
        assert (gg[name] - gl[name]).abs().max() <= tol * scale, name


def test_empty_and_unused_experts():
    """Experts no token reaches get zero gradients, and an empty batch of copies still works."""
    torch.manual_seed(0)
    moe = MoE(cfg("grouped", num_experts=8, top_k=1))
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[3] = 1.0  # every token to expert 3 (scores >= others for positive inputs)
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.rand(2, 5, 32) + 0.1
    moe(x).sum().backward()
    g = moe.experts.gate_proj.grad
    assert g[3].abs().sum() > 0 and g[[0, 1, 2, 4, 5, 6, 7]].abs().sum() == 0
    moe.zero_grad()
    empty = moe(torch.zeros(1, 0, 32, requires_grad=True))
    assert empty.shape == (1, 0, 32)
    # the grouped ops on no rows (a compiled exact dispatch cannot branch around them)
    empty.sum().backward()
    assert moe.experts.gate_proj.grad.abs().sum() == 0 and moe.experts.down_proj.grad.shape == (8,
                                                                                                32,
                                                                                                16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_rows_come_back_zero_on_both_paths(dtype):
    """Rows past the counts (the padded EP dispatch's padding): the loop returned zeros, the
    grouped kernel left them unwritten (1.6e38 in bf16) and their input gradient, through the SiLU,
    NaN, which anomaly mode stopped on. Old memory is planted where the outputs will be
    allocated."""
    from tandem.models.experts import expert_swiglu

    torch.manual_seed(0)
    gate, up, down = [(torch.randn(*shape) * 0.2).to(dtype).requires_grad_()
                      for shape in ((4, 16, 32), (4, 16, 32), (4, 32, 16))]
    counts, rows = torch.tensor([3, 0, 5, 0]), torch.randn(8, 32).to(dtype)
    outputs = {}
    for path in ("grouped", "loop"):
        x = torch.zeros(64, 32, dtype=dtype)
        x[:8] = rows
        x.requires_grad_()
        for n in (16, 32):
            del_me = torch.full((64, n), 1e30, dtype=dtype)
            del del_me
        with torch.autograd.set_detect_anomaly(True):
            y = expert_swiglu(x, counts, gate, up, down, matmul=path)
            y[:8].float().sum().backward()
        assert torch.equal(y[8:], torch.zeros_like(y[8:])), path
        assert torch.isfinite(x.grad).all() and torch.equal(x.grad[8:], torch.zeros_like(x[8:]))
        outputs[path] = y.detach().float()
    torch.testing.assert_close(outputs["grouped"], outputs["loop"], rtol=2e-2, atol=2e-2)


def test_expert_loop_compiles_once_for_every_routing(fresh_dynamo):
    """The per-expert loop (the fallback where the grouped kernel is missing) under train.compile's
    settings: its host-read counts become symbolic sizes, one graph serves routings with empty and
    full experts, and it computes what the grouped path does (the loop used to branch on each count:
    a graph break and a recompile per new count)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from tandem.models.experts import expert_swiglu
    from tandem.trainer.parallel.compile import configure_compiler

    configure_compiler()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g)
    gate, up, down = (torch.randn(shape, generator=g) for shape in ((4, 8, 16), (4, 8, 16),
                                                                    (4, 16, 8)))
    counter = CompileCounterWithBackend("aot_eager")
    loop = torch.compile(lambda x_nh, counts: expert_swiglu(x_nh, counts, gate, up, down, "loop"),
                         backend=counter)
    for counts in ([3, 0, 7, 0], [1, 2, 3, 4], [0, 0, 10, 0]):
        counts = torch.tensor(counts)
        torch.testing.assert_close(loop(x, counts),
                                   expert_swiglu(x, counts, gate, up, down, "grouped"))
    assert counter.frame_count == 1
    # a padded dispatch's rows past the counts: the loop skips them, zeros in their place, so the
    # result has the input's rows whichever path ran (eager and compiled)
    counts = torch.tensor([2, 0, 3, 1])
    padded = torch.cat([x[:6], torch.randn(4, 16, generator=g)])
    for fn in (loop, lambda x_nh, c: expert_swiglu(x_nh, c, gate, up, down, "loop")):
        y = fn(padded, counts)
        torch.testing.assert_close(y[:6], expert_swiglu(x[:6], counts, gate, up, down, "grouped"))
        assert y.shape == (10, 16) and not y[6:].any()


def test_unaligned_width_falls_back_or_raises():
    """A hidden width whose rows are not 16-byte aligned: `auto` takes the loop, `grouped` says
    why."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 30)
    auto = MoE(cfg("auto", hidden_size=30, num_heads=3, num_kv_heads=1))
    for p in auto.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert auto(x).shape == x.shape
    auto.experts.matmul = "grouped"
    with pytest.raises(RuntimeError, match="expert_matmul=grouped"):
        auto(x)


class _NoHostSync(TorchFunctionMode):
    """Fails on any tensor -> Python conversion and on ops that size their output from data."""

    BANNED = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.bincount, torch.nonzero,
              torch.Tensor.nonzero, torch.unique, torch.masked_select}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.BANNED:
            raise AssertionError(f"host sync in the MoE forward: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("router_score,n_group", [("softmax", 1), ("sigmoid", 2)])
def test_moe_forward_and_backward_have_no_host_sync(router_score, n_group):
    torch.manual_seed(0)
    moe = MoE(cfg("grouped", router_score=router_score, n_group=n_group, topk_group=1,
                  balance="aux_loss" if n_group == 1 else "aux_free"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe.train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    with _NoHostSync():
        out = moe(x)
        out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and moe.last_aux_loss is not None


def _documented_npu_grouped_matmul(x, weight, *, group_list, split_item, group_type,
                                   group_list_type):
    """torch_npu.npu_grouped_matmul's documented semantics for the calls Tandem makes (one x, one
    weight; group_list_type=0: cumulative group ends): group_type=0 splits x's rows (M), weight [E,
    K, N] holds one matrix per group; group_type=2 splits the shared dimension K of x [M, K] and
    weight [K, N] and stacks the per-group products [E, M, N]; split_item 2/3 return one tensor."""
    assert len(x) == len(weight) == 1 and group_list_type == 0 and group_list.dtype == torch.int64
    (a,), (b,) = x, weight
    ends = group_list.tolist()
    starts = [0] + ends[:-1]
    if group_type == 0:
        assert split_item == 2 and b.dim() == 3
        return [torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])]
    assert group_type == 2 and split_item == 3 and b.dim() == 2
    return [torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])]


def test_npu_kernels_compute_what_torch_grouped_mm_does():
    """Ascend: the MoE's grouped-matmul ops on torch_npu's kernel (trainer/parallel/device.py). No
    NPU here: the kernels run on the CPU against torch_npu's documented semantics, and forward,
    input and weight gradients must equal torch._grouped_mm's autograd (the path CPU and CUDA
    take)."""
    from tandem.trainer.parallel.device import npu_grouped_mm_kernels

    grouped_mm, grouped_mm_raw = npu_grouped_mm_kernels(_documented_npu_grouped_matmul)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 16, generator=g, requires_grad=True)  # [E, out, in]
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # expert 1 gets no rows
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    dy = torch.randn(y.shape, generator=g)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    with torch.no_grad():
        torch.testing.assert_close(grouped_mm(x, w, offs), y, rtol=1e-6, atol=1e-6)
        # as moe's backward calls it
        torch.testing.assert_close(grouped_mm_raw(dy, w, offs), gx, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grouped_mm_raw(dy.t(), x, offs), gw, rtol=1e-6, atol=1e-6)


# --- the weighted combine of each token's k expert outputs ----------------------------------------
def _scatter_add_combine(y_sorted, order, weights):
    """The combine before issue 20: products in y's dtype, summed by index_add_ in y's dtype in the
    copies' expert-sorted order (on CUDA: in whatever order its atomics land)."""
    k = weights.shape[1]
    y = y_sorted * weights.flatten()[order].unsqueeze(-1).to(y_sorted.dtype)
    return torch.zeros(weights.shape[0], y.shape[1], dtype=y.dtype).index_add_(0, order // k, y)


def _routing(t: int, k: int, e: int, seed: int):
    """Expert ids [t, k] (distinct per token) and the copies' expert-sorted order, as MoE sorts
    them."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return idx, torch.argsort(idx.flatten(), stable=True)


def _copies_sorted(y_tkh, order):
    """Row i of the experts' output belongs to copy order[i] = (t, j)."""
    return y_tkh.flatten(0, 1)[order]


def test_combine_sums_in_fp32_in_slot_order_whatever_the_experts():
    """bf16 copies with exactly representable products and sums (integers x sixteenths): the fp32
    combine equals the exact sum rounded once to bf16, bit for bit, and does not depend on which
    experts (hence which sorted order) the copies went through. The bf16 scatter-add rounds each
    product to bf16 and misses the exact value (its order dependence is CUDA's atomics, which a CPU
    cannot show)."""
    t, k, h, e = 64, 4, 32, 8
    g = torch.Generator().manual_seed(0)
    y_tkh = torch.randint(-128, 128, (t, k, h), generator=g).to(torch.bfloat16)  # exact in bf16
    w = torch.randint(1, 16, (t, k), generator=g).float() / 16  # exact in fp32
    exact = (y_tkh.double() * w.double().unsqueeze(-1)).sum(1).to(torch.bfloat16)
    outs, old = [], []
    for seed in (1, 2):
        _, order = _routing(t, k, e, seed)
        y = _copies_sorted(y_tkh, order)
        outs.append(combine_expert_outputs(y, copy_positions(order, k), w))
        old.append(_scatter_add_combine(y, order, w))
    assert outs[0].dtype == torch.bfloat16
    assert torch.equal(outs[0], exact) and torch.equal(outs[1], exact)
    assert not torch.equal(old[0], exact)  # what the test guards against


def test_combine_error_in_bf16_is_below_the_scatter_add():
    """Random bf16 outputs and fp32 routing weights: against an fp64 reference of the same inputs
    the combine is within one bf16 rounding of each output, and well below the old path's error
    (measured 0.53x here: the CPU's index_add_ only adds the products' bf16 roundings; CUDA's bf16
    atomics also round every partial sum)."""
    t, k, h, e = 256, 8, 64, 16
    g = torch.Generator().manual_seed(0)
    y_tkh = torch.randn(t, k, h, generator=g).to(torch.bfloat16)
    w = torch.rand(t, k, generator=g) * 0.5
    _, order = _routing(t, k, e, 3)
    y = _copies_sorted(y_tkh, order)
    ref = (y_tkh.double() * w.double().unsqueeze(-1)).sum(1)
    new = (combine_expert_outputs(y, copy_positions(order, k), w).double() - ref).abs()
    old = (_scatter_add_combine(y, order, w).double() - ref).abs()
    # one rounding to nearest (8 significant bits)
    assert (new <= ref.abs() * 2.0**-8 * (1 + 1e-5)).all()
    assert new.mean() < 0.75 * old.mean(), (float(new.mean()), float(old.mean()))
    print(f"mean |error| vs fp64: fp32 combine {float(new.mean()):.3e}, bf16 scatter-add "
          f"{float(old.mean()):.3e}")


def test_combine_gradients_match_autograd_of_the_plain_sum():
    """The combine's hand-written backward (it keeps y in its own dtype, fp32 one slice at a time)
    equals autograd through the plain fp64 expression, to fp64 rounding."""
    t, k, h, e = 12, 3, 8, 5
    g = torch.Generator().manual_seed(0)
    y_tkh = torch.randn(t, k, h, generator=g, dtype=torch.float64)
    w = torch.rand(t, k, generator=g, dtype=torch.float64)
    _, order = _routing(t, k, e, 4)
    y = _copies_sorted(y_tkh, order).requires_grad_()
    w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = y.detach().clone().requires_grad_()
    dout = torch.randn(t, h, generator=g, dtype=torch.float64)
    pos = copy_positions(order, k)
    torch.autograd.backward(combine_expert_outputs(y, pos, w1), dout)
    inv = torch.argsort(order)
    plain = (y2[inv].view(t, k, h) * w2.unsqueeze(-1)).sum(1)
    torch.autograd.backward(plain, dout)
    torch.testing.assert_close(y.grad, y2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b: combine_expert_outputs(a, pos, b),
        (y.detach().requires_grad_(), w.clone().requires_grad_()),
    )


def test_token_copies_gradient_sums_each_tokens_copies_in_fp32():
    """The copies' gather (`token_copies`): forward is indexing by order // k; backward is
    indexing's gradient (fp64: equal to its rounding), and in bf16 each token's k copy gradients
    summed in fp32 in slot order and rounded once."""
    t, k, h, e = 12, 3, 8, 5
    g = torch.Generator().manual_seed(0)
    _, order = _routing(t, k, e, 4)
    x = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dout = torch.randn(t * k, h, generator=g, dtype=torch.float64)
    pos = copy_positions(order, k)
    copies = token_copies(x, order, pos)
    torch.testing.assert_close(copies, x2[order // k], rtol=0, atol=0)
    torch.autograd.backward(copies, dout)
    torch.autograd.backward(x2[order // k], dout)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a: token_copies(a, order, pos),
                                    (x.detach().requires_grad_(),))
    xb = x.detach().bfloat16().requires_grad_()
    torch.autograd.backward(token_copies(xb, order, pos), dout.bfloat16())
    slots = dout.bfloat16().float()[torch.argsort(order)].view(t, k, h)
    expected = (slots[:, 0] + slots[:, 1] + slots[:, 2]).bfloat16()
    assert torch.equal(xb.grad, expected)


def test_moe_layer_combines_in_fp32_under_autocast():
    """The MoE layer itself (bf16 experts under autocast): its routed output is the fp32 combine of
    the copies' expert outputs, not their bf16 scatter-add."""
    torch.manual_seed(0)
    moe = MoE(cfg("auto", num_shared_experts=0, top_k=4))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        weights, idx = moe.router(x)[:2]
        out = moe.route_and_compute(x, weights, idx)
        order = torch.argsort(idx.flatten(), stable=True)
        y = moe.experts(x[order // 4], torch.bincount(idx.flatten(), minlength=8))
    y_tkh = y[torch.argsort(order)].view(64, 4, -1)
    exact = (y_tkh.double() * weights.double().unsqueeze(-1)).sum(1)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, exact.float().to(torch.bfloat16)) or \
        ((out.double() - exact).abs() <= exact.abs() * 2.0**-8 * (1 + 1e-5)).all()
    assert not torch.equal(out, _scatter_add_combine(y, order, weights))
