"""Speculative decoding: greedy identity with AR, draft logits = training logits, KV rollback, sampling."""

import pytest
import torch

from tandem.eval import spec_decode as sd
from tandem.eval.spec_decode import SpecDecoder, acceptance_metrics, generate, probs_from_logits
from tandem.eval.testing import make_agreeing, tiny_model
from tandem.models.mtp import shifted_tokens



pytestmark = pytest.mark.usefixtures("one_thread")


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 3], [40, 41, 42]]


@pytest.mark.parametrize("K,L", [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("noise", [None, 0.05, 0.0])
def test_greedy_spec_equals_ar(K, L, noise):
    model = tiny_model(K, L, seed=K * 10 + L, dtype=torch.float64)
    if noise is not None:
        make_agreeing(model, noise, seed=K + L)
    ar = generate(model, PROMPTS, 24, 0)
    sp = generate(model, PROMPTS, 24, K)
    assert [len(o) for o in ar.outputs] == [24] * len(PROMPTS)
    assert sp.outputs == ar.outputs
    a = acceptance_metrics(sp.stats)["acceptance_length"]
    assert 1.0 <= a <= K + 1
    if noise == 0.0:
        assert a > 1 + 0.8 * K  # drafts agree: acceptance is exercised (not just the bonus)
    if noise == 0.05:
        assert 1.2 < a


def test_greedy_spec_equals_ar_under_bf16_autocast():
    """The in-loop evaluator decodes under the training precision: with bf16 autocast the decoder's fp32
    hidden stores take bf16 layer outputs (a dtype mismatch once failed the first draft), and greedy
    speculative output still equals greedy autoregressive output computed under the same autocast."""
    model = make_agreeing(tiny_model(3, 1, seed=5), 0.05, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ar = generate(model, PROMPTS, 16, 0)
        sp = generate(model, PROMPTS, 16, 3)
    assert sp.outputs == ar.outputs
    assert acceptance_metrics(sp.stats)["acceptance_length"] > 1.2


def test_greedy_parallel_style_and_eos():
    model = make_agreeing(tiny_model(3, 3, style="parallel", dtype=torch.float64), 0.0)
    ar = generate(model, PROMPTS, 16, 0)
    sp = generate(model, PROMPTS, 16, 3)
    assert sp.outputs == ar.outputs
    # EOS: stop at the first occurrence of a token AR produces mid-way.
    model = make_agreeing(tiny_model(3, 1, dtype=torch.float64), 0.05, seed=3)
    ar = generate(model, PROMPTS, 24, 0)
    eos = ar.outputs[0][5]
    ar_e = generate(model, PROMPTS, 24, 0, eos_id=eos)
    sp_e = generate(model, PROMPTS, 24, 3, eos_id=eos)
    assert sp_e.outputs == ar_e.outputs
    assert ar_e.outputs[0][-1] == eos and len(ar_e.outputs[0]) <= 6


def test_num_steps_beyond_trained_k_runs_looped():
    model = make_agreeing(tiny_model(2, 1, dtype=torch.float64), 0.0)
    ar = generate(model, PROMPTS, 20, 0)
    sp = generate(model, PROMPTS, 20, 5)
    assert sp.outputs == ar.outputs
    assert acceptance_metrics(sp.stats)["acceptance_length"] > 4


def _training_logits(model, tokens):
    """Per-depth logits of the training forward (the loop of TandemModel.losses_from_hidden)."""
    b, s1 = tokens.shape
    s = s1 - 1
    pos = torch.arange(s).expand(b, s)
    h0 = model.trunk(tokens[:, :s], pos)
    out, h = [model.logits(0, h0)], h0
    for k in range(1, model.num_depths):
        h = model.mtp_step(k, h if model.mtp.chained else h0, shifted_tokens(tokens, k, s), pos)
        out.append(model.logits(k, h))
    return out


@pytest.mark.parametrize("K,L,style", [(3, 1, "looped"), (4, 2, "looped"), (2, 2, "parallel")])
@torch.no_grad()
def test_draft_logits_equal_training_logits(K, L, style):
    model = tiny_model(K, L, style=style, dtype=torch.float64, seed=5)
    g = torch.Generator().manual_seed(0)
    S = 40
    tokens = torch.randint(0, 64, (3, S + 1), generator=g)
    train_logits = _training_logits(model, tokens)
    n0 = [4, 7, 2]
    dec = SpecDecoder(model, K, 3, S + 2 * K + 4, draft_convention="tandem")  # drafting as trained
    dec.prefill([tokens[b, : n0[b]].tolist() for b in range(3)], first_tokens=tokens[torch.arange(3), n0])
    active = torch.ones(3, dtype=torch.bool)
    checked = 0
    while int(dec.m.max()) + 2 * K + 1 < S:
        m = dec.m
        force = tokens.gather(1, m.unsqueeze(1) + torch.arange(1, K + 1))
        drafts, _, logits = dec.draft(force=force, keep_logits=True)
        for k in range(1, K + 1):
            for b in range(3):
                ref = train_logits[k][b, int(m[b]) - 1]
                torch.testing.assert_close(logits[k - 1][b], ref, rtol=1e-6, atol=1e-7)
                checked += 1
        dec.verify(drafts, None)
        n = torch.randint(0, K + 1, (3,), generator=g)  # accept a random true prefix
        dec.commit(n, tokens.gather(1, (m + n + 1).unsqueeze(1)).squeeze(1), active)
    assert checked > 10 * K


@torch.no_grad()
def test_rollback_cache_equals_cache_of_accepted_prefix():
    K = 3
    model = make_agreeing(tiny_model(K, 2, dtype=torch.float64, seed=2), 0.05, seed=1)
    prompts = PROMPTS[:3]
    dec = SpecDecoder(model, K, 3, 80, draft_convention="tandem")  # per-depth caches and hidden stores
    dec.prefill(prompts)
    active = torch.ones(3, dtype=torch.bool)
    total_acc, partial = 0, False
    for _ in range(6):
        drafts, q, _ = dec.draft()
        n, nxt = dec.verify(drafts, q)
        total_acc += int(n.sum())
        partial |= bool(((n > 0) & (n < K)).any() or (n == 0).any())
        dec.commit(n, nxt, active)
    assert total_acc > 0 and partial  # both acceptances and rollbacks happened
    dec.draft()  # catch every depth up on the committed tokens
    m = dec.m
    fresh = SpecDecoder(model, K, 3, 80, draft_convention="tandem")
    fresh.prefill([dec.seq[b, : int(m[b])].tolist() for b in range(3)], first_tokens=dec.seq[torch.arange(3), m])
    fresh.draft()
    for b in range(3):
        mb = int(m[b])
        for layer in range(model.cfg.num_layers):
            torch.testing.assert_close(dec.trunk_cache.keys[layer][b, :, :mb], fresh.trunk_cache.keys[layer][b, :, :mb])
            torch.testing.assert_close(dec.trunk_cache.values[layer][b, :, :mb], fresh.trunk_cache.values[layer][b, :, :mb])
        torch.testing.assert_close(dec.h[0][b, :mb], fresh.h[0][b, :mb])
        for k in range(1, K + 1):
            v = mb - k + 1
            c, f = dec.mtp_caches[k - 1], fresh.mtp_caches[k - 1]
            torch.testing.assert_close(c.cache.keys[0][b, :, :v], f.cache.keys[0][b, :, :v])
            torch.testing.assert_close(c.cache.values[0][b, :, :v], f.cache.values[0][b, :, :v])
            if k < K:
                torch.testing.assert_close(dec.h[k][b, :v], fresh.h[k][b, :v])
    assert torch.equal(dec.seq[torch.arange(3), m + 1], fresh.seq[torch.arange(3), m + 1])  # same drafts


# --- sampling ---------------------------------------------------------------------------------------

def _chi2_pvalue(obs, exp):
    """Pearson chi-square p-value; cells with expected count < 5 are pooled."""
    obs, exp = torch.as_tensor(obs, dtype=torch.float64), torch.as_tensor(exp, dtype=torch.float64)
    impossible = exp <= 0
    if bool((obs[impossible] > 0).any()):
        return 0.0  # a token the target can never produce was sampled
    obs, exp = obs[~impossible], exp[~impossible]
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum().view(1)])
        exp = torch.cat([exp[~small], exp[small].sum().view(1)])
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty normal approximation
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / (2 / (9 * dof)) ** 0.5
        return float(0.5 * torch.erfc(torch.tensor(z / 2 ** 0.5)))


@torch.no_grad()
def _trunk_probs(model, prefixes, temperature, top_p):
    t = torch.tensor(prefixes)
    h = model.trunk(t, torch.arange(t.shape[1]).expand_as(t))
    return probs_from_logits(model.logits(0, h[:, -1]), temperature, top_p)


def _sample_check(top_p=1.0, n=3000):
    V, K, T = 8, 2, 1.0
    model = tiny_model(K, 1, vocab=V, seed=11, init_std=0.6, moe=False)
    prompt = [1, 2, 3]
    g = torch.Generator().manual_seed(1234)
    out = torch.tensor(generate(model, [prompt] * n, 3, K, temperature=T, top_p=top_p, generator=g).outputs)
    p1 = _trunk_probs(model, [prompt], T, top_p)[0]
    p2 = _trunk_probs(model, [prompt + [a] for a in range(V)], T, top_p)  # [V(t1), V(t2)]
    joint12 = p1.unsqueeze(1) * p2
    p3 = _trunk_probs(model, [prompt + [a, b] for a in range(V) for b in range(V)], T, top_p)
    marg3 = (joint12.reshape(-1, 1) * p3).sum(0)
    obs12 = torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V)
    obs3 = torch.bincount(out[:, 2], minlength=V)
    return _chi2_pvalue(obs12, n * joint12.flatten()), _chi2_pvalue(obs3, n * marg3)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_speculative_sampling_matches_trunk_distribution(top_p):
    p12, p3 = _sample_check(top_p)
    assert p12 > 1e-3 and p3 > 1e-3, (p12, p3)


def test_broken_acceptance_rule_fails_the_same_test(monkeypatch):
    def always_accept(p, q, drafts, u):
        k = drafts.shape[1]
        return torch.full((drafts.shape[0],), k, dtype=torch.long), p[:, k]

    monkeypatch.setattr(sd, "speculative_accept", always_accept)
    p12, p3 = _sample_check()
    assert min(p12, p3) < 1e-8, (p12, p3)


def test_budget_exact_counting_hand_computed():
    """Drafts always agree (K=3): prefill emits 1 token, round 1 emits 4 (3 accepted). Round 2 has
    room for max_new_tokens - 5 tokens: with 6 it emits 1 (0 accepted, not the 3 committed), with 7
    it emits 2 (1 accepted). An EOS as the 3rd output token ends round 1 after 2 emitted (1 accepted)."""
    model = make_agreeing(tiny_model(3, 1, dtype=torch.float64), 0.0)
    prompt = [PROMPTS[0]]
    for budget, accepted, pos in [(6, 3, [1.0 / 2, 1.0 / 2, 1.0 / 2]), (7, 4, [1.0, 1.0 / 2, 1.0 / 2])]:
        res = generate(model, prompt, budget, 3)
        assert res.outputs == generate(model, prompt, budget, 0).outputs and len(res.outputs[0]) == budget
        assert int(res.stats.rounds[0]) == 2 and int(res.stats.accepted[0]) == accepted
        m = acceptance_metrics(res.stats)
        assert m["acceptance_length"] == 1 + accepted / 2 == res.decoded_tokens / 2
        assert [m[f"accept_rate/pos_{i}"] for i in (1, 2, 3)] == pos
        assert m["draft_acceptance_rate"] == accepted / 6
    prompt, ar = next(([p], o) for p, o in zip(PROMPTS, generate(model, PROMPTS, 12, 0).outputs)
                      if o[2] not in o[:2])
    res = generate(model, prompt, 12, 3, eos_id=ar[2])
    assert res.outputs == [ar[:3]]
    assert int(res.stats.rounds[0]) == 1 and int(res.stats.accepted[0]) == 1
    assert acceptance_metrics(res.stats)["acceptance_length"] == 2.0
    assert [int(x) for x in res.stats.accepted_at[0]] == [1, 0, 0]


def test_acceptance_length_is_decoded_tokens_per_round():
    model = make_agreeing(tiny_model(3, 1, dtype=torch.float64), 0.05, seed=3)
    res = generate(model, PROMPTS, 11, 3)
    assert int(res.stats.accepted.sum()) + int(res.stats.rounds.sum()) == res.decoded_tokens
