"""QSA (indexed attention): parity with transformers' Qwen4-Exp, mask form == gather form, decoding
and rollback == a fresh full pass, and the indexer's DeepSeek-V3.2 training signals (KL loss,
recall)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tandem.models.qsa import IndexedAttention
from tandem.models.qsa_loss import indexer_kl, measuring_recall
from tandem.models.qsa_tokens import gather_attend, token_mask
from tandem.models.state import DecodeCache

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, IDX_HEADS, IDX_DIM, BUDGET, RATIO = 32, 4, 2, 16, 2, 16, 8, 4
B, S = 2, 40


def make_qsa(seed: int = 1, budget: int = BUDGET, form: str = "mask",
             indexer_loss_coef: float = 0.0) -> IndexedAttention:
    """Random weights (larger than init so differences show). The indexer's query heads are close to
    its key head, so block scores are positive and distinct: no top-k ties for the reference to
    break its way."""
    torch.manual_seed(seed)
    attn = IndexedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 0.5, 10000.0, 64, 1e-6, IDX_HEADS,
                            IDX_DIM, budget, RATIO, form=form,
                            indexer_loss_coef=indexer_loss_coef)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
        w = attn.indexer.index_qk_proj.weight.view(IDX_HEADS + 1, IDX_DIM, HIDDEN)
        w[:-1] = w[-1] + 0.3 * w[:-1]
    return attn


def inputs(seed: int = 1, s: int = S):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, s, HIDDEN, generator=g) + 1.5 * torch.randn(HIDDEN, generator=g)
    return x, torch.arange(s).expand(B, s)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def grads(module, x, y, g):
    module.zero_grad(set_to_none=True)
    x.grad = None
    (y * g).sum().backward()
    out = {n: p.grad.clone() if p.grad is not None else None for n, p in module.named_parameters()}
    out["<input>"] = x.grad.clone()
    return out


def scores_and_selection(attn, x, pos):
    q_idx, raw = attn.indexer(x, pos, attn.rotary)
    n = x.shape[1] // RATIO
    scores = attn._block_scores(q_idx, raw[:, : n * RATIO], pos[:, : n * RATIO: RATIO])
    return scores, attn.select_blocks(scores, pos)


# ---- parity with transformers --------------------------------------------------------------------

@pytest.mark.parametrize("form", ["mask", "gather"])
def test_parity_with_transformers(form):
    import transformers as T
    from transformers.models.qwen4_exp import modeling_qwen4_exp as M

    cfg = T.Qwen4ExpTextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1, layer_types=["indexed_attention"], max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        indexer_n_heads=IDX_HEADS, indexer_kv_heads=1, indexer_head_dim=IDX_DIM,
        indexer_budget=BUDGET,
        indexer_compress_ratio=RATIO, vocab_size=64, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    ours = make_qsa(form=form)
    ref = M.Qwen4ExpTextAttention(cfg, 0)
    assert sorted(dict(ref.named_parameters())) == sorted(dict(ours.named_parameters()))
    ref.load_state_dict(ours.state_dict())

    x, pos = inputs()
    # Precondition: no near-tie at any query's top-k boundary (the reference breaks ties its own
    # way).
    scores, _ = scores_and_selection(ours, x, pos)
    complete = (pos + 1) // RATIO
    ranked = scores.masked_fill(torch.arange(S // RATIO) >= complete[..., None],
                                -1).sort(-1, descending=True).values
    k = (BUDGET // RATIO)
    boundary = complete > k
    assert (ranked[..., k - 1] - ranked[..., k])[boundary].min() > 1e-3

    rope = M.Qwen4ExpTextRotaryEmbedding(cfg)
    # the three mrope rows equal: plain text positions
    cos, sin = rope(x, pos[None].expand(3, B, S))
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)
    g = torch.randn(B, S, HIDDEN)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, _ = ref(x_ref, (cos, sin), causal)
    y_ours = ours(x_ours, pos)
    assert rel(y_ours, y_ref) < 1e-5
    g_ref, g_ours = grads(ref, x_ref, y_ref, g), grads(ours, x_ours, y_ours, g)
    for name, want in g_ref.items():
        # the indexer: the top-k selection carries no gradient, in either implementation
        if want is None:
            assert g_ours[name] is None, name
        else:
            assert rel(g_ours[name], want) < 1e-4, name


# ---- the two training forms ----------------------------------------------------------------------

@pytest.mark.parametrize("dense", [False, True])
def test_mask_form_equals_gather_form(dense):
    x, pos = inputs(2)
    g = torch.randn(B, S, HIDDEN)
    results = []
    # 2000: many chunks
    for form, chunk_elems in (("mask", 1 << 26), ("gather", 1 << 26), ("gather", 2000)):
        attn = make_qsa(3, form=form, indexer_loss_coef=0.5)
        attn.chunk_elems = chunk_elems
        xi = x.clone().requires_grad_()
        y = attn(xi, pos, dense=dense)
        results.append((y, grads(attn, xi, y, g), attn.last_indexer_loss))
    (y0, g0, l0) = results[0]
    for y, gr, loss in results[1:]:
        assert rel(y, y0) < 1e-5
        assert abs(loss - l0) < 1e-6
        for name, want in g0.items():
            assert rel(gr[name], want) < 1e-5, name


def test_auto_form_threshold():
    attn = make_qsa(form="auto")
    assert not attn._use_gather(1, 4096)            # 2^24 mask elements: the fused masked kernel
    assert attn._use_gather(1, 16384)               # 2^28: gather
    attn.budget = 8192
    assert not attn._use_gather(1, 16384)           # candidates cover half the sequence: mask


def test_selection_is_a_top_k_and_ties_break_to_earlier_blocks():
    attn = make_qsa()
    scores = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 1.0], [3.0, 0.0, 0.0, 5.0]]])
    at = torch.tensor([[7, 15, 14]])  # 2, 4 and 3 complete blocks
    blocks, count = attn.select_blocks(scores, at)
    assert count.tolist() == [[2, 2, 2]]
    assert blocks.tolist() == [[[0, 1], [1, 3], [0, 1]]]  # block 3 is not complete at position 14


# ---- decoding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_token_by_token_equals_full_forward(cache_dtype):
    """Also an fp32 layer under a bf16 cache (the fp32 drafter of a frozen bf16 trunk: the cache
    takes the embedding's dtype): what the layer stores keeps its own dtype, so it selects on the
    indexer keys it trained on, not on bf16-rounded ones."""
    attn = make_qsa(4).eval()
    x, pos = inputs(4)
    with torch.no_grad():
        full = attn(x, pos)
        cache = DecodeCache(1, B, 64, cache_dtype, torch.device("cpu")).layer(0)
        prefill = 13
        steps = [attn(x[:, :prefill], pos[:, :prefill], cache)]
        for t in range(prefill, S):
            steps.append(attn(x[:, t:t + 1], pos[:, t:t + 1], cache))
    assert rel(torch.cat(steps, 1), full) < 1e-5
    stored = cache.cache.buffers[0]
    assert {name: b.dtype for name, b in stored.items()} == {"qsa_index_keys": torch.float32}


def test_ragged_rows_decode_like_their_own_full_forward():
    """Row 1 has 10 prompt tokens padded to 13 (positions continue past its end); it then resumes at
    position 10 while row 0 is at 13, so one forward covers different positions per row."""
    attn = make_qsa(10).eval()
    x, pos = inputs(10)
    with torch.no_grad():
        full = attn(x, pos)
        state = DecodeCache(1, B, 64, torch.float32, torch.device("cpu"))
        cache = state.layer(0)
        state.row_end = torch.tensor([12, 9])
        prompt = x[:, :13].clone()
        prompt[1, 10:] = torch.randn(3, HIDDEN)  # padding, whose keys later forwards overwrite
        attn(prompt, pos[:, :13], cache)
        state.row_end = None
        starts, outs = torch.tensor([13, 10]), []
        for step in range(0, 24, 3):
            p = starts[:, None] + step + torch.arange(3)
            outs.append(attn(x[torch.arange(B)[:, None], p], p, cache))
    got = torch.cat(outs, 1)
    assert rel(got[0], full[0, 13:37]) < 1e-5 and rel(got[1], full[1, 10:34]) < 1e-5


def test_verify_then_rollback_equals_fresh_pass():
    attn = make_qsa(5).eval()
    x, pos = inputs(5)
    drafts = torch.randn(B, 4, HIDDEN)  # rejected tokens whose keys the rollback must not leak
    with torch.no_grad():
        cache = DecodeCache(1, B, 64, torch.float32, torch.device("cpu")).layer(0)
        attn(x[:, :22], pos[:, :22], cache)
        # verify 4 tokens at positions 22..25 (block 5 = 20..23 completes inside), accept the first
        # one
        attn(torch.cat([x[:, 22:23], drafts[:, 1:]], 1), pos[:, 22:26], cache)
        # the next verify forward, from position 23
        outs = [attn(x[:, 23:27], pos[:, 23:27], cache)]
        for t in range(27, S):
            outs.append(attn(x[:, t:t + 1], pos[:, t:t + 1], cache))
        full = attn(x, pos)
    assert rel(torch.cat(outs, 1), full[:, 23:]) < 1e-5


# ---- the indexer's training signals --------------------------------------------------------------

@pytest.mark.parametrize("dense", [False, True])
def test_indexer_loss_trains_only_the_indexer(dense):
    x, pos = inputs(6)
    g = torch.randn(B, S, HIDDEN)
    out = {}
    for coef in (0.0, 1.0):
        attn = make_qsa(6, indexer_loss_coef=coef).train()
        xi = x.clone().requires_grad_()
        y = attn(xi, pos, dense=dense)
        out[coef] = (y.detach(), grads(attn, xi, y, g))
        if coef:
            assert attn.last_indexer_loss.item() > 0 and not attn.last_indexer_loss.requires_grad
    assert torch.equal(out[0.0][0], out[1.0][0])  # the loss changes no return value
    for name, want in out[0.0][1].items():
        got = out[1.0][1][name]
        if name.startswith("indexer."):
            assert want is None and got is not None and got.abs().sum() > 0, name
        else:
            assert torch.equal(got, want), name


def test_kl_is_zero_when_the_indexer_matches_the_target():
    mass = torch.rand(2, 3, 5) + 0.1
    allowed = torch.rand(2, 3, 5) > 0.4
    allowed[0, 0] = False  # a query without blocks does not count
    target = mass.masked_fill(~allowed, 0) / mass.masked_fill(~allowed, 0).sum(-1, keepdim=True)
    assert indexer_kl(torch.log(mass) + 3.0, mass, allowed).abs() < 1e-6  # shift-invariant softmax
    scores = torch.randn(2, 3, 5)
    logq = scores.masked_fill(~allowed, -math.inf).log_softmax(-1)
    per_query = torch.where(allowed, target * (target.log() - logq), 0.0).sum(-1)
    want = per_query[allowed.any(-1)].mean()
    assert torch.allclose(indexer_kl(scores, mass, allowed), want, atol=1e-6)


@pytest.mark.parametrize("dense", [False, True])
def test_indexer_loss_and_recall_match_a_direct_computation(dense):
    attn = make_qsa(7, indexer_loss_coef=1.0).train()
    attn.chunk_elems = 3000
    x, pos = inputs(7)
    with measuring_recall():
        attn(x, pos, dense=dense)
    with torch.no_grad():
        q, k, _, _ = attn._qkv(x, pos)
        logits = q @ k.repeat_interleave(HEADS // KV_HEADS, 1).transpose(-1,
                                                                         -2) / math.sqrt(HEAD_DIM)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        scores, (blocks, count) = scores_and_selection(attn, x, pos)
        selected = token_mask(attn.compress_ratio, blocks, count, pos, S)
        p_dense = logits.masked_fill(~causal, -math.inf).softmax(-1)  # [B, H, S, S]
        p_main = p_dense if dense else logits.masked_fill(~selected[:, None], -math.inf).softmax(-1)
        kls, recall = [], []
        for b in range(B):
            for t in range(S):
                recall.append((p_dense[b, :, t] * selected[b, t]).sum(-1).mean())
                n = (t + 1) // RATIO
                cand = list(range(n)) if dense else blocks[b, t, : count[b, t]].tolist()
                if not cand:
                    continue
                mass = torch.stack([p_main[b, :, t, j * RATIO:(j + 1) * RATIO].sum() for j in cand])
                target, logq = mass / mass.sum(), scores[b, t, cand].log_softmax(-1)
                kls.append((target * (target.log() - logq)).sum())
    assert abs(attn.last_indexer_loss - torch.stack(kls).mean()) < 1e-5
    assert abs(attn.last_recall - torch.stack(recall).mean()) < 1e-5
    assert attn.last_recall < 0.999


def test_recall_is_one_when_the_budget_covers_the_sequence():
    attn = make_qsa(8, budget=48).eval()
    x, pos = inputs(8)
    with torch.no_grad(), measuring_recall():
        attn(x, pos)
    assert abs(attn.last_recall.item() - 1.0) < 1e-6


# ---- precision and construction ------------------------------------------------------------------

def _fp32_and_bf16(form, budget):
    """One QSA module's fp32 and bf16 copies on the same input: (output, indexer loss, recall,
    parameter gradients, input gradient) of each, training with the indexer loss."""
    runs = []
    attn = make_qsa(9, budget, form=form, indexer_loss_coef=1.0).train()
    x, pos = inputs(9)
    for dtype in (torch.float32, torch.bfloat16):
        module = copy.deepcopy(attn).to(dtype)
        xd = x.to(dtype).detach().requires_grad_()
        with measuring_recall():
            y = module(xd, pos)
        y.float().pow(2).mean().backward()
        runs.append((y.float(), module.last_indexer_loss.float(), float(module.last_recall),
                     {n: p.grad.float() for n, p in module.named_parameters()}, xd.grad.float()))
    return runs


@pytest.mark.parametrize("form", ["mask", "gather"])
def test_bf16_close_to_fp32(form):
    """bf16 against the same module in fp32, per token. With a budget that covers the sequence no
    selection can flip, and every output row, the indexer loss and every gradient stay within bf16's
    precision (measured 0.5% / 0.4% / 1.1% of their scale); at a budget of 8 a bf16 rounding can
    flip a block at a selection's edge (the worst row then moves 15%), so there the typical row and
    the recall are compared."""
    (y32, l32, _, g32, x32), (y16, l16, r16, g16, x16) = _fp32_and_bf16(form, 48)
    assert r16 == 1.0
    per_row = (y16 - y32).abs().amax(-1) / y32.abs().amax()
    assert per_row.max() < 2e-2, per_row.max()
    assert abs(l16 - l32) < 1e-2 * l32
    assert rel(x16, x32) < 2e-2
    for name, g in g32.items():
        assert rel(g16[name], g) < 3e-2, name
    (y32, l32, r32, _, _), (y16, l16, r16, g16, _) = _fp32_and_bf16(form, BUDGET)
    per_row = (y16 - y32).abs().amax(-1) / y32.abs().amax()
    assert per_row.median() < 1e-2 and abs(r16 - r32) < 1e-2 and abs(l16 - l32) < 2e-2 * l32
    assert all(torch.isfinite(g).all() for g in g16.values())


def test_block_scores_stay_fp32_under_autocast():
    attn = make_qsa()
    q, k = torch.randn(1, 6, IDX_HEADS, IDX_DIM), torch.randn(1, 3, IDX_DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = attn.indexer.block_scores(q, k)
    assert under.dtype == torch.float32 and torch.equal(under, attn.indexer.block_scores(q, k))


def test_meta_construction_then_materialise():
    with torch.device("meta"):
        attn = IndexedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 0.5, 10000.0, 64, 1e-6,
                                IDX_HEADS, IDX_DIM, BUDGET, RATIO)
    attn.to_empty(device="cpu")
    attn.rotary.reset_buffers()
    assert not any(n.startswith("rotary") for n in attn.state_dict())  # non-persistent tables
    assert torch.equal(attn.rotary.cos, make_qsa().rotary.cos)


def test_bf16_gather_form_logits_in_fp32_and_agrees_with_mask_form():
    """In bf16 the gather form computes logits, softmax and sum in fp32 from the bf16 rows, as the
    mask form's SDPA does, so `auto`'s switch of form (at MASK_ELEMS_LIMIT) does not change the
    numerics."""
    g = torch.Generator().manual_seed(5)
    b, c, s, L, h, kvh, d = 1, 6, 12, 12, 4, 2, 16
    # logits of tens: bf16 steps of 1/8+
    q = (4 * torch.randn(b, c, h, d, generator=g)).to(torch.bfloat16)
    k = (4 * torch.randn(b, s, kvh, d, generator=g)).to(torch.bfloat16)
    v = torch.randn(b, s, kvh, d, generator=g).to(torch.bfloat16)
    idx = torch.randperm(s, generator=g)[:L].expand(b, c, L).contiguous()
    ok = torch.ones(b, c, L, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gather_attend(q, idx, ok, k, v)
    # exact attention over the same bf16 rows (fp64): only the output's bf16 rounding may remain
    q5 = q.double().view(b, c, kvh, h // kvh, d)
    kg, vg = k.double()[:, idx[0, 0]], v.double()[:, idx[0, 0]]
    att = (torch.einsum("bckgd,blkd->bckgl", q5, kg) * d ** -0.5).softmax(-1)
    want = torch.einsum("bckgl,blkd->bckgd", att, vg).reshape(b, c, h * d)
    assert out.dtype == torch.bfloat16
    ulp = want.abs().clamp(min=1e-3) * 2.0 ** -8  # half a bf16 step (8 significant bits), doubled
    assert ((out.double() - want).abs()
            <= ulp).all(), float(((out.double() - want).abs() / ulp).max())
    # the whole module in bf16: the two forms agree within the output's bf16 rounding
    x, pos = inputs(4)
    ys = []
    for form in ("mask", "gather"):
        attn = make_qsa(4, form=form).to(torch.bfloat16)
        with torch.no_grad():
            ys.append(attn(x.to(torch.bfloat16), pos).float())
    assert rel(ys[1], ys[0]) < 2.0 ** -7, rel(ys[1], ys[0])
