"""Model invariants checked against hand-written references."""

import math

import pytest
import torch
import torch.nn.functional as F

from tandem.models import KVCache, ModelConfig, MTPConfig, TandemModel, depth_target_mask
from tandem.models import loss as head_loss
from tandem.models.loss import IGNORE, head_cross_entropy_sums
from tandem.models.moe import MoE
from tandem.trainer.loss import combine_losses, loss_gradient


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                intermediate_size=48,
                moe_intermediate_size=16, num_experts=4, top_k=2, first_k_dense=1, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


def make(K=3, L=2, seed=0, style="looped", **kw):
    torch.manual_seed(seed)
    return TandemModel(tiny_cfg(**kw), MTPConfig(num_steps=K, num_layers=L, style=style))


def test_depth_target_mask_hand_case():
    # window of 7 tokens (S=6 inputs); token 3 is an end-of-document: docs are [0..3] and [4..6]
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    loss_mask = torch.ones(1, 6)
    loss_mask[0, 5] = 0  # target token 6 masked by the data
    got = {d: depth_target_mask(loss_mask, doc_ids, d)[0].int().tolist() for d in range(4)}
    # depth d at t predicts token t+1+d: valid iff t+1+d <= 6, same doc as t, and mask[t+d]
    assert got[0] == [1, 1, 1, 0, 1, 0]  # t=3 (EOD) -> token 4 crosses; t=5 -> token 6 masked
    assert got[1] == [1, 1, 0, 0, 0, 0]  # t=2 -> token 4 crosses; t=4 -> token 6 masked
    assert got[2] == [1, 0, 0, 0, 0, 0]
    assert got[3] == [0, 0, 0, 0, 0, 0]  # t=0 -> token 4 crosses; t>=3 beyond the window


def test_step_to_layer_mapping_is_k_minus_1_mod_L():
    model = make(K=5, L=2)
    calls = []
    for i, layer in enumerate(model.mtp.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    model(torch.randint(0, 97, (1, 9)))
    assert calls == [0, 1, 0, 1, 0]
    assert [model.mtp_cfg.layer_for_step(k) for k in range(1, 6)] == [0, 1, 0, 1, 0]


def test_looped_losses_match_hand_composed_reference():
    model = make(K=2, L=1).eval()
    tokens = torch.randint(0, 97, (2, 11))
    out = model(tokens)
    s = 10
    pos = torch.arange(s).expand(2, s)
    h0 = model.trunk(tokens[:, :s], pos)
    layer = model.mtp.layers[0]
    ref = [F.cross_entropy(model.lm_head.logits(model.norm(h0))[:, :s].reshape(-1, 97),
                           tokens[:, 1:].reshape(-1),
                           reduction="sum")]
    h = h0
    for k in (1, 2):
        emb = model.embed_tokens(F.pad(tokens[:, k:], (0, k - 1))[:, :s])
        # embedding first (DeepSeek-V3)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], -1))
        h = layer.block(x, pos)
        logits = model.lm_head.logits(layer.norm(h))[:, : s - k]
        ref.append(F.cross_entropy(logits.reshape(-1, 97), tokens[:, 1 + k :].reshape(-1),
                                   reduction="sum"))
    torch.testing.assert_close(out.loss_sums, torch.stack(ref), rtol=1e-5, atol=1e-5)
    assert out.token_counts.tolist() == [20, 18, 16]


def test_k0_is_a_plain_lm_with_no_overhead():
    plain = make(K=0)
    with_mtp = make(K=3, L=1)
    assert plain.mtp is None
    trunk_params = {n for n, _ in with_mtp.named_parameters() if not n.startswith("mtp.")}
    assert {n for n, _ in plain.named_parameters()} == trunk_params
    plain.load_state_dict({k: v for k,
                           v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    tokens = torch.randint(0, 97, (2, 13))
    out0, out3 = plain(tokens), with_mtp(tokens)
    assert out0.loss_sums.shape == (1,)
    # plain causal LM reference: next-token CE of the trunk's logits
    logits = plain.lm_head.logits(plain.norm(plain.trunk(tokens[:, :12],
                                                         torch.arange(12).expand(2, 12))))
    ref = F.cross_entropy(logits.reshape(-1, 97), tokens[:, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(out0.loss_sums[0], ref)
    torch.testing.assert_close(out3.loss_sums[0], out0.loss_sums[0])


def test_parallel_style_heads_read_the_trunk_state():
    model = make(K=2, L=2, style="parallel").eval()
    assert not hasattr(model.mtp.layers[0], "eh_proj")
    tokens = torch.randint(0, 97, (1, 9))
    out = model(tokens)
    pos = torch.arange(8).expand(1, 8)
    h0 = model.trunk(tokens[:, :8], pos)
    h2 = model.mtp.layers[1].block(h0, pos)
    ref = F.cross_entropy(model.lm_head.logits(model.mtp.layers[1].norm(h2))[:, :6].reshape(-1, 97),
                          tokens[:, 3:].reshape(-1), reduction="sum")
    torch.testing.assert_close(out.loss_sums[2], ref)


@pytest.mark.parametrize("block_rows", [3, None])
@pytest.mark.parametrize("backward", ["recompute", "fused", "fused_promised"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_head_cross_entropy_sums_match_full(chunk, backward, block_rows, monkeypatch):
    """Three depths' rows in one pass against F.cross_entropy per depth, under incoming gradients
    that differ per depth (one of them 0, as a depth whose lambda is 0): `fused_promised` is told
    them up to a factor (the trainer's `loss_grad_scales`) and keeps one weight-gradient buffer for
    all depths. `block_rows`: the softmax in blocks of 3 rows of a chunk (the last one shorter), or
    one block."""
    if block_rows:
        monkeypatch.setattr(head_loss, "CPU_SOFTMAX_BLOCK_BYTES", block_rows * 50 * 4)
    torch.manual_seed(0)
    h = torch.randn(3, 23, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (3, 23))
    t[1, ::4] = IGNORE
    g = torch.tensor([0.5, 0.2, 0.0])
    scales = g * 4.0 if backward == "fused_promised" else None
    got = head_cross_entropy_sums(h, w, t, chunk, backward.replace("_promised", ""), scales)
    (got * g).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.stack([F.cross_entropy(h[d] @ w.t(), t[d], reduction="sum",
                                       ignore_index=IGNORE) for d in range(3)])
    (ref * g).sum().backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(gh, h.grad)
    torch.testing.assert_close(gw, w.grad)


def test_cpu_head_buffers_are_kept_between_passes():
    """On a CPU a pass through the head reuses the last pass's buffers when its shape is the same
    (no fresh pages to fault in every step), makes new ones when it is not, and what a pass computes
    does not depend on which buffers it got: a pass of another shape in between leaves the next
    one's losses and gradients bit for bit those of the first (the fused mode's gradient overwrites
    the kept logits)."""
    torch.manual_seed(0)
    h, w, t = torch.randn(2, 37, 32), torch.randn(300, 32) * 0.3, torch.randint(0, 300, (2, 37))
    scales = torch.tensor([1.0, 0.5])

    def one_pass(rows, chunk, backward):
        hh, ww = h[:, :rows].clone().requires_grad_(), w.clone().requires_grad_()
        got = head_cross_entropy_sums(hh, ww, t[:, :rows], chunk, backward,
                                      scales if backward == "fused" else None)
        (got * scales).sum().backward()
        return got.detach(), hh.grad, ww.grad, head_loss._CPU_KEPT_BUFFERS["buffers"]

    for backward in ("fused", "recompute"):
        first = one_pass(37, 16, backward)
        again = one_pass(37, 16, backward)
        assert again[3] is first[3]  # the same buffers, kept
        other = one_pass(11, 5, backward)
        assert other[3] is not first[3]
        after = one_pass(37, 16, backward)
        for a, b in zip(first[:3], after[:3]):
            assert torch.equal(a, b), backward


def test_softmax_blocks_change_no_bit(monkeypatch):
    """The head's softmax over blocks of rows (a CPU's cache-sized blocks) computes every row as the
    whole chunk does: losses and both gradients bit for bit, fp32 and bf16 autocast; and in bf16 the
    loss of the bf16 logits within a rounding."""
    torch.manual_seed(0)
    h = torch.randn(2, 37, 32)
    w = torch.randn(300, 32) * 0.3
    t = torch.randint(0, 300, (2, 37))
    t[0, ::5] = IGNORE
    for bf16 in (False, True):
        results = []
        # blocks of 4 rows (9 and a part per chunk), one block
        for block_bytes in (300 * 4 * 4, 1 << 30):
            monkeypatch.setattr(head_loss, "CPU_SOFTMAX_BLOCK_BYTES", block_bytes)
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                got = head_cross_entropy_sums(hh, ww, t, 37, "fused", torch.tensor([1.0, 0.5]))
            (got * torch.tensor([1.0, 0.5])).sum().backward()
            results.append((got.detach(), hh.grad, ww.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b), bf16
        # against autograd through the bf16 logits: a rounding apart (measured 2e-3 on gradients)
        if bf16:
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = F.linear(hh, ww).float()
            ref = torch.stack([F.cross_entropy(logits[d], t[d], reduction="sum",
                                               ignore_index=IGNORE) for d in range(2)])
            (ref * torch.tensor([1.0, 0.5])).sum().backward()
            torch.testing.assert_close(results[0][0], ref.detach(), rtol=4e-3, atol=0)
            for got_grad, ref_grad in zip(results[0][1:], (hh.grad, ww.grad)):
                assert float((got_grad - ref_grad).norm() / ref_grad.norm()) < 1e-2


def test_fused_head_holds_one_weight_gradient_for_every_depth():
    """K=3 under the trainer's promised gradients: the fused head keeps ONE fp32 [vocab x hidden]
    buffer from forward to backward for the trunk's head and the three MTP depths (it kept one per
    depth, four), and the step's gradients match the recomputing head's."""
    vocab, hidden = 97, 32
    grads = []
    for mode in ("recompute", "fused"):
        model = make(K=3, L=1)
        model.lm_head.backward = mode
        tokens = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(3))
        counts = torch.tensor([24.0, 22.0, 20.0, 18.0])
        coefs = [1.0, 0.3, 0.2, 0.1]
        params = {p.data_ptr() for p in model.parameters()}
        head_buffers = []

        def pack(x):
            if x.shape == (vocab, hidden) and x.data_ptr() not in params:
                head_buffers.append(x.dtype)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = model(tokens, loss_grad_scales=loss_gradient(counts, coefs))
        combine_losses(out.loss_sums, counts, coefs).backward()
        if mode == "fused":
            assert head_buffers == [torch.float32]
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, ref in grads[0].items():
        torch.testing.assert_close(grads[1][name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_head_backward_trains_like_recompute():
    """mtp.loss_head_backward=fused: every depth's loss and every parameter's gradient as
    `recompute` (fp32: rounding only, measured 3.4e-7 on gradients; bf16 autocast: the same bf16
    matmuls summed in another order, measured 4.6e-3, one bf16 rounding being 3.9e-3)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        grads = []
        for mode in ("recompute", "fused"):
            model = make(K=2, L=1)
            model.mtp_cfg.loss_chunk_tokens = 7
            model.lm_head.backward = mode
            tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = model(tokens)
            out.loss_sums.sum().backward()
            grads.append((out.loss_sums.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (l0, g0), (l1, g1) = grads
        torch.testing.assert_close(l1, l0, rtol=tol, atol=tol)
        for name in g0:
            err = float((g1[name] - g0[name]).norm() / g0[name].norm().clamp(min=1e-12))
            assert err < tol, (dtype, name, err)


def test_no_full_vocab_logits_are_saved_for_backward():
    vocab, tokens = 4000, 512
    model = make(K=3, L=1, vocab_size=vocab, max_seq_len=tokens + 8)
    model.mtp_cfg.loss_chunk_tokens = 64
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, vocab, (1, tokens + 1)))
    # A resident logits tensor would be >= tokens*vocab elements; chunks are 64*vocab at most.
    assert max(saved) < tokens * vocab / 4


def test_grouped_experts_match_per_token_reference():
    torch.manual_seed(0)
    cfg = tiny_cfg(num_experts=4, top_k=2, router_score="softmax", num_shared_experts=1)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 32)
    out = moe(x)
    flat = x.reshape(-1, 32)
    logits = flat @ moe.router.weight.t()
    probs = logits.softmax(-1)
    ref = torch.zeros_like(flat)
    for i in range(flat.shape[0]):
        top = probs[i].topk(2)
        weights = top.values / top.values.sum()
        for w, e in zip(weights, top.indices):
            xe = flat[i]
            y = (F.silu(moe.experts.gate_proj[e] @ xe) * (moe.experts.up_proj[e] @ xe))
            ref[i] += w * (moe.experts.down_proj[e] @ y)
    ref += moe.shared_experts(flat)
    torch.testing.assert_close(out.reshape(-1, 32), ref, rtol=1e-5, atol=1e-5)


def test_aux_free_bias_moves_against_the_load():
    cfg = tiny_cfg(num_experts=4, top_k=1, balance="aux_free", bias_update_rate=0.01)
    moe = MoE(cfg)
    moe.router.update_bias(torch.tensor([10.0, 0.0, 2.0, 4.0]))  # mean 4
    torch.testing.assert_close(moe.router.e_score_correction_bias,
                               torch.tensor([-0.01, 0.01, 0.01, 0.0]))
    # Iterating the rule evens out a router that sends everything to one expert.
    torch.manual_seed(0)
    torch.nn.init.normal_(moe.router.weight, std=0.02)
    with torch.no_grad():
        moe.router.weight[0] += 0.5
    x = torch.randn(256, 32).abs()
    first = None
    for _ in range(200):
        moe.router.tokens_per_expert.zero_()
        moe.router(x)
        load = moe.router.tokens_per_expert.clone()
        first = load if first is None else first
        moe.router.update_bias(load)
    assert first.max() / first.mean() > 2.0
    assert load.max() / load.mean() < first.max() / first.mean()
    assert moe.router.e_score_correction_bias[0] < 0


def test_aux_loss_gradient_reaches_the_router():
    cfg = tiny_cfg(num_experts=4, top_k=2, balance="aux_loss", aux_loss_coef=1.0,
                   router_score="softmax")
    torch.manual_seed(0)
    moe = MoE(cfg).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 8, 32)
    moe(x).sum().backward()
    with_aux = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe(x, aux_grad_scale=0.0).sum().backward()
    assert not torch.allclose(with_aux, moe.router.weight.grad)
    assert moe.last_aux_loss > 0


def test_a_pipeline_split_of_the_step_is_the_aux_losss_micro_batch(tiny_overrides, capsys):
    """Under pp the aux/z-loss is a statistic of each pipeline micro-batch: when pp splits the
    step's sequences otherwise than train.grad_accum_steps, the run says over how many sequences
    (one process matches it at that micro-batch size), and the aux gradient's scale follows the
    pipeline's micro-batches."""
    from types import SimpleNamespace

    from tandem.trainer.parallel import ParallelState
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    cfg = load_config("recipes/tiny.yaml", [*tiny_overrides, "model.balance=aux_loss",
                                            "train.micro_batch_size=2", "train.grad_accum_steps=1"])
    split = ("pipeline: 2 micro-batches of 1 sequences per step, not 1 of "
             "train.micro_batch_size=2 (and the MoE aux/z-loss is taken over each)")
    for n_micro, note in ((1, ""), (2, split)):
        pstate = ParallelState(device=resolve_device("cpu"))
        pstate.pipeline = SimpleNamespace(n_micro=n_micro)
        step = TrainStep(cfg, build_model(cfg, pstate), pstate)
        assert step.aux_grad_scale == 1 / n_micro
        err = capsys.readouterr().err
        assert (note in err) if note else "aux/z-loss" not in err, err


def test_kv_cache_incremental_decode_matches_full_forward():
    model = make(K=0, qk_norm=True, attention_bias=True, partial_rotary_factor=0.5).eval()
    tokens = torch.randint(0, 97, (2, 10))
    full = model.trunk(tokens, torch.arange(10).expand(2, 10))
    cache = KVCache(model.cfg.num_layers, 2, 16, torch.float32, torch.device("cpu"))
    part1 = model.trunk(tokens[:, :6], torch.arange(6).expand(2, 6), cache)
    steps = [model.trunk(tokens[:, i : i + 1], torch.full((2, 1), i), cache) for i in range(6, 10)]
    torch.testing.assert_close(torch.cat([part1] + steps, 1), full, rtol=1e-5, atol=1e-5)


def test_param_count_grows_by_mtp_layers_only():
    base = sum(p.numel() for p in make(K=0).parameters())
    looped = make(K=4, L=2)
    mtp = sum(p.numel() for p in looped.mtp.parameters())
    assert sum(p.numel() for p in looped.parameters()) == base + mtp
    per_layer = mtp / 2
    assert math.isclose(per_layer, sum(p.numel() for p in looped.mtp.layers[0].parameters()))


@pytest.mark.parametrize("style", ["looped", "parallel"])
def test_detach_trunk_keeps_mtp_gradients_out_of_the_trunk(style):
    """mtp.detach_trunk: the MTP depths' losses train the MTP module (and the shared embedding and
    head) but send nothing into the trunk's blocks; without it they do. The main loss is
    unchanged."""
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(3))
    grads = {}
    for detach in (False, True):
        torch.manual_seed(0)
        model = TandemModel(tiny_cfg(),
                            MTPConfig(num_steps=2, num_layers=1, style=style, detach_trunk=detach))
        out = model(tokens)
        # the MTP depths only
        combine_losses(out.loss_sums, out.token_counts, [0.0, 1.0, 1.0]).backward()
        grads[detach] = {n: (p.grad.abs().sum().item() if p.grad is not None else 0.0)
                         for n, p in model.named_parameters()}
        grads[detach, "main"] = out.loss_sums[0].item()
    trunk = [n for n in grads[True] if n.startswith("layers.")]
    assert trunk and all(grads[True][n] == 0.0 for n in trunk)
    assert sum(grads[False][n] for n in trunk) > 0
    assert all(grads[True][n] > 0 for n in grads[True] if n.startswith("mtp.") and "router" not in n
               and "bias" not in n and "experts" not in n)
    if style == "looped":  # a looped step embeds its input tokens (parallel heads read h_0 only)
        assert grads[True]["embed_tokens.weight"] > 0
    assert grads[True, "main"] == grads[False, "main"]


def test_a_window_past_max_seq_len_is_refused_by_name():
    """(An IndexError from the RoPE tables before.)"""
    model = make(K=1)
    n = model.cfg.max_seq_len
    model(torch.randint(0, model.cfg.vocab_size, (1, n + 1)))  # n inputs fit
    with pytest.raises(ValueError, match=f"window of {n + 1} inputs .*model.max_seq_len={n}"):
        model(torch.randint(0, model.cfg.vocab_size, (1, n + 2)))


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("docs", [None, [[0, 0, 0, 1, 1, 1, 1, 2]]])
def test_depth_input_rows_brute_force(depth, docs):
    from tandem.models.mtp import depth_input_rows
    s = 7
    tokens = torch.arange(s + 1).unsqueeze(0)
    doc = torch.tensor(docs) if docs is not None else None
    got = depth_input_rows(tokens, doc, depth)
    want = torch.tensor([[t + depth <= s and (doc is None or bool(doc[0, t] == doc[0, t + depth]))
                          for t in range(s)]])
    assert torch.equal(got, want)
