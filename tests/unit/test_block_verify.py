"""Block verification (eval/block_verify.py) and the sampled decoder's output distribution: exact
output distribution by enumeration over every draft block and every cell of the uniforms (blocks
where several thresholds pass included, so the choice of tau is tested), with rules that pick
another passing index failing the same computation; chi-square tests through the decoder for both
verification rules at the recipes' K = 3 and T = 0.7 and at K = 2, T = 1 with top-p, with broken
samplers the same test rejects; expected accepted length >= token-wise verification's (computed
exactly); greedy identity; wiring."""

import itertools
import types

import pytest
import torch

from tandem.eval import block_verify as bv
from tandem.eval import spec_decode as sd
from tandem.eval.block_verify import block_accept, block_thresholds
from tandem.eval.sampling import probs_from_logits, speculative_accept
from tandem.eval.spec_decode import generate
from tests.eval_helpers import make_agreeing, tiny_model

F64 = torch.float64


# --- small-vocabulary draft/target tables ---------------------------------------------------------

def _tables(V, K, seed, sharp=2.0):
    """Random target tables P[i] [V^i, V] (i = 0..K) and draft tables Q[i] [V^i, V] (i = 0..K-1):
    row `prefix` (base-V index of the i tokens after the context) holds the next-token
    distribution."""
    g = torch.Generator().manual_seed(seed)
    P = [torch.softmax(sharp * torch.randn(V ** i, V, generator=g, dtype=F64),
                       -1) for i in range(K + 1)]
    Q = [torch.softmax(sharp * torch.randn(V ** i, V, generator=g, dtype=F64),
                       -1) for i in range(K)]
    return P, Q


def _with_zeros(T, seed):
    """The tables with one random token per row zeroed and renormalised (as top-p truncation
    does)."""
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
    return (
        (tokens * V ** torch.arange(i - 1, -1, -1)).sum(1)
        if i
        else torch.zeros(tokens.shape[0], dtype=torch.long)
    )


def _verify_inputs(P, Q, X):
    """(p [N,K+1,V], q [N,K,V]) along the draft sequences X [N,K]."""
    V, K = P[0].shape[1], X.shape[1]
    p = torch.stack([P[i][_row(X[:, :i], V)] for i in range(K + 1)], 1)
    q = torch.stack([Q[i][_row(X[:, :i], V)] for i in range(K)], 1)
    return p, q


def _all_drafts(P, Q):
    """Every draft sequence X [V^K, K] with its probability under the drafter, and the verify
    inputs."""
    V, K = P[0].shape[1], len(Q)
    X = torch.tensor(list(itertools.product(range(V), repeat=K)))
    p, q = _verify_inputs(P, Q, X)
    return X, q.gather(-1, X.unsqueeze(-1)).squeeze(-1).prod(1), p, q


def _cells(cuts):
    """Partition of the uniforms' cube [0,1)^K for each of N rows: cuts [N, K, C] are the points
    where a rule's decision about u_i can change (its thresholds h_i). Returns (u [N, M, K] one
    point inside each cell, mass [N, M] the cell's volume), M = (C+1)^K; a rule that compares each
    u_i only with these cuts is constant on every cell, so the cells enumerate its randomness
    exactly."""
    N, K, C = cuts.shape
    edges = torch.cat([torch.zeros(N, K, 1, dtype=F64), cuts.clamp(0, 1).sort(-1).values,
                       torch.ones(N, K, 1, dtype=F64)], -1)
    # [N, K, C+1]
    mid, length = (edges[..., 1:] + edges[..., :-1]) / 2, edges[..., 1:] - edges[..., :-1]
    idx = torch.tensor(list(itertools.product(range(C + 1), repeat=K)))  # [M, K]
    u = torch.stack([mid[:, i, idx[:, i]] for i in range(K)], -1)
    mass = torch.stack([length[:, i, idx[:, i]] for i in range(K)], -1).prod(-1)
    return u, mass


def _enumerate(P, Q):
    """Every (draft sequence, uniforms cell) with its probability, run through `bv.block_accept`
    (looked up at call time, so a test can swap in a mutant): (X [R,K] drafts, weight [R], tau [R],
    dist [R,V], passes [R] how many i have u_i < h_i, the block thresholds). The cells cut each u_i
    at the block threshold h_i and at the prefix weight w_i (the naive rule's threshold)."""
    X, qx, p, q = _all_drafts(P, Q)
    N, K = X.shape
    w, h = block_thresholds(p, q, X)
    u, mass = _cells(torch.stack([h, w[:, 1:]], -1))
    M = u.shape[1]

    def rep(t):
        return t.repeat_interleave(M, 0)

    X, p, q, u = rep(X), rep(p), rep(q), u.reshape(N * M, K)
    tau, dist = bv.block_accept(p, q, X, u)
    passes = (u < rep(h)).sum(1)
    return X, (qx.unsqueeze(1) * mass).reshape(-1), tau, dist, passes


def _exact_output(P, Q):
    """(exact distribution over y in V^(K+1) of the sampler, the target's, the probability that two
    or more u_i pass): drafts ~ Q, uniforms ~ U[0,1)^K, `bv.block_accept`'s tau and next-token
    distribution, then the target's own continuation up to K+1 tokens. The sampler's own tau is
    used: nothing here assumes which passing index the rule picks."""
    V, K = P[0].shape[1], len(Q)
    X, wt, tau, dist, passes = _enumerate(P, Q)
    Y = torch.tensor(list(itertools.product(range(V), repeat=K + 1)))
    step = torch.stack([P[i][_row(Y[:, :i],
                                  V)].gather(1, Y[:, i : i + 1]).squeeze(1) for i in range(K + 1)])
    out = torch.zeros(len(Y), dtype=F64)
    for t in range(K + 1):
        r = tau == t
        prefix_ok = (Y[:, :t].unsqueeze(0) == X[r, :t].unsqueeze(1)).all(-1)  # [R_t, |Y|]
        out += (wt[r].unsqueeze(1) * prefix_ok * dist[r][:, Y[:, t]]).sum(0) * step[t + 1 :].prod(0)
    return out, step.prod(0), float(wt[passes >= 2].sum())


def _expected_lengths(P, Q):
    """Exact E[accepted drafts] of token-wise verification (closed form) and of `bv.block_accept`
    (enumerated) on the same drafts X ~ Q."""
    X, qx, p, q = _all_drafts(P, Q)
    K = X.shape[1]
    pd = p[:, :K].gather(-1, X.unsqueeze(-1)).squeeze(-1)
    qd = q.gather(-1, X.unsqueeze(-1)).squeeze(-1)
    ratio = torch.where(qd > 0, pd / qd.clamp(min=1e-300), torch.zeros_like(pd)).clamp(max=1.0)
    token = (ratio.cumprod(1).sum(1) * qx).sum()  # P(n >= i | X) = prod_{j<=i} min(1, p/q)
    _, wt, tau, _, _ = _enumerate(P, Q)
    return float(token), float((wt * tau).sum())


# --- deliberately broken rules: the negative controls ---------------------------------------------

def naive_block_accept(p, q, drafts, u):
    """h_i = w_i: "keep the longest prefix whose capped likelihood ratio beats a uniform" -- drops
    the residual-mass term of the real threshold. Not distribution-preserving."""
    B, K = drafts.shape
    V = p.shape[-1]
    w = block_thresholds(p, q, drafts)[0]
    tau = torch.where(u.to(w.dtype) < w[:, 1:], torch.arange(1, K + 1), 0).amax(1)
    p_t = p.gather(1, tau.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    q_t = q.gather(1, tau.clamp(max=K - 1).view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    resid = (w.gather(1, tau.view(B, 1)) * p_t - q_t).clamp(min=0.0)
    total = resid.sum(-1, keepdim=True)
    return tau, torch.where((tau < K).unsqueeze(-1) & (total > 0), resid / total.clamp(min=1e-30),
                            p_t)


def _tau_mutant(real, pick):
    """The real thresholds and residual, but tau = pick(passes [B,K] bool): the real `block_accept`
    run on uniforms rewritten so that only u_tau passes (u_tau = 0, every other u = 1 > h)."""
    def accept(p, q, drafts, u):
        h = block_thresholds(p, q, drafts)[1]
        tau = pick(u.to(h.dtype) < h)
        forced = torch.ones_like(u)
        at = (tau > 0).nonzero().squeeze(1)
        forced[at, tau[at] - 1] = 0.0
        return real(p, q, drafts, forced)
    return accept


MUTANTS = {
    "first passing index": lambda s: torch.where(s.any(1), s.long().argmax(1) + 1, 0),
    "leading passes only": lambda s: s.long().cumprod(1).sum(1),  # stop at the first failed test
}


# --- exact distribution ---------------------------------------------------------------------------

# (V, K, seed, sharpness): tables where two or more uniforms pass in 10-50% of the blocks (sharper
# tables make drafter and target disagree so much that the thresholds are rarely passed at all)
CASES = [(4, 2, 1, 1.0), (3, 2, 5, 1.0), (3, 3, 3, 0.5), (4, 3, 8, 1.0)]


@pytest.mark.parametrize("V,K,seed,sharp", CASES)
@pytest.mark.parametrize("zeros", [False, True])
def test_output_distribution_is_the_target_exactly(V, K, seed, sharp, zeros, monkeypatch):
    """Enumerating every draft sequence and every cell of the uniforms (cut at each threshold, so
    blocks where several u_i pass carry their full probability): drafts, block verification, the
    next token, then the target's own continuation give exactly the target's distribution over the
    K+1 tokens (to rounding). The same computation rejects rules that pick another passing index
    than the last (first passing, or stopping at the first failure) and the naive threshold."""
    P, Q = _tables(V, K, seed, sharp)
    if zeros:
        P, Q = _with_zeros(P, seed + 10), _with_zeros(Q, seed + 20)
    out, target, multi = _exact_output(P, Q)
    assert multi > 0.05, multi  # the tau rule is exercised: two or more uniforms pass that often
    assert abs(float(out.sum()) - 1) < 1e-12
    assert float((out - target).abs().max()) < 1e-12
    real = bv.block_accept
    for name, pick in MUTANTS.items():
        monkeypatch.setattr(bv, "block_accept", _tau_mutant(real, pick))
        bad = _exact_output(P, Q)[0]
        assert 0.5 * float((bad - target).abs().sum()) > 0.01, name
    monkeypatch.setattr(bv, "block_accept", naive_block_accept)
    assert 0.5 * float((_exact_output(P, Q)[0] - target).abs().sum()) > 0.01


# --- chi-square through the decoder ---------------------------------------------------------------

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


@torch.no_grad()
def _trunk_probs(model, prefixes, temperature, top_p):
    t = torch.tensor(prefixes)
    h = model.trunk(t, torch.arange(t.shape[1]).expand_as(t))
    return probs_from_logits(model.logits(0, h[:, -1]), temperature, top_p).double()


def _decoder_model(K):
    """An 8-token model whose MTP drafts partly agree with the trunk (make_agreeing), its shared
    head scaled down so that both sample broadly at T = 0.7..1: about one draft in three is
    accepted, and every acceptance count 0..K, several passing block thresholds included, is
    common."""
    model = make_agreeing(tiny_model(K, 1, vocab=8, seed=11, moe=False), 0.1, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)
    return model


def _decoder_pvalues(verify, K, T, top_p, n=2000):
    """generate(verify=...) of K+1 tokens with K drafts: the first token comes from prefill, the
    next K from the first verify round (and from later rounds after a rejection). Chi-square
    p-values of every adjacent pair (t_i, t_i+1) and triple of the output against the trunk's exact
    joint (from the trunk alone, over every continuation)."""
    V, L, prompt = 8, K + 1, [1, 2, 3]
    model = _decoder_model(K)
    g = torch.Generator().manual_seed(4321)
    out = torch.tensor(generate(model, [prompt] * n, L, K, temperature=T, top_p=top_p, generator=g,
                                verify=verify).outputs)
    joint = torch.ones(1, dtype=F64)
    for i in range(L):
        probs = _trunk_probs(model, [prompt + list(c)
                                     for c in itertools.product(range(V), repeat=i)], T, top_p)
        joint = (joint.unsqueeze(1) * probs).reshape(-1)
    joint = joint.view([V] * L)
    ps = []
    for w in (2, 3):
        for i in range(L - w + 1):
            exp = joint.sum([d for d in range(L) if not i <= d < i + w]) if L > w else joint
            obs = torch.bincount(_row(out[:, i : i + w], V), minlength=V ** w)
            ps.append(_chi2_pvalue(obs, n * exp.flatten()))
    return ps


# (K, T, top_p) per rule: the recipes' K = 3 with T = 0.7, and K = 2 at T = 1 with a nucleus
DECODER_CASES = [(3, 0.7, 1.0), (2, 1.0, 0.8)]


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("K,T,top_p", DECODER_CASES)
def test_decoding_matches_trunk_distribution(verify, K, T, top_p):
    ps = _decoder_pvalues(verify, K, T, top_p)
    assert min(ps) > 1e-3, ps
    print(f"decoder, {verify}, K={K}, T={T}, top_p={top_p}: chi-square p >= {min(ps):.3g}")


def _residual_is_target(accept):
    """After a rejection, sample from the target P_n itself instead of the residual."""
    def mutant(p, q, drafts, u):
        n, _ = accept(p, q, drafts, u)
        return n, p.gather(1, n.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)
    return mutant


def _drafts_at_t1(monkeypatch):
    """Draft tokens sampled at T = 1 while the q handed to verification is the tempered one (the
    temperature not applied to the drafter's sampling)."""
    draft, choose = sd.SpecDecoder.draft, sd.SpecDecoder.choose

    def drafting(self, *a, **kw):
        self._test_drafting = True
        try:
            return draft(self, *a, **kw)
        finally:
            self._test_drafting = False

    def mutant(self, logits):
        tok, probs = choose(self, logits)
        if getattr(self, "_test_drafting", False):
            tok = self.chooser.sample(probs_from_logits(logits, 1.0, self.chooser.top_p))
        return tok, probs

    monkeypatch.setattr(sd.SpecDecoder, "draft", drafting)
    monkeypatch.setattr(sd.SpecDecoder, "choose", mutant)


@pytest.mark.parametrize("verify,broken",
                         [("token", "residual"), ("block", "residual"), ("block", "draft T"),
                                           ("block", "first passing index")])
def test_broken_sampler_fails_the_decoder_chi_square(verify, broken, monkeypatch):
    """The same test at K = 3, T = 0.7 and the same sample size rejects a broken sampler: the target
    instead of the residual after a rejection, drafts sampled without the temperature, block
    verification keeping the first passing prefix instead of the last."""
    name = "block_accept" if verify == "block" else "speculative_accept"
    real = getattr(sd, name)
    if broken == "residual":
        monkeypatch.setattr(sd, name, _residual_is_target(real))
    elif broken == "draft T":
        _drafts_at_t1(monkeypatch)
    else:
        monkeypatch.setattr(sd, name, _tau_mutant(real, MUTANTS[broken]))
    ps = _decoder_pvalues(verify, *DECODER_CASES[0])
    assert min(ps) < 1e-6, ps
    print(f"decoder, {verify}, {broken}: chi-square p = {min(ps):.3g}")


# --- expected accepted length ---------------------------------------------------------------------

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
    tgt, drf = torch.tensor([2 / 3, 1 / 3, 0.0], dtype=F64), torch.tensor([1 / 3, 2 / 3, 0.0],
                                                                          dtype=F64)
    P = [tgt.expand(V ** i, V) for i in range(K + 1)]
    Q = [drf.expand(V ** i, V) for i in range(K)]
    token, block = _expected_lengths(P, Q)
    assert abs(token - 10 / 9) < 1e-12 and abs(block - 11 / 9) < 1e-12, (token, block)
    out, target, _ = _exact_output(P, Q)
    assert float((out - target).abs().max()) < 1e-12
    # K = 3, same tables: the gain grows with the block
    P3, Q3 = P + [tgt.expand(V ** 3, V)], Q + [drf.expand(V ** 2, V)]
    token3, block3 = _expected_lengths(P3, Q3)
    assert block3 > token3 + 0.1, (token3, block3)
    print(f"K=2: token {token:.6f} (10/9), block {block:.6f} (11/9); K=3: token {token3:.6f}, "
          f"block {block3:.6f}")


# --- special cases --------------------------------------------------------------------------------

def test_k1_is_token_wise_speculative_sampling():
    """With one draft the block rule is the token-wise rule: same acceptance, same next-token
    distribution."""
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


@pytest.mark.parametrize("where", ["p", "q", "both", "one draft"])
def test_a_nan_probability_accepts_nothing_as_token_wise_does(where):
    """A diverged model's NaN probabilities: block verification took a NaN threshold for the
    den == 0 case's 1 and accepted K - 1 drafts every round (a NaN drafter on a healthy trunk put
    its garbage token in 75% of the output); token-wise verification accepts none."""
    g = torch.Generator().manual_seed(2)
    B, K, V = 64, 3, 5
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g, dtype=F64), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g, dtype=F64), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    if where in ("p", "both"):
        p[:] = float("nan")
    if where in ("q", "both"):
        q[:] = float("nan")
    if where == "one draft":  # the first draft's probability only: nothing at or after it passes
        q[:, 0] = float("nan")
    u = torch.rand(B, K, generator=g, dtype=F64)
    n_b, d_b = block_accept(p, q, drafts, u)
    n_t, d_t = speculative_accept(p, q, drafts, u)
    assert torch.equal(n_b, torch.zeros(B, dtype=n_b.dtype)) and torch.equal(n_b, n_t)
    assert torch.equal(d_b.isnan(), d_t.isnan())


def test_one_hot_distributions_reduce_to_exact_match():
    """The temperature-0 limit: one-hot target and draft distributions make block verification
    accept exactly the prefix that matches the target's argmax and draw the argmax next, whatever
    the uniforms."""
    g = torch.Generator().manual_seed(1)
    B, K, V = 512, 3, 4
    a = torch.randint(0, V, (B, K + 1), generator=g)  # target argmax at each verify position
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, a[:, :K],
                         torch.randint(0, V, (B, K), generator=g))
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
    assert torch.equal(blk.stats.accepted, tok.stats.accepted) and torch.equal(blk.stats.rounds,
                                                                               tok.stats.rounds)
    assert torch.equal(blk.stats.accepted_at,
                       tok.stats.accepted_at) and int(blk.stats.accepted.sum()) > 0


def test_unknown_rule_is_refused():
    model = tiny_model(2, 1)
    with pytest.raises(ValueError, match="verify='blocks'"):
        generate(model, PROMPTS, 4, 2, verify="blocks")


def test_config_and_cli_name_the_rule():
    from tandem.trainer.config_checks import ConfigError
    from tandem.trainer.eval_cli import _parser
    from tandem.trainer.recipe import load_config

    assert load_config(None, ["eval.verify=block"]).eval.verify == "block"
    with pytest.raises(ConfigError,
                       match=r"^config key 'eval.verify'='blocks' must be token or block$"):
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
    from tandem.trainer.recipe import load_config

    K = 3
    cfg = load_config(None,
                      [f"eval.verify={rule}", "eval.temperatures=[1.0,0.7]", f"eval.num_steps={K}",
                             "eval.max_new_tokens=12", "eval.batch_size=2",
                       "eval.num_samples_logged=1",
                             "logging.wandb=false"])
    model = make_agreeing(tiny_model(K, 1, seed=2), 0.05, seed=2)
    pstate = types.SimpleNamespace(world_size=1, is_main=True,
                                   device=types.SimpleNamespace(device=torch.device("cpu")))
    ev = InLoopEvaluator(cfg, model, None, None, pstate)
    ev.prompts = PROMPTS
    out = ev.run(1)
    for t in ("T1", "T0.7"):
        for key in ["acceptance_length",
                    "draft_acceptance_rate"] + [f"accept_rate/pos_{k}" for k in range(1, K + 1)]:
            assert f"eval/{t}/{key}" in out and f"eval/{t}/{other}/{key}" in out, (t, key)
        assert f"eval/{t}/{rule}/acceptance_length" not in out
    # greedy: one rule, no duplicate keys
    assert not any(k.startswith(f"eval/{other}/") for k in out)
    # the figures are those of evaluate_decoding with each rule, at each temperature
    from tandem.eval.decode_eval import evaluate_decoding

    for t, temp in (("T1", 1.0), ("T0.7", 0.7)):
        common = dict(num_steps=K, max_new_tokens=12, batch_size=2, seed=cfg.train.seed,
                      temperature=temp, autoregressive=False)
        ref_rule = evaluate_decoding(model, PROMPTS, verify=rule, **common)[0]["acceptance_length"]
        ref_other = evaluate_decoding(model, PROMPTS, verify=other,
                                      **common)[0]["acceptance_length"]
        assert out[f"eval/{t}/acceptance_length"] == pytest.approx(ref_rule)
        assert out[f"eval/{t}/{other}/acceptance_length"] == pytest.approx(ref_other)
    greedy, _, _ = evaluate_decoding(model, PROMPTS, num_steps=K, max_new_tokens=12, batch_size=2,
                                     seed=cfg.train.seed, autoregressive=False)
    for key in ["acceptance_length"] + [f"accept_rate/pos_{k}" for k in range(1, K + 1)]:
        assert out[f"eval/{key}"] == pytest.approx(greedy[key]), key
