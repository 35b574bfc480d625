"""Block verification (eval/block_verify.py): exact output distribution (by enumeration, and by chi-square
tests through the rule and through the decoder, each with a broken rule that the same test rejects),
expected accepted length >= token-wise verification's (computed exactly), greedy identity, wiring."""

import itertools
import types

import pytest
import torch

from tandem.eval import spec_decode as sd
from tandem.eval.block_verify import block_accept, block_thresholds
from tandem.eval.spec_decode import generate, probs_from_logits, speculative_accept
from tandem.eval.testing import make_agreeing, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


# --- small-vocabulary draft/target tables ------------------------------------------------------------

def _tables(V, K, seed, sharp=2.0):
    """Random target tables P[i] [V^i, V] (i = 0..K) and draft tables Q[i] [V^i, V] (i = 0..K-1): row
    `prefix` (base-V index of the i tokens after the context) holds the next-token distribution."""
    g = torch.Generator().manual_seed(seed)
    P = [torch.softmax(sharp * torch.randn(V ** i, V, generator=g, dtype=F64), -1) for i in range(K + 1)]
    Q = [torch.softmax(sharp * torch.randn(V ** i, V, generator=g, dtype=F64), -1) for i in range(K)]
    return P, Q


def _with_zeros(T, seed):
    """The tables with one random token per row zeroed and renormalised (as top-p truncation does)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in T:
        t = t.clone()
        t.scatter_(1, torch.randint(0, t.shape[1], (t.shape[0], 1), generator=g), 0.0)
        out.append(t / t.sum(1, keepdim=True))
    return out


def _row(tokens, V):
    """Base-V index of each row's prefix tokens [N, i]."""
    i = tokens.shape[1]
    return (tokens * V ** torch.arange(i - 1, -1, -1)).sum(1) if i else torch.zeros(tokens.shape[0], dtype=torch.long)


def _verify_inputs(P, Q, X):
    """(p [N,K+1,V], q [N,K,V]) along the draft sequences X [N,K]."""
    V, K = P[0].shape[1], X.shape[1]
    p = torch.stack([P[i][_row(X[:, :i], V)] for i in range(K + 1)], 1)
    q = torch.stack([Q[i][_row(X[:, :i], V)] for i in range(K)], 1)
    return p, q


def _all_drafts(P, Q):
    """Every draft sequence X [V^K, K] with its probability under the drafter, and the verify inputs."""
    V, K = P[0].shape[1], len(Q)
    X = torch.tensor(list(itertools.product(range(V), repeat=K)))
    p, q = _verify_inputs(P, Q, X)
    return X, q.gather(-1, X.unsqueeze(-1)).squeeze(-1).prod(1), p, q


def _tau_probs(h):
    """[N, K+1] exact P(tau = i | drafts) for tau = the last i with u_i < h_i (0 if none)."""
    N, K = h.shape
    first = torch.ones(N, 1, dtype=h.dtype)
    return torch.cat([first, h], 1) * torch.stack([(1 - h[:, i:]).prod(1) for i in range(K + 1)], 1)


def _exact_output(P, Q, thresholds=None, accept=block_accept):
    """(exact distribution over y in V^(K+1), the target's): drafts ~ Q, verification, the next token
    from the returned distribution, then sampling from the target until K+1 tokens. Rules of the form
    tau = last i with u_i < h_i; the next-token distribution for each tau comes from `accept` itself
    (u_tau = 0 and u_j = 1 past it force tau)."""
    V, K = P[0].shape[1], len(Q)
    X, qx, p, q = _all_drafts(P, Q)
    Y = torch.tensor(list(itertools.product(range(V), repeat=K + 1)))
    step = torch.stack([P[i][_row(Y[:, :i], V)].gather(1, Y[:, i : i + 1]).squeeze(1) for i in range(K + 1)])
    h = (thresholds or (lambda p, q, X: block_thresholds(p, q, X)[1]))(p, q, X)
    pt = _tau_probs(h)
    out = torch.zeros(len(Y), dtype=F64)
    for tau in range(K + 1):
        u = torch.ones(len(X), K, dtype=F64)
        if tau:
            u[:, tau - 1] = 0.0
        n, dist = accept(p, q, X, u)
        assert bool(((n == tau) | (pt[:, tau] == 0)).all())
        prefix_ok = (Y[:, :tau].unsqueeze(0) == X[:, :tau].unsqueeze(1)).all(-1)  # [N, |Y|]
        out += (qx * pt[:, tau]).unsqueeze(1).mul(prefix_ok).mul(dist[:, Y[:, tau]]).sum(0) * step[tau + 1 :].prod(0)
    return out, step.prod(0)


def _expected_lengths(P, Q):
    """Exact E[accepted drafts] of token-wise and of block verification on the same drafts (X ~ Q)."""
    X, qx, p, q = _all_drafts(P, Q)
    K = X.shape[1]
    pd = p[:, :K].gather(-1, X.unsqueeze(-1)).squeeze(-1)
    qd = q.gather(-1, X.unsqueeze(-1)).squeeze(-1)
    ratio = torch.where(qd > 0, pd / qd.clamp(min=1e-300), torch.zeros_like(pd)).clamp(max=1.0)
    token = (ratio.cumprod(1).sum(1) * qx).sum()  # P(n >= i | X) = prod_{j<=i} min(1, p/q)
    block = ((_tau_probs(block_thresholds(p, q, X)[1]) * torch.arange(K + 1)).sum(1) * qx).sum()
    return float(token), float(block)


# --- deliberately broken rule: the negative control ----------------------------------------------------

def _naive_thresholds(p, q, X):
    """h_i = w_i: "keep the longest prefix whose capped likelihood ratio beats a uniform" -- drops
    the residual-mass term of the real threshold. Not distribution-preserving."""
    return block_thresholds(p, q, X)[0][:, 1:]


def naive_block_accept(p, q, drafts, u):
    B, K = drafts.shape
    V = p.shape[-1]
    w = block_thresholds(p, q, drafts)[0]
    tau = torch.where(u.to(w.dtype) < w[:, 1:], torch.arange(1, K + 1), 0).amax(1)
    p_t = p.gather(1, tau.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    q_t = q.gather(1, tau.clamp(max=K - 1).view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    resid = (w.gather(1, tau.view(B, 1)) * p_t - q_t).clamp(min=0.0)
    total = resid.sum(-1, keepdim=True)
    return tau, torch.where((tau < K).unsqueeze(-1) & (total > 0), resid / total.clamp(min=1e-30), p_t)


# --- exact distribution ---------------------------------------------------------------------------------

CASES = [(3, 2, 0, 2.0), (4, 2, 1, 1.0), (4, 3, 2, 2.0), (3, 3, 3, 0.5)]


@pytest.mark.parametrize("V,K,seed,sharp", CASES)
@pytest.mark.parametrize("zeros", [False, True])
def test_output_distribution_is_the_target_exactly(V, K, seed, sharp, zeros):
    """Enumerating every draft sequence and acceptance count: drafts, block verification, the
    next token, then the target's own continuation give exactly the target's distribution over the
    K+1 tokens (to rounding). The naive rule fails the same computation by a wide margin."""
    P, Q = _tables(V, K, seed, sharp)
    if zeros:
        P, Q = _with_zeros(P, seed + 10), _with_zeros(Q, seed + 20)
    out, target = _exact_output(P, Q)
    assert abs(float(out.sum()) - 1) < 1e-12
    assert float((out - target).abs().max()) < 1e-12
    bad, _ = _exact_output(P, Q, _naive_thresholds, naive_block_accept)
    assert 0.5 * float((bad - target).abs().sum()) > 0.01


# --- chi-square: the rule alone, and through the decoder ------------------------------------------------

def _chi2_pvalue(obs, exp):
    """Pearson chi-square p-value; cells with expected count < 5 are pooled into one."""
    obs, exp = torch.as_tensor(obs, dtype=F64), torch.as_tensor(exp, dtype=F64)
    impossible = exp <= 1e-12 * exp.sum()
    if bool((obs[impossible] > 0).any()):
        return 0.0  # the target can never produce this
    obs, exp = obs[~impossible], exp[~impossible]
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum().view(1)])
        exp = torch.cat([exp[~small], exp[small].sum().view(1)])
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty normal approximation
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / (2 / (9 * dof)) ** 0.5
        return float(0.5 * torch.erfc(torch.tensor(z / 2 ** 0.5)))


def _rule_pvalue(accept, V=4, K=2, seed=1, n=40000):
    """Sample n draft blocks from Q, verify with `accept`, draw the next token, continue from P up to
    K+1 tokens; chi-square of the K+1-token joint against the target's."""
    P, Q = _tables(V, K, seed, 1.0)
    g = torch.Generator().manual_seed(seed + 100)
    X = torch.zeros(n, K, dtype=torch.long)
    for i in range(K):
        X[:, i] = torch.multinomial(Q[i][_row(X[:, :i], V)], 1, generator=g).squeeze(1)
    p, q = _verify_inputs(P, Q, X)
    tau, dist = accept(p, q, X, torch.rand(n, K, generator=g, dtype=F64))
    y = torch.multinomial(dist, 1, generator=g).squeeze(1)
    out = torch.zeros(n, K + 1, dtype=torch.long)
    for i in range(K + 1):  # accepted drafts, then the drawn token, then the target's continuation
        cont = torch.multinomial(P[i][_row(out[:, :i], V)], 1, generator=g).squeeze(1)
        out[:, i] = torch.where(i < tau, X[:, min(i, K - 1)], torch.where(i == tau, y, cont))
    _, target = _exact_output(P, Q)
    return _chi2_pvalue(torch.bincount(_row(out, V), minlength=V ** (K + 1)), n * target)


def test_block_rule_sampling_matches_target_chi_square():
    p = _rule_pvalue(block_accept)
    assert p > 1e-3, p
    print(f"block rule: chi-square p = {p:.3g}")


def test_broken_rule_fails_the_same_chi_square():
    p = _rule_pvalue(naive_block_accept)
    assert p < 1e-8, p
    print(f"naive rule: chi-square p = {p:.3g}")


@torch.no_grad()
def _trunk_probs(model, prefixes, temperature, top_p):
    t = torch.tensor(prefixes)
    h = model.trunk(t, torch.arange(t.shape[1]).expand_as(t))
    return probs_from_logits(model.logits(0, h[:, -1]), temperature, top_p)


def _decoder_pvalues(top_p=1.0, n=16000):
    """generate(verify="block") with K=2 on an 8-token model: the first token comes from prefill, the
    next two from the first verify round. Chi-square of the (t1, t2), (t2, t3) and (t1, t2, t3) joints
    against the trunk's exact ones (computed over every 3-token continuation)."""
    V, K, T = 8, 2, 1.0
    model = tiny_model(K, 1, vocab=V, seed=11, init_std=0.6, moe=False)
    prompt = [1, 2, 3]
    g = torch.Generator().manual_seed(4321)
    out = torch.tensor(generate(model, [prompt] * n, 3, K, temperature=T, top_p=top_p, generator=g,
                                verify="block").outputs)
    p1 = _trunk_probs(model, [prompt], T, top_p)[0].double()
    p2 = _trunk_probs(model, [prompt + [a] for a in range(V)], T, top_p).double()
    p3 = _trunk_probs(model, [prompt + [a, b] for a in range(V) for b in range(V)], T, top_p).double()
    joint = (p1.view(V, 1, 1) * p2.view(V, V, 1) * p3.view(V, V, V))
    obs12 = torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V)
    obs23 = torch.bincount(out[:, 1] * V + out[:, 2], minlength=V * V)
    obs123 = torch.bincount((out[:, 0] * V + out[:, 1]) * V + out[:, 2], minlength=V ** 3)
    return (_chi2_pvalue(obs12, n * joint.sum(2).flatten()), _chi2_pvalue(obs23, n * joint.sum(0).flatten()),
            _chi2_pvalue(obs123, n * joint.flatten()))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_block_decoding_matches_trunk_distribution(top_p):
    ps = _decoder_pvalues(top_p)
    assert min(ps) > 1e-3, ps
    print("decoder, block, top_p=%g: chi-square p = %.3g (t1,t2), %.3g (t2,t3), %.3g (t1,t2,t3)" % (top_p, *ps))


def test_broken_rule_fails_the_decoder_chi_square(monkeypatch):
    monkeypatch.setattr(sd, "block_accept", naive_block_accept)
    ps = _decoder_pvalues()
    assert min(ps) < 1e-8, ps
    print("decoder, naive rule: chi-square p = %.3g (t1,t2), %.3g (t2,t3), %.3g (t1,t2,t3)" % ps)


# --- expected accepted length -----------------------------------------------------------------------------

@pytest.mark.parametrize("V,K", [(3, 2), (3, 3), (4, 2), (4, 3)])
def test_expected_accepted_length_at_least_token_wise_exact(V, K):
    """Exact expectations over every draft sequence (X ~ Q): block >= token-wise on the same drafts,
    for random tables of several sharpnesses, with and without zero-probability tokens."""
    for seed in range(4):
        for sharp in (0.5, 1.0, 2.0, 4.0):
            P, Q = _tables(V, K, seed, sharp)
            for zeros in (False, True):
                if zeros:
                    P, Q = _with_zeros(P, seed + 10), _with_zeros(Q, seed + 20)
                token, block = _expected_lengths(P, Q)
                assert block >= token - 1e-12, (V, K, seed, sharp, zeros, token, block)


def test_block_strictly_longer_in_constructed_case():
    """The paper's example, i.i.d. positions: drafter (1/3, 2/3), target (2/3, 1/3) (a third token
    that neither proposes, so V=3), K=2. Token-wise accepts 2/3 + (2/3)^2 = 10/9 drafts on average;
    block verification keeps (B, A) whole, since A pays back the ratio B lost: 11/9."""
    V, K = 3, 2
    tgt, drf = torch.tensor([2 / 3, 1 / 3, 0.0], dtype=F64), torch.tensor([1 / 3, 2 / 3, 0.0], dtype=F64)
    P = [tgt.expand(V ** i, V) for i in range(K + 1)]
    Q = [drf.expand(V ** i, V) for i in range(K)]
    token, block = _expected_lengths(P, Q)
    assert abs(token - 10 / 9) < 1e-12 and abs(block - 11 / 9) < 1e-12, (token, block)
    out, target = _exact_output(P, Q)
    assert float((out - target).abs().max()) < 1e-12
    # K = 3, same tables: the gain grows with the block
    P3, Q3 = P + [tgt.expand(V ** 3, V)], Q + [drf.expand(V ** 2, V)]
    token3, block3 = _expected_lengths(P3, Q3)
    assert block3 > token3 + 0.1, (token3, block3)
    print(f"K=2: token {token:.6f} (10/9), block {block:.6f} (11/9); K=3: token {token3:.6f}, block {block3:.6f}")


# --- special cases ----------------------------------------------------------------------------------------

def test_k1_is_token_wise_speculative_sampling():
    """With one draft the block rule is the token-wise rule: same acceptance, same next-token distribution."""
    g = torch.Generator().manual_seed(0)
    B, V = 2000, 6
    p = torch.softmax(2 * torch.randn(B, 2, V, generator=g, dtype=F64), -1)
    q = torch.softmax(2 * torch.randn(B, 1, V, generator=g, dtype=F64), -1)
    drafts = torch.multinomial(q[:, 0], 1, generator=g)
    u = torch.rand(B, 1, generator=g, dtype=F64)
    n_b, d_b = block_accept(p, q, drafts, u)
    n_t, d_t = speculative_accept(p, q, drafts, u)
    assert torch.equal(n_b, n_t) and 0 < int(n_b.sum()) < B
    torch.testing.assert_close(d_b, d_t, rtol=0, atol=1e-15)


def test_one_hot_distributions_reduce_to_exact_match():
    """The temperature-0 limit: one-hot target and draft distributions make block verification accept
    exactly the prefix that matches the target's argmax and draw the argmax next, whatever the uniforms."""
    g = torch.Generator().manual_seed(1)
    B, K, V = 512, 3, 4
    a = torch.randint(0, V, (B, K + 1), generator=g)  # target argmax at each verify position
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, a[:, :K], torch.randint(0, V, (B, K), generator=g))
    p = torch.nn.functional.one_hot(a, V).double()
    q = torch.nn.functional.one_hot(drafts, V).double()
    n, dist = block_accept(p, q, drafts, torch.rand(B, K, generator=g, dtype=F64))
    exact = (drafts == a[:, :K]).long().cumprod(1).sum(1)
    assert torch.equal(n, exact) and len(set(exact.tolist())) == K + 1
    assert torch.equal(dist.argmax(-1), a.gather(1, exact.unsqueeze(1)).squeeze(1))
    assert torch.equal(dist.max(-1).values, torch.ones(B, dtype=F64))


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 3], [40, 41, 42]]


@pytest.mark.parametrize("noise", [0.05, 0.0])
def test_greedy_block_equals_token_and_autoregressive(noise):
    model = make_agreeing(tiny_model(3, 1, seed=7, dtype=F64), noise, seed=3)
    ar = generate(model, PROMPTS, 20, 0)
    tok = generate(model, PROMPTS, 20, 3, verify="token")
    blk = generate(model, PROMPTS, 20, 3, verify="block")
    assert blk.outputs == tok.outputs == ar.outputs
    assert torch.equal(blk.stats.accepted, tok.stats.accepted) and torch.equal(blk.stats.rounds, tok.stats.rounds)
    assert torch.equal(blk.stats.accepted_at, tok.stats.accepted_at) and int(blk.stats.accepted.sum()) > 0


def test_unknown_rule_is_refused():
    model = tiny_model(2, 1)
    with pytest.raises(ValueError, match="verify='blocks'"):
        generate(model, PROMPTS, 4, 2, verify="blocks")


def test_config_and_cli_name_the_rule():
    from tandem.eval.cli import _parser
    from tandem.trainer.config import ConfigError, load_config

    assert load_config(None, ["eval.verify=block"]).eval.verify == "block"
    with pytest.raises(ConfigError, match=r"^config key 'eval.verify'='blocks' must be token or block$"):
        load_config(None, ["eval.verify=blocks"])
    assert _parser().parse_args(["--checkpoint", "x", "--verify", "block"]).verify == "block"
    assert _parser().parse_args(["--checkpoint", "x"]).verify is None
    with pytest.raises(SystemExit):
        _parser().parse_args(["--checkpoint", "x", "--verify", "tree"])


@pytest.mark.parametrize("rule,other", [("token", "block"), ("block", "token")])
def test_evaluator_logs_the_other_rule_at_each_temperature(rule, other):
    """`eval.verify` decides the plain `eval/T<t>/` keys; the other rule's figures land under
    `eval/T<t>/<other>/`, decoded from the same prompts and seeds."""
    from tandem.eval.in_loop import InLoopEvaluator
    from tandem.trainer.config import load_config

    K = 3
    cfg = load_config(None, [f"eval.verify={rule}", "eval.temperatures=[1.0,0.7]", f"eval.num_steps={K}",
                             "eval.max_new_tokens=12", "eval.batch_size=2", "eval.num_samples_logged=1",
                             "logging.wandb=false"])
    model = make_agreeing(tiny_model(K, 1, seed=2), 0.05, seed=2)
    pstate = types.SimpleNamespace(world_size=1, is_main=True, device=types.SimpleNamespace(device=torch.device("cpu")))
    ev = InLoopEvaluator(cfg, model, None, None, pstate)
    ev.prompts = PROMPTS
    out = ev.run(1)
    for t in ("T1", "T0.7"):
        for key in ["acceptance_length", "draft_acceptance_rate"] + [f"accept_rate/pos_{k}" for k in range(1, K + 1)]:
            assert f"eval/{t}/{key}" in out and f"eval/{t}/{other}/{key}" in out, (t, key)
        assert f"eval/{t}/{rule}/acceptance_length" not in out
        assert 1.0 <= out[f"eval/{t}/{other}/acceptance_length"] <= K + 1
    assert not any(k.startswith(f"eval/{other}/") for k in out)  # greedy: one rule, no duplicate keys
    # the figures are those of evaluate_decoding with each rule
    from tandem.eval.metrics import evaluate_decoding

    common = dict(num_steps=K, max_new_tokens=12, batch_size=2, seed=cfg.train.seed, temperature=1.0,
                  autoregressive=False)
    ref_rule = evaluate_decoding(model, PROMPTS, verify=rule, **common)[0]["acceptance_length"]
    ref_other = evaluate_decoding(model, PROMPTS, verify=other, **common)[0]["acceptance_length"]
    assert out["eval/T1/acceptance_length"] == pytest.approx(ref_rule)
    assert out[f"eval/T1/{other}/acceptance_length"] == pytest.approx(ref_other)
