"""Speculative decoding: greedy identity with AR, acceptance counted independently of verification,
draft logits = training logits, KV rollback, budget-exact counting. (Sampled decoding's
distribution, both verification rules: tests/unit/test_block_verify.py.)"""

import pytest
import torch

from tandem.eval.acceptance import acceptance_metrics, row_metrics
from tandem.eval.spec_decode import SpecDecoder, generate
from tandem.models.mtp import shifted_tokens
from tests.eval_helpers import make_agreeing, tiny_model

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 3], [40, 41, 42]]


def greedy_decode_checked(model, prompts, max_new_tokens, K, **kw):
    """generate(model, prompts, max_new_tokens, K) at temperature 0, checked round by round against
    a count made without the verifier: the drafts are the argmax of each round's draft logits
    (recorded from SpecDecoder.draft), the reference is greedy autoregressive decoding, and a round
    must commit 1 + L tokens, L = the length of the longest prefix of the drafts that matches the
    greedy continuation. The decode's outputs must be the greedy ones, and its counters (rounds,
    accepted budget-exact and all, per position, acceptance length) the sums of that count. Returns
    the result."""
    lens = [len(p) for p in prompts]
    # drafts may run past the budget
    ref = generate(model, prompts, max_new_tokens + K + 1, 0, **kw).outputs
    rounds = []  # (m [B] before the round, drafts [B,K] from the draft logits)
    draft = SpecDecoder.draft

    def recording(self, force=None, keep_logits=False):
        drafts, q, logits = draft(self, force, keep_logits=True)
        rounds.append((self.m.clone(), torch.stack(logits, 1).argmax(-1)))
        assert torch.equal(drafts, rounds[-1][1])
        return drafts, q, logits if keep_logits else []

    SpecDecoder.draft = recording
    try:
        res = generate(model, prompts, max_new_tokens, K, **kw)
    finally:
        SpecDecoder.draft = draft
    assert res.outputs == [o[:max_new_tokens] for o in ref]
    B = len(prompts)
    n_rounds, acc, acc_all = [0] * B, [0] * B, [0] * B
    acc_at = torch.zeros(B, K, dtype=torch.long)
    for r, (m, drafts) in enumerate(rounds):
        for b in range(B):
            done = int(m[b]) - lens[b] + 1  # tokens output so far (seq[lens[b] .. m])
            if done >= max_new_tokens:
                # finished rows stay put
                assert r + 1 == len(rounds) or int(rounds[r + 1][0][b]) == int(m[b])
                continue
            cont = ref[b][done : done + K]  # greedy tokens after seq[m]
            L = 0
            while L < K and int(drafts[b, L]) == cont[L]:
                L += 1
            if r + 1 < len(rounds):
                assert int(rounds[r + 1][0][b]) == int(m[b]) + 1 + L, (r, b, L)
            emitted = min(1 + L, max_new_tokens - done)
            n_rounds[b] += 1
            acc[b] += emitted - 1
            acc_all[b] += L
            acc_at[b, : emitted - 1] += 1
    st = res.stats
    assert (
        st.rounds.tolist() == n_rounds
        and st.accepted.tolist() == acc
        and st.accepted_all.tolist() == acc_all
    )
    assert torch.equal(st.accepted_at, acc_at)
    assert res.decoded_tokens == sum(acc) + sum(n_rounds)
    assert acceptance_metrics(st)["acceptance_length"] == pytest.approx(1 + sum(acc)
                                                                        / sum(n_rounds))
    # each row's figures (what `tandem eval --output`, `tandem generate` and the logged samples
    # hold) from the same independent counts: its tokens after prefill's over its rounds
    for b in range(B):
        row = row_metrics(st, b)
        assert row["acceptance_length"] == pytest.approx(
            (len(res.outputs[b]) - 1) / n_rounds[b] if n_rounds[b] else 1.0)
        assert row["acceptance_length"] == pytest.approx(1 + acc[b] / max(n_rounds[b], 1))
        assert row["draft_acceptance_rate"] == pytest.approx(acc[b] / max(n_rounds[b] * K, 1))
        assert [row[f"accept_rate/pos_{i + 1}"] for i in range(K)] == pytest.approx(
            [int(x) / max(n_rounds[b], 1) for x in acc_at[b]])
    return res


@pytest.mark.parametrize("K,L", [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("noise", [None, 0.05, 0.0])
def test_greedy_spec_equals_ar(K, L, noise):
    model = tiny_model(K, L, seed=K * 10 + L, dtype=torch.float64)
    if noise is not None:
        make_agreeing(model, noise, seed=K + L)
    sp = greedy_decode_checked(model, PROMPTS, 24, K)
    assert [len(o) for o in sp.outputs] == [24] * len(PROMPTS)
    a = acceptance_metrics(sp.stats)["acceptance_length"]
    if noise == 0.0:
        assert a > 1 + 0.8 * K  # drafts agree: acceptance is exercised (not just the bonus)
    if noise == 0.05:
        assert 1.2 < a


def test_independent_count_rejects_a_verifier_that_accepts_one_draft_too_few(monkeypatch):
    """A verifier that keeps one matching draft fewer than it may (and takes the greedy token after
    the shorter prefix) still reproduces greedy output exactly: only the round-by-round count sees
    it."""
    verify = SpecDecoder.verify

    def short(self, drafts, q):
        n, _ = verify(self, drafts, q)
        n = (n - 1).clamp(min=0)
        b = self.batch
        # the verify forward's hidden states
        pos = b.m.unsqueeze(1) + b.arange[: self.K + 1].unsqueeze(0)
        a = self.model.logits(0,
                              b.hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, b.H))).argmax(-1)
        return n, a.gather(1, n.unsqueeze(1)).squeeze(1)

    model = make_agreeing(tiny_model(3, 1, seed=7, dtype=torch.float64), 0.0)
    monkeypatch.setattr(SpecDecoder, "verify", short)
    assert generate(model, PROMPTS, 12, 3).outputs == generate(model, PROMPTS, 12, 0).outputs
    with pytest.raises(AssertionError):
        greedy_decode_checked(model, PROMPTS, 12, 3)


def test_greedy_spec_equals_ar_under_bf16_autocast():
    """The in-loop evaluator decodes under the training precision: with bf16 autocast the decoder's
    fp32 hidden stores take bf16 layer outputs (a dtype mismatch once failed the first draft), and
    greedy speculative output still equals greedy autoregressive output computed under the same
    autocast."""
    model = make_agreeing(tiny_model(3, 1, seed=5), 0.05, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ar = generate(model, PROMPTS, 16, 0)
        sp = generate(model, PROMPTS, 16, 3)
    assert sp.outputs == ar.outputs
    assert acceptance_metrics(sp.stats)["acceptance_length"] > 1.2


@pytest.mark.parametrize("flavor", ["debug", "debug_mla"])
def test_bf16_key_value_buffers_decode_as_fp32_buffers_did(flavor, monkeypatch):
    """Under bf16 autocast the KV buffers hold bf16, the dtype attention reads (models/state.py),
    not the parameters' fp32: the same keys reach attention, so greedy and sampled decodes (tokens,
    acceptance counters) equal those of fp32 buffers, forced here as the reference. MLA's cached
    latents too (its latent norm's fp32 weight made them fp32)."""
    from tandem.models.state import DecodeCache

    model = make_agreeing(tiny_model(3, 1, seed=6, flavor=flavor), 0.05, seed=6)
    allocate = DecodeCache.allocate
    dtypes = []

    def recording(self, index, heads, key_dim, value_dim, dtype):
        dtypes.append(dtype)
        allocate(self, index, heads, key_dim, value_dim, dtype)

    def decodes():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return [generate(model, PROMPTS, 16, 3, temperature=t,
                             generator=torch.Generator().manual_seed(0)) for t in (0.0, 1.0)]

    monkeypatch.setattr(DecodeCache, "allocate", recording)
    ours = decodes()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    monkeypatch.setattr(DecodeCache, "allocate",
                        lambda self, i, h, dk, dv, dtype: allocate(self, i, h, dk, dv,
                                                                    torch.float32))
    fp32 = decodes()
    for a, b in zip(ours, fp32):
        assert a.outputs == b.outputs
        assert torch.equal(a.stats.accepted_at, b.stats.accepted_at)
        assert a.stats.rounds.tolist() == b.stats.rounds.tolist()


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
    # several stop ids (a chat model's end-of-turn ids beside its EOS): each row ends at the first
    # of them, as with that one alone (the other, the first token of row 1, ends row 1 at once)
    other = ar.outputs[1][0]
    ar_s = generate(model, PROMPTS, 24, 0, eos_id=[eos, other])
    sp_s = generate(model, PROMPTS, 24, 3, eos_id=[eos, other])
    assert sp_s.outputs == ar_s.outputs
    for row, full in zip(ar_s.outputs, ar.outputs):
        ends = [i for i, t in enumerate(full) if t in (eos, other)]
        assert row == (full[: ends[0] + 1] if ends else full)
    assert ar_s.outputs[1] == [other] and ar_s.stats.rounds[1] == 0


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
    dec.prefill([tokens[b, : n0[b]].tolist() for b in range(3)],
                first_tokens=tokens[torch.arange(3), n0])
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
    # per-depth caches and hidden stores
    dec = SpecDecoder(model, K, 3, 80, draft_convention="tandem")
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
    fresh.prefill([dec.seq[b, : int(m[b])].tolist() for b in range(3)],
                  first_tokens=dec.seq[torch.arange(3), m])
    fresh.draft()
    for b in range(3):
        mb = int(m[b])
        for layer in range(model.cfg.num_layers):
            torch.testing.assert_close(dec.trunk_cache.keys[layer][b, :, :mb],
                                       fresh.trunk_cache.keys[layer][b, :, :mb])
            torch.testing.assert_close(
                dec.trunk_cache.values[layer][b, :, :mb], fresh.trunk_cache.values[layer][b, :, :mb]
            )
        torch.testing.assert_close(dec.batch.hidden[b, :mb], fresh.batch.hidden[b, :mb])
        for k in range(1, K + 1):
            v = mb - k + 1
            c, f = dec.drafter.caches[k - 1], fresh.drafter.caches[k - 1]
            torch.testing.assert_close(c.cache.keys[0][b, :, :v], f.cache.keys[0][b, :, :v])
            torch.testing.assert_close(c.cache.values[0][b, :, :v], f.cache.values[0][b, :, :v])
            if k < K:
                torch.testing.assert_close(dec.drafter.hidden[k][b, :v],
                                           fresh.drafter.hidden[k][b, :v])
    # same drafts
    assert torch.equal(dec.seq[torch.arange(3), m + 1], fresh.seq[torch.arange(3), m + 1])


def test_budget_exact_counting_hand_computed():
    """Drafts always agree (K=3): prefill emits 1 token, round 1 emits 4 (3 accepted). Round 2 has
    room for max_new_tokens - 5 tokens: with 6 it emits 1 (0 accepted, not the 3 committed), with 7
    it emits 2 (1 accepted). An EOS as the 3rd output token ends round 1 after 2 emitted (1
    accepted)."""
    model = make_agreeing(tiny_model(3, 1, dtype=torch.float64), 0.0)
    prompt = [PROMPTS[0]]
    for budget, accepted, pos in [(6, 3, [1.0 / 2, 1.0 / 2, 1.0 / 2]),
                                  (7, 4, [1.0, 1.0 / 2, 1.0 / 2])]:
        res = generate(model, prompt, budget, 3)
        assert res.outputs == generate(model, prompt, budget,
                                       0).outputs and len(res.outputs[0]) == budget
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


def test_top_k_keeps_the_k_largest_logits_hand_computed():
    from tandem.eval.sampling import probs_from_logits

    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    # k=2: 3 and both 2s (ties with the k-th are kept), softmax over them only
    want = torch.tensor([[torch.e ** 3, 0, torch.e ** 2, torch.e ** 2, 0]])
    torch.testing.assert_close(probs_from_logits(logits, 1.0, 1.0, top_k=2), want / want.sum())
    one_hot = torch.tensor([[1.0, 0, 0, 0, 0]])
    torch.testing.assert_close(probs_from_logits(logits, 0.7, 1.0, top_k=1), one_hot)
    # then the nucleus of what is left: p(3) = e/(e+2) = 0.58 < 0.6, so one 2 joins it
    p = probs_from_logits(logits, 1.0, 0.6, top_k=3)
    assert (p > 0).sum() == 2 and p[0, 0] > p[0, 2] > 0 and p[0, 3] == 0
    torch.testing.assert_close(probs_from_logits(logits, 1.0, 1.0, top_k=0),
                               torch.softmax(logits, -1))


@pytest.mark.parametrize("K", [0, 2])
def test_top_k_applies_to_the_trunk_and_the_drafts(K):
    """Sampling from each head's top 1 is greedy decoding, speculative or not: the target p and
    the drafts q are both cut (a draft outside the trunk's top k is always rejected). With k = 2
    every emitted token is one of the trunk's two largest logits at its position."""
    model = tiny_model(max(K, 1), 1, seed=5, dtype=torch.float64)
    make_agreeing(model, 0.05, seed=2)
    greedy = generate(model, PROMPTS, 16, K).outputs
    g = torch.Generator().manual_seed(0)
    assert generate(model, PROMPTS, 16, K, temperature=1.0, top_k=1, generator=g).outputs == greedy
    g = torch.Generator().manual_seed(1)
    sampled = generate(model, PROMPTS, 16, K, temperature=1.5, top_k=2, generator=g).outputs
    assert sampled != greedy  # it did sample
    for prompt, out in zip(PROMPTS, sampled):
        assert len(out) == 16
        seq = torch.tensor([list(prompt) + list(out)])
        s = seq.shape[1] - 1
        h = model.trunk(seq[:, :s], torch.arange(s).expand(1, s))
        top2 = model.logits(0, h).topk(2, dim=-1).indices[0]  # [s, 2]: after each position
        emitted = range(len(prompt) - 1, s)  # positions whose next token the decode chose
        assert all(seq[0, t + 1] in top2[t] for t in emitted)


def test_predicted_speedup_counts_the_rows_a_batched_round_carries(monkeypatch):
    """Under a clock that model forwards (1 per trunk forward, 0.1 per MTP depth) and each round's
    bookkeeping (0.3) move, the predicted speedup is the measured one, also when a batch's rows
    finish at different rounds, on either side: the finished rows ride along in the batched
    rounds (the acceptance length alone overstated the speedup by 17% at these settings). Without
    the overhead term or with the speculative side's occupancy alone, it read 0.53 for 3.15."""
    import tandem.eval.decode_eval as de
    import tandem.eval.spec_decode as sd

    clock = [0.0]
    monkeypatch.setattr(sd.time, "perf_counter", lambda: clock[0])
    model = make_agreeing(tiny_model(num_steps=3, vocab=64), 0.05)
    trunk = model.trunk

    def timed_trunk(*args, **kwargs):
        clock[0] += 1.0
        return trunk(*args, **kwargs)

    monkeypatch.setattr(model, "trunk", timed_trunk)
    commit = sd.SpecDecoder.commit

    def timed_commit(self, *args, **kwargs):
        clock[0] += 0.3
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(sd.SpecDecoder, "commit", timed_commit)
    make = sd.make_drafter

    def timed_drafter(*args, **kwargs):
        drafter = make(*args, **kwargs)
        if drafter is None:  # the autoregressive side
            return None
        depths = drafter.depth_logits

        def timed_depths():
            for logits in depths():
                clock[0] += 0.1
                yield logits

        drafter.depth_logits = timed_depths
        return drafter

    monkeypatch.setattr(sd, "make_drafter", timed_drafter)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (8,), generator=g).tolist() for _ in range(8)]
    _, _, ar = de.evaluate_decoding(model, prompts, num_steps=3, max_new_tokens=32, batch_size=8)
    # an EOS the greedy decodes reach at different lengths: the AR rows finish unevenly too
    outs = [t for r in ar for o in r.outputs for t in o[:20]]
    m, spec, ar = de.evaluate_decoding(model, prompts, num_steps=3, max_new_tokens=32,
                                       batch_size=8, eos_id=max(set(outs), key=outs.count))
    assert len(set(spec[0].stats.rounds.tolist())) > 1 and len(set(ar[0].stats.rounds.tolist())) > 1
    assert m["time_per_round/overhead_ms"] > 0
    assert m["speedup_predicted"] == pytest.approx(m["speedup"], rel=1e-6)
    assert de._median([4.0, 1.0, 3.0, 2.0]) == 2.5  # (repeats: an even count's middle pair)


@pytest.mark.parametrize("K", [0, 2, 3])
def test_prompt_limit_is_the_longest_prompt_that_decodes(K):
    from tandem.eval.spec_decode import generate, prompt_limit
    model = tiny_model(max(K, 1), 1, seed=3)
    max_new = 6
    limit = prompt_limit(model.cfg.max_seq_len, max_new, K)
    out = generate(model, [[5] * limit], max_new, K)  # the longest prompt fits
    assert len(out.outputs[0]) == max_new
    with pytest.raises(ValueError, match="exceeds"):  # one more does not (the limit is tight)
        generate(model, [[5] * (limit + 1)], max_new, K)
