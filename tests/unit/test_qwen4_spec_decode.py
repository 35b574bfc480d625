"""Speculative decoding on the hybrid Qwen4-Exp model: after every verify round, every piece of
decoder state (Gated DeltaNet recurrent and conv states, PLE n-gram context and conv inputs, QSA raw
indexer keys, attention KV caches, the hidden states handed to the drafter) equals the state of a
fresh autoregressive pass over the committed tokens, and greedy speculative output equals
autoregressive decoding exactly (fp32). Rounds with every acceptance count 0..K are forced by
feeding the decoder drafts taken from the autoregressive continuation with a chosen number of them
corrupted."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.eval.spec_decode import SpecDecoder, generate
from tandem.models import TandemModel
from tests.eval_helpers import tiny_qwen4_model
from tests.unit.test_spec_decode import greedy_decode_checked

K = 3
VOCAB = 64
# 1 = EOS
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 1, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def qwen4_tiny(seed=0) -> TandemModel:
    return tiny_qwen4_model(K, vocab=VOCAB, seed=seed)


def test_greedy_speculative_equals_autoregressive():
    """Greedy speculative output equals autoregressive output, and every round commits 1 + the
    number of drafts (the argmax of the round's draft logits) that match the greedy continuation,
    counted without the verifier. (This random drafter's drafts do not match here, so the count says
    one token per round; the forced rounds below cover every acceptance count.)"""
    model = qwen4_tiny()
    with torch.no_grad():
        greedy_decode_checked(model, PROMPTS, 20, K)


def _ring_rows(buf: torch.Tensor, b: int, positions) -> torch.Tensor:
    ring = buf.shape[1]
    return buf[b, [p % ring for p in positions]]


def _assert_same_state(dec: SpecDecoder, fresh: SpecDecoder, model: TandemModel, b: int) -> None:
    m = int(dec.m[b])  # positions 0..m-1 are committed and fed; seq[m] is the next input
    for i in range(model.cfg.num_layers):
        a, f = dec.trunk_cache.buffers[i], fresh.trunk_cache.buffers[i]
        kind = model.cfg.layer_type(i)
        if kind == "linear_attention":
            torch.testing.assert_close(_ring_rows(a["gdn_state"], b, [m - 1]),
                                       _ring_rows(f["gdn_state"], b, [m - 1]))
            window = [p for p in range(m - model.cfg.linear_conv_kernel + 1, m) if p >= 0]
            torch.testing.assert_close(_ring_rows(a["gdn_conv"], b, window),
                                       _ring_rows(f["gdn_conv"], b, window))
        if i in model.cfg.ple_layers:
            ctx = [p for p in range(m - model.cfg.ngram_size + 1, m) if p >= 0]
            assert torch.equal(_ring_rows(a["ple_tokens"], b, ctx),
                               _ring_rows(f["ple_tokens"], b, ctx))
            conv = [p for p in range(m - (model.cfg.ple_conv_kernel - 1) * model.cfg.ngram_size,
                                     m) if p >= 0]
            torch.testing.assert_close(_ring_rows(a["ple_conv"], b, conv),
                                       _ring_rows(f["ple_conv"], b, conv))
        if kind == "indexed_attention":
            torch.testing.assert_close(a["qsa_index_keys"][b, :m], f["qsa_index_keys"][b, :m])
            torch.testing.assert_close(dec.trunk_cache.keys[i][b, :, :m],
                                       fresh.trunk_cache.keys[i][b, :, :m])
            torch.testing.assert_close(dec.trunk_cache.values[i][b, :, :m],
                                       fresh.trunk_cache.values[i][b, :, :m])
    torch.testing.assert_close(dec.batch.hidden[b, :m], fresh.batch.hidden[b, :m])


def test_state_after_each_round_equals_a_fresh_autoregressive_pass():
    model = qwen4_tiny(seed=1)
    B = len(PROMPTS)
    with torch.no_grad():
        # the greedy continuation, first token included
        ar = generate(model, PROMPTS, 24, 0).outputs
        dec = SpecDecoder(model, K, B, 60)
        dec.prefill(PROMPTS)
        lens = torch.tensor([len(p) for p in PROMPTS])
        active = torch.ones(B, dtype=torch.bool)
        seen = set()
        for r in range(7):
            m = dec.m
            # drafts d_1..d_K for seq[m+1..m+K]: the true continuation with the last `wrong`
            # corrupted
            wrong = torch.tensor([(r + b) % (K + 1) for b in range(B)])
            force = torch.zeros(B, K, dtype=torch.long)
            for b in range(B):
                at = int(m[b] - lens[b]) + 1  # index in ar[b] of seq[m+1]
                for j in range(K):
                    tok = ar[b][at + j]
                    force[b, j] = (tok + 1) % VOCAB if j >= K - int(wrong[b]) else tok
            drafts, q, _ = dec.draft(force=force)
            n, nxt = dec.verify(drafts, q)
            assert torch.equal(n, K - wrong)  # exactly the uncorrupted prefix is accepted
            seen.update(n.tolist())
            dec.commit(n, nxt, active)
            fresh = SpecDecoder(model, K, B, 60)
            fresh.prefill([dec.seq[b, : int(dec.m[b])].tolist() for b in range(B)],
                          first_tokens=dec.seq[torch.arange(B), dec.m])
            for b in range(B):
                _assert_same_state(dec, fresh, model, b)
                got = dec.seq[b, len(PROMPTS[b]): int(dec.m[b]) + 1].tolist()
                assert got == ar[b][: len(got)]
    assert seen == set(range(K + 1))  # rounds with 0, 1, .., K accepted drafts all happened


def _training_logits(model, tokens):
    """Per-depth logits of the training forward: depth 1 records its QSA selection, depths 2..K
    reuse it."""
    from tandem.models.mtp import shifted_tokens

    b, s1 = tokens.shape
    s = s1 - 1
    pos = torch.arange(s).expand(b, s)
    h = model.trunk(tokens[:, :s], pos)
    out, selection = [model.logits(0, h)], None
    for k in range(1, model.num_depths):
        h, selection = model.mtp_train_step(k, h, shifted_tokens(tokens, k, s), pos,
                                            selection=selection)
        out.append(model.logits(k, h))
    return out


@torch.no_grad()
def test_qsa_index_reuse_drafts_as_trained():
    """mtp.qsa_reuse_indices: drafting reuses depth 1's selection at the position whose content
    lines up, through rollbacks of every size, and gives exactly the training forward's logits per
    depth; reuse really changes depths 2..K (the selection is active), not depth 1."""
    model = qwen4_tiny(seed=2)
    assert model.mtp.selection_share is not None
    g = torch.Generator().manual_seed(0)
    S = 40
    tokens = torch.randint(2, VOCAB, (3, S + 1), generator=g)
    train = _training_logits(model, tokens)
    # every depth selects for itself
    share, model.mtp.selection_share = model.mtp.selection_share, None
    own = _training_logits(model, tokens)
    model.mtp.selection_share = share
    assert torch.equal(train[1], own[1])
    assert all((train[k] - own[k]).abs().max() > 1e-4 for k in range(2, K + 1))
    n0 = [4, 9, 2]
    dec = SpecDecoder(model, K, 3, S + 2 * K + 4, draft_convention="tandem")
    dec.prefill([tokens[b, : n0[b]].tolist() for b in range(3)],
                first_tokens=tokens[torch.arange(3), n0])
    active = torch.ones(3, dtype=torch.bool)
    checked = 0
    while int(dec.m.max()) + 2 * K + 1 < S:
        m = dec.m
        drafts, _, logits = dec.draft(force=tokens.gather(1,
                                                          m.unsqueeze(1) + torch.arange(1, K + 1)),
                                      keep_logits=True)
        for k in range(1, K + 1):
            for b in range(3):
                torch.testing.assert_close(logits[k - 1][b], train[k][b, int(m[b]) - 1], rtol=1e-5,
                                           atol=1e-5)
                checked += 1
        dec.verify(drafts, None)
        # accept a random true prefix: rollbacks of every size
        n = torch.randint(0, K + 1, (3,), generator=g)
        dec.commit(n, tokens.gather(1, (m + n + 1).unsqueeze(1)).squeeze(1), active)
    assert checked > 10 * K


def test_a_frozen_bf16_trunk_under_an_fp32_drafter_trains_and_decodes():
    """train.freeze_trunk with train.frozen_dtype=bf16 and train.dtype=fp32 (no autocast): the
    trunk, embedding and head are stored in bf16, the drafter in fp32. The drafter's first training
    forward stopped on the bf16 embedding reaching its fp32 fc_embedding, and the evaluator's depth
    logits and teacher-forced argmax on fp32 rows against the bf16 head. Its teacher-forced losses
    are those of the same weights held in fp32 to bf16 rounding, and greedy speculative decoding
    equals greedy decoding."""
    from tandem.eval.metrics import teacher_forced

    model = tiny_qwen4_model(2)
    mixed = tiny_qwen4_model(2)
    with torch.no_grad():
        for name, p in mixed.named_parameters():
            if not name.startswith("mtp."):
                p.data = p.data.bfloat16()
        for name, p in model.named_parameters():  # the fp32 reference: the same (rounded) values
            p.copy_(dict(mixed.named_parameters())[name].float())
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(2, 64, (2, 25), generator=g),
             "loss_mask": torch.ones(2, 24), "doc_ids": torch.zeros(2, 25, dtype=torch.long)}
    got, want = teacher_forced(mixed, [batch]), teacher_forced(model, [batch])

    def close(a, b):  # bf16's rounding of the trunk moves these losses by up to 0.022 nats
        return a.keys() == b.keys() and all(
            abs(a[k] - b[k]) <= (0.03 if k.startswith("loss/") else 0.05) for k in b)

    assert close(got, want), (got, want)
    # and another drafter would not pass: its MTP weights re-drawn, a depth's loss moves past it
    other = copy.deepcopy(mixed)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.startswith("mtp."):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    assert not close(teacher_forced(other, [batch]), want)
    prompts = [[5, 6, 7, 8, 9], [12, 13]]
    with torch.no_grad():
        assert generate(mixed, prompts, 8, 2).outputs == generate(mixed, prompts, 8, 0).outputs


@torch.no_grad()
def _greedy_without_cache(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        t = torch.tensor([seq])
        pos = torch.arange(len(seq)).unsqueeze(0)
        seq.append(int(model.logits(0, model.trunk(t, pos))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("K", [0, 1])
def test_long_unequal_prompts_on_recurrent_layers_decode_as_full_forwards(K):
    """Prompts longer than the decode ring (4K + 32) take Gated DeltaNet's / PLE's prefill path,
    which keeps only the state at each row's last real token: the batched decode must continue each
    prompt exactly as a cache-free full forward does."""
    from tandem.eval.spec_decode import generate
    model = tiny_qwen4_model(max(K, 1)).double()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (45, 39)]
    out = generate(model, prompts, 4, K).outputs
    for p, o in zip(prompts, out):
        assert o == _greedy_without_cache(model, p, 4)
