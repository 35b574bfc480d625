"""Qwen4-Exp hyper-connections and PLE n-gram memory against transformers' qwen4_exp (the oracle):
fp32 parity of forward and gradients, n-gram ids for the real 20M-row base (without the table),
and the decode contract of models/state.py (prefill + steps, rollback, ragged rows) for PLE."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.qwen4_exp import modular_qwen4_exp as M

from tandem.models.hyper_connection import HyperConnection
from tandem.models.ple import NGramEmbedding, PLELayer, ngram_ids, ngram_tables
from tandem.models.state import DecodeCache

H, HC, LOWRANK, EMBED, KERNEL, NGRAM, HEADS, VOCAB, BASE, EOS = 16, 4, 8, 16, 4, 3, 2, 64, 97, 5


def ref_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=H, hc_count=HC, hc_lowrank=LOWRANK,
              ple_layer_ids=[1, 2],
              ple_embed_dim=EMBED, ple_conv_kernel_size=KERNEL, ngram_size=NGRAM,
              heads_per_ngram=HEADS,
              ngram_vocab_size_base=BASE, eos_token_id=EOS, num_hidden_layers=2,
              num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, moe_intermediate_size=8,
              shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    kw.update(overrides)
    return M.Qwen4ExpTextConfig(**kw)


@torch.no_grad()
def randomize(module: nn.Module, seed: int) -> None:
    """Away from the default init (zero norms, zero conv) so every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.5))


def grads(module: nn.Module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def assert_grads_close(ours: nn.Module, ref: nn.Module, atol: float):
    g_ours, g_ref = grads(ours), grads(ref)
    assert g_ours.keys() == g_ref.keys()
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], atol=atol, rtol=0, msg=n)


def assert_backward_matches(out, out_ref, x_ours, x_ref, ours: nn.Module, ref: nn.Module,
                            seed: int):
    """One random cotangent through both: input and parameter gradients agree."""
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out_ref * cot).sum().backward()
    (out * cot).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-5, rtol=0)
    assert_grads_close(ours, ref, atol=1e-5)


def tokens_with_eos(batch: int, length: int, vocab: int, eos: int, seed: int,
                    every: int = 7) -> torch.Tensor:
    """Random ids with EOS at the start of row 0, twice in a row, and every few positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    ids[ids == eos] = (eos + 1) % vocab
    ids[0, 0] = eos
    ids[:, 3::every] = eos
    ids[-1, 10:12] = eos
    return ids


# ---------------------------------------------------------------- hyper-connections


@pytest.mark.parametrize("combine", [True, False])
def test_hyper_connection_matches_reference(combine):
    ref = M.Qwen4ExpTextGatedResidual(ref_config(), use_combine=combine)
    randomize(ref, seed=1)
    ours = HyperConnection(H, HC, LOWRANK, eps=1e-6, combine=combine)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, HC * H, generator=torch.Generator().manual_seed(2))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    proj = torch.randn(H, H, generator=torch.Generator().manual_seed(3))

    if combine:
        mixed_ref, residual, w_ref = ref(x_ref)
        out_ref = residual + (torch.tanh(mixed_ref @ proj).unsqueeze(-2)
                              * w_ref.unsqueeze(-1)).flatten(-2)
        mixed, w = ours(x_ours)
        out = ours.inject(x_ours, torch.tanh(mixed @ proj), w)
        torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)
    else:
        out_ref, out = ref(x_ref), ours.mix(x_ours)
    assert out.shape == out_ref.shape
    torch.testing.assert_close(out, out_ref, atol=1e-6, rtol=0)

    assert_backward_matches(out, out_ref, x_ours, x_ref, ours, ref, seed=4)


# ---------------------------------------------------------------- n-gram ids (real 20M base)


class _IdsOut(nn.Module):
    """Stands in for the 20M-row table: returns the looked-up row ids themselves."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return ids.unsqueeze(-1)


@pytest.mark.parametrize("ple_layer_index", [0, 1])
def test_ngram_ids_match_reference_real_base(ple_layer_index):
    vocab, eos = 248320, 248044
    cfg = ref_config(vocab_size=vocab, eos_token_id=eos, heads_per_ngram=8,
                     ngram_vocab_size_base=20_000_000,
                     ple_embed_dim=16, make_ngram_vocab_size_divisible_by=128)
    ids_in = tokens_with_eos(3, 40, vocab, eos, seed=5)

    with torch.device("meta"):
        ref = M.Qwen4ExpTextNGramEmbedding(cfg, 16, layer_idx=0, ple_layer_index=ple_layer_index)
        ours = NGramEmbedding(vocab, 16, NGRAM, 8, 20_000_000, 128, cfg.seed, ple_layer_index, eos)
    assert ours.ngram_embedding.weight.shape == ref.ngram_embedding.weight.shape  # same padded rows
    ref.ngram_embedding, ours.ngram_embedding = _IdsOut(), _IdsOut()
    ref.to_empty(device="cpu")
    ours.to_empty(device="cpu")
    with torch.no_grad():  # the reference's own buffer init (_init_weights)
        ref.layer_multipliers.copy_(M._build_layer_multipliers(vocab, NGRAM, ple_layer_index,
                                                               cfg.seed))
        ref.ngram_heads_vocab_sizes.copy_(torch.tensor(ref.head_vocab_sizes))
        ref.ngram_heads_offsets.copy_(torch.tensor(ref.head_offsets))
    ours.reset_buffers()
    for name, buf in ref.named_buffers():
        assert torch.equal(ours.get_buffer(name), buf), name

    expected = ref(ids_in, None)  # [B, S, 16] row ids through the reference's own forward
    assert torch.equal(ours(ids_in), expected)

    # The pure function: a history of the 2 tokens before a position gives the whole sequence's ids.
    mult, sizes, offsets, _ = ngram_tables(vocab, NGRAM, 8, 20_000_000, 128, cfg.seed,
                                           ple_layer_index)
    for k in (2, 11, 12, 13, 25):
        window = ngram_ids(ids_in[:, k - 2:], torch.tensor(mult), torch.tensor(sizes),
                           torch.tensor(offsets), 8, eos)
        assert torch.equal(window[:, 2:], expected[:, k:]), k
    assert torch.equal(ours.ids(ids_in[:, 12:], context_bc=ids_in[:, 10:12]), expected[:, 12:])


# ---------------------------------------------------------------- PLE layer


def make_ple(seed=7, ple_layer_index=1):
    ref = M.Qwen4ExpTextPLELayer(ref_config(), layer_idx=0, ple_layer_index=ple_layer_index)
    randomize(ref, seed)
    ours = PLELayer(H, HC, EMBED, KERNEL, NGRAM, HEADS, VOCAB, BASE, 128, ref_config().seed,
                    ple_layer_index, EOS)
    ours.load_state_dict(ref.state_dict())  # buffers too: the hash constants must already agree
    return ours, ref


@pytest.mark.parametrize("with_eos", [True, False])
def test_ple_layer_matches_reference(with_eos):
    ours, ref = make_ple()
    assert not ours.conv1d.weight.eq(0).all()
    B, S = 2, 19
    ids = tokens_with_eos(B, S, VOCAB, EOS, seed=8) if with_eos else torch.randint(6, VOCAB, (B, S))
    x = torch.randn(B, S, HC * H, generator=torch.Generator().manual_seed(9))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref, ids, None)
    out = ours(x_ours, ids)
    torch.testing.assert_close(out, out_ref, atol=1e-6, rtol=0)

    assert_backward_matches(out, out_ref, x_ours, x_ref, ours, ref, seed=10)


def test_ple_reset_parameters_zeroes_conv():
    ours, _ = make_ple()
    ours.reset_parameters()
    assert ours.conv1d.weight.eq(0).all()


# -------------------------------------------------------------- decoding (models/state.py contract)


def decode_setup(B=2, T=40, ring=16, seed=11):
    ours, _ = make_ple(seed)
    ids = tokens_with_eos(B, T, VOCAB, EOS, seed=seed + 1, every=9)
    x = torch.randn(B, T, HC * H, generator=torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        full = ours(x, ids)
    cache = DecodeCache(1, B, max_len=T + 8, dtype=torch.float32, device=torch.device("cpu"),
                        ring=ring)
    return ours, ids, x, full, cache


def step(ple, cache, x, ids, first_b, row_end=None):
    """One forward over positions first_b[b] .. first_b[b] + S - 1 of every row."""
    S = ids.shape[1]
    pos = first_b[:, None] + torch.arange(S)
    cache.row_end = row_end
    with torch.no_grad():
        return ple(x, ids, pos, cache.layer(0))


def take(t, first_b, S):
    """Per-row slices t[b, first_b[b] : first_b[b] + S]."""
    idx = first_b[:, None] + torch.arange(S)
    return t.gather(1, idx.view(*idx.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))


@pytest.mark.parametrize("prefill", [5, 24])  # shorter and longer than the ring
def test_ple_decode_prefill_then_steps_equals_full(prefill):
    ple, ids, x, full, cache = decode_setup()
    B, T = ids.shape
    outs = [step(ple, cache, x[:, :prefill], ids[:, :prefill], torch.zeros(B, dtype=torch.long))]
    for t in range(prefill, T):
        outs.append(step(ple, cache, x[:, t:t + 1], ids[:, t:t + 1], torch.full((B,), t)))
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


def test_ple_decode_rollback_equals_fresh_pass():
    ple, ids, x, full, cache = decode_setup(B=3)
    P, K = 20, 4
    step(ple, cache, x[:, :P], ids[:, :P], torch.zeros(3, dtype=torch.long))
    accepted = torch.tensor([0, 2, 4])
    # A verify forward over K drafts: row b's first accepted[b] are the true tokens, the rest junk.
    junk_ids = (ids[:, P:P + K] + 17) % VOCAB
    keep = torch.arange(K)[None, :] < accepted[:, None]
    v_ids = torch.where(keep, ids[:, P:P + K], junk_ids)
    v_x = torch.where(keep[..., None], x[:, P:P + K], torch.randn(3, K, HC * H))
    out = step(ple, cache, v_x, v_ids, torch.full((3,), P))
    for b in range(3):  # the accepted prefix's outputs are already right
        torch.testing.assert_close(out[b, :accepted[b]], full[b, P:P + accepted[b]], atol=1e-5,
                                   rtol=0)
    first = P + accepted
    out = step(ple, cache, take(x, first, K), take(ids, first, K), first)
    torch.testing.assert_close(out, take(full, first, K), atol=1e-5, rtol=0)


# a ragged prefill within and beyond the ring
@pytest.mark.parametrize("lengths", [(10, 7), (24, 19)])
def test_ple_decode_ragged_rows(lengths):
    ple, ids, x, full, cache = decode_setup()
    S = max(lengths)
    row_end = torch.tensor(lengths) - 1
    junk = (ids[:, :S] + 29) % VOCAB
    pad = torch.arange(S)[None, :] > row_end[:, None]
    out = step(ple, cache, torch.where(pad[..., None], -x[:, :S], x[:, :S]),
               torch.where(pad, junk, ids[:, :S]), torch.zeros(2, dtype=torch.long), row_end)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, :n], full[b, :n], atol=1e-5, rtol=0)
    # A ragged verify-sized forward: row 1 has only 2 real tokens, its padding must not clobber the
    # ring.
    first = row_end + 1
    real = torch.tensor([4, 2])
    pad = torch.arange(4)[None, :] >= real[:, None]
    out = step(ple, cache, take(x, first, 4), torch.where(pad, EOS, take(ids, first, 4)), first,
               first + real - 1)
    for b in range(2):
        torch.testing.assert_close(out[b, :real[b]], take(full, first, 4)[b, :real[b]], atol=1e-5,
                                   rtol=0)
    first = first + real
    for _ in range(3):
        out = step(ple, cache, take(x, first, 2), take(ids, first, 2), first)
        torch.testing.assert_close(out, take(full, first, 2), atol=1e-5, rtol=0)
        first = first + 2


def test_ple_decode_ring_shorter_than_the_conv_window():
    # The ring bounds a forward's length; the layer's rings add its own look-back (9 positions) to
    # it.
    ple, ids, x, full, cache = decode_setup(ring=4)
    outs = [step(ple, cache, x[:, :3], ids[:, :3], torch.zeros(2, dtype=torch.long))]
    for t in range(3, 20, 4):
        outs.append(step(ple, cache, x[:, t:t + 4], ids[:, t:t + 4], torch.full((2,), t)))
    torch.testing.assert_close(torch.cat(outs, 1), full[:, :23], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- bf16


def test_bf16_smoke():
    ple, _ = make_ple()
    hc = HyperConnection(H, HC, LOWRANK)
    randomize(hc, seed=12)
    ids = tokens_with_eos(2, 12, VOCAB, EOS, seed=13)
    x = torch.randn(2, 12, HC * H)
    with torch.no_grad():
        ref_out = hc.inject(x, *hc(x + ple(x, ids)))
        ple16, hc16, x16 = ple.to(torch.bfloat16), hc.to(torch.bfloat16), x.to(torch.bfloat16)
        out = hc16.inject(x16, *hc16(x16 + ple16(x16, ids)))
        mixed = HyperConnection(H, HC, LOWRANK, combine=False).to(torch.bfloat16)(out)
    assert out.dtype == torch.bfloat16 and mixed.dtype == torch.bfloat16 and mixed.shape == (2, 12,
                                                                                             H)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref_out, atol=0.1, rtol=0.05)
