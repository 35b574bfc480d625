"""The evaluator's two drafting conventions (eval/draft_serving.py, `eval.draft_convention`).

* both give greedy speculative output equal to autoregressive decoding (fp32), for the GLM-4.5 /
  DeepSeek-V3 combine (concat_proj, with either trunk input; on MLA too) and Qwen4-Exp's drafter
  (QSA index reuse on and off);
* `serving` drafts as vLLM's proposer: its draft logits, round after round with rollbacks, equal a
  cache-free re-derivation (tests/eval_helpers.vllm_convention_draft; with QSA index reuse this
  file's `served_reuse_draft`), and its decode equals the serving test's `vllm_convention_decode` in
  tokens and in both counts (vLLM's and budget-exact);
* with QSA index reuse, depth k >= 2 attends exactly what vLLM's reusing step attends: depth 1's
  whole selection row at m - 1 (its blocks and its tail [m // r * r, m - 1]), not a tail of its own;
* hand-checked: depth k's single query writes only position m + k - 2 of the one MTP cache and reads
  depth 1's entries at 0..m-1 there;
* the shared cache keeps the rollback contract: after every round its valid prefix equals a fresh
  decoder's on the committed tokens;
* the evaluator logs the other convention's acceptance when it differs; the config key and the CLI
  flag.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.eval.acceptance import acceptance_metrics
from tandem.eval.decode_eval import evaluate_decoding, other_convention_figures
from tandem.eval.spec_decode import SpecDecoder, generate
from tests.eval_helpers import (
    make_agreeing,
    tiny_model,
    tiny_qwen4_model,
    vllm_convention_decode,
    vllm_convention_draft,
)

K = 3
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 3], [40, 41, 42], [6]]
Q4_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 1, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def glm_style(seed=3, trunk_input="pre_norm", agree=True, flavor="debug"):
    model = tiny_model(K, 1, seed=seed, flavor=flavor)
    if agree:
        make_agreeing(model, 0.05, seed=seed)
    model.mtp_cfg.trunk_input = trunk_input
    return model


@pytest.mark.parametrize("trunk_input", ["pre_norm", "final_norm"])
@pytest.mark.parametrize("convention", ["serving", "tandem"])
def test_glm_style_greedy_equals_autoregressive(convention, trunk_input):
    model = glm_style(trunk_input=trunk_input)
    with torch.no_grad():
        ar = generate(model, PROMPTS, 24, 0)
        sp = generate(model, PROMPTS, 24, K, draft_convention=convention)
    assert sp.outputs == ar.outputs
    assert acceptance_metrics(sp.stats)["acceptance_length"] > 1.3  # acceptance exercised


@pytest.mark.parametrize("convention", ["serving", "tandem"])
def test_mla_greedy_equals_autoregressive(convention):
    """DeepSeek-V3's attention (MLA, YaRN) in the decoding cache: its keys and values are wider
    and narrower than a GQA head's, and rounds roll them back like any other."""
    model = glm_style(flavor="debug_mla")
    with torch.no_grad():
        ar = generate(model, PROMPTS, 24, 0)
        sp = generate(model, PROMPTS, 24, K, draft_convention=convention)
    assert sp.outputs == ar.outputs
    assert acceptance_metrics(sp.stats)["acceptance_length"] > 1.3


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("convention", ["serving", "tandem"])
def test_qwen4_drafter_greedy_equals_autoregressive(convention, reuse):
    model = make_agreeing(tiny_qwen4_model(K, reuse_indices=reuse), 0.05)
    assert (model.mtp.selection_share is not None) == reuse
    with torch.no_grad():
        ar = generate(model, Q4_PROMPTS, 20, 0)
        sp = generate(model, Q4_PROMPTS, 20, K, draft_convention=convention)
    assert sp.outputs == ar.outputs
    # drafts accepted at every depth, and rejected too (random drafts accept none: the equality
    # above would then hold whatever the drafter did)
    assert bool((sp.stats.accepted_at.sum(0) > 0).all()), sp.stats.accepted_at
    assert 1.3 < acceptance_metrics(sp.stats)["acceptance_length"] < K + 1


def _forced_rounds(model, prompts, convention, rounds, check):
    """Decode `rounds` rounds with drafts forced from the AR continuation, a varying number of them
    corrupted (every acceptance count 0..K occurs); `check(dec, drafts_logits)` after each draft."""
    B = len(prompts)
    ar = generate(model, prompts, 40, 0).outputs
    vocab = model.cfg.vocab_size
    dec = SpecDecoder(model, K, B, 80, draft_convention=convention)
    dec.prefill(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    active = torch.ones(B, dtype=torch.bool)
    seen = set()
    for r in range(rounds):
        m = dec.m
        wrong = torch.tensor([(r + b) % (K + 1) for b in range(B)])
        force = torch.zeros(B, K, dtype=torch.long)
        for b in range(B):
            at = int(m[b] - lens[b]) + 1
            for j in range(K):
                tok = ar[b][at + j]
                force[b, j] = (tok + 1) % vocab if j >= K - int(wrong[b]) else tok
        drafts, q, logits = dec.draft(force=force, keep_logits=True)
        check(dec, m.clone(), force, logits)
        n, nxt = dec.verify(drafts, q)
        assert torch.equal(n, K - wrong)
        seen.update(n.tolist())
        dec.commit(n, nxt, active)
    assert seen == set(range(K + 1))
    return dec


def served_positions(blocks, m: int, r: int):
    """The key positions vLLM 0.32's reusing draft step (depth k >= 2, `set_skip_topk(True)`)
    attends: the packed row that depth 1's query at m - 1 wrote (`expand_qsa_block_indices`: its
    selected blocks' tokens, then its tail [m // r * r, m - 1]), kept by `compact_topk_indices` and
    read verbatim by the sparse attention kernel. Nothing at m or later, not even the query's own
    key."""
    return sorted({b * r + i for b in blocks for i in range(r)} | set(range(m // r * r, m)))


def _own_tail_positions(blocks, m: int, r: int, p: int):
    """The wrong rule (what the serving convention did before): depth 1's blocks plus the tail of
    the query's own position p = m + k - 2; the test checks that it gives different logits."""
    return sorted({b * r + i for b in blocks for i in range(r)} | set(range((p + 1) // r * r,
                                                                            p + 1)))


@torch.inference_mode()
def served_reuse_draft(model, seq, k, force, rule=None):
    """Depths 1..k's draft logits for committed tokens `seq` (x_0..x_m) as vLLM drafts with QSA
    index reuse, with no cache and an attention of its own: depth 1 runs the MTP layer over rows
    0..m-1 (trunk state t, token t+1), each row attending its own selection (recomputed here from
    the indexer's block scores: top budget / r complete blocks, ties to the earlier block) plus its
    own tail; depth k >= 2 appends one row at position p = m + k - 2 (the previous depth's output
    and draft) after the rows of depths 2..k-1 at m..p-1 (what vLLM's one draft KV cache holds), and
    that row attends only `rule(blocks depth 1 chose at m - 1, m, r, p)` (default
    `served_positions`, which reaches none of the rows at m and after). Returns the logits, the
    drafts fed onwards and depth 1's blocks at m - 1."""
    rule = rule or (lambda blocks, m, r, p: served_positions(blocks, m, r))
    layer = model.mtp.layer_for_step(1)
    attn = layer.block.self_attn
    r, top = attn.compress_ratio, attn.budget // attn.compress_ratio
    m = len(seq) - 1
    h_in = model.trunk(torch.tensor([list(seq[:m])]), torch.arange(m)[None])
    e_in = model.embed_tokens(torch.tensor([list(seq[1 : m + 1])]))
    selected = {}  # row t < m -> the blocks depth 1's query at t selects
    allowed_last = []  # the key positions of the appended row (depth k >= 2)

    def attention(x_bsh, positions_bs, cache=None, *rest):
        s = x_bsh.shape[1]
        if not selected:  # depth 1: every row selects for itself
            q_idx, raw = attn.indexer(x_bsh, positions_bs, attn.rotary)
            n = s // r
            scores = [[] for _ in range(s)]
            if n:
                keys = attn.indexer.block_keys(raw[:, : n * r], positions_bs[:, : n * r : r],
                                               attn.rotary)
                scores = attn.indexer.block_scores(q_idx, keys)[0].tolist()
            for t in range(s):
                selected[t] = sorted(range((t + 1) // r), key=lambda j: (-scores[t][j], j))[:top]
        mask = torch.zeros(s, s, dtype=torch.bool)
        for t in range(min(s, m)):
            for pos in served_positions(selected[t], t + 1, r):  # row t's own selection and tail
                mask[t, pos] = True
        # rows m..p-1 (depths 2..k-1) feed only keys and values to row p
        mask[m:, allowed_last] = True
        q, key, value, gate = attn._qkv(x_bsh, positions_bs)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask[None, None],
                                             enable_gqa=q.shape[1] != key.shape[1])
        return attn.o_proj(out.transpose(1, 2).reshape(1, s, -1) * torch.sigmoid(gate))

    logits, drafts = [], []
    attn.forward = attention  # this instance only, removed below
    try:
        for depth in range(1, k + 1):
            p = m + depth - 2
            if depth > 1:
                allowed_last[:] = rule(selected[m - 1], m, r, p)
            out = layer(h_in, e_in, torch.arange(p + 1)[None])[:, -1:]
            logits.append(model.logits(depth, out)[0, 0])
            drafts.append(int(logits[-1].argmax()) if force is None else int(force[depth - 1]))
            h_in = torch.cat([h_in, out], 1)  # depth + 1's row at m + depth - 1
            e_in = torch.cat([e_in, model.embed_tokens(torch.tensor([[drafts[-1]]]))], 1)
    finally:
        del attn.forward
    return logits, drafts, selected[m - 1]


@pytest.mark.parametrize("family", ["glm", "glm_final_norm", "mla", "qwen4", "qwen4_no_reuse"])
@torch.no_grad()
def test_serving_draft_logits_equal_cache_free_reference(family):
    """Round after round (rollbacks of every length), the serving convention's per-depth draft
    logits equal vLLM's drafting re-derived without caches (for Qwen4-Exp with QSA index reuse:
    depth k attends depth 1's selection row at m - 1, `served_reuse_draft`); the tandem convention's
    do not (the test tells the two apart). `mla`: DeepSeek-V3's attention, whose decoding attends
    over cached latents (kv_b_proj absorbed) where the cache-free forward expands every head."""
    if family.startswith("qwen4"):
        model, prompts = tiny_qwen4_model(K, seed=2, reuse_indices=family == "qwen4"), Q4_PROMPTS
    else:
        trunk_input = "final_norm" if family.endswith("norm") else "pre_norm"
        model, prompts = glm_style(seed=5, agree=False, trunk_input=trunk_input,
                                   flavor="debug_mla" if family == "mla" else "debug"), PROMPTS[:4]
    model = model.double()
    # fp64 throughout except what the hybrid keeps in fp32 (its cached and uncached forms round
    # apart)
    tol = dict(rtol=1e-4, atol=1e-5) if family.startswith("qwen4") else dict(rtol=1e-9, atol=1e-10)
    differs = []

    def check(conv):
        def run(dec, m, force, logits):
            for b in range(len(prompts)):
                seq = dec.seq[b, : int(m[b]) + 1].tolist()
                # QSA index reuse: depth k attends depth 1's row at m - 1 (vLLM's)
                if family == "qwen4":
                    ref, _, _ = served_reuse_draft(model, seq, K, force[b].tolist())
                else:
                    ref, _ = vllm_convention_draft(model, seq, K, force=force[b].tolist())
                for k in range(K):
                    if conv == "serving":
                        torch.testing.assert_close(logits[k][b], ref[k], **tol)
                    else:
                        differs.append(float((logits[k][b] - ref[k]).abs().max()) > 1e-3)
        return run

    _forced_rounds(model, prompts, "serving", 6, check("serving"))
    _forced_rounds(model, prompts, "tandem", 2, check("tandem"))
    assert any(differs)


@torch.no_grad()
def test_serving_reuse_attends_depth_1_row_at_m_minus_1():
    """Issue 31 item 7. Depth k >= 2 at position m + k - 2 attends what vLLM 0.32 attends there: the
    packed selection row of depth 1's query at m - 1 (its blocks and its tail [m // r * r, m - 1]),
    so blocks completed after m - 1, positions m..m+k-2 and the query's own key go unattended, as in
    serving. Checked against `served_reuse_draft` (no cache, selection recomputed from the indexer's
    scores) over rounds at several m per row (m - 1 = 6 with r = 4 and k = 3 among them: 0..6
    attended, 7 and 8 not, where a tail of its own would give 0..3 and 8); the own-tail rule's
    logits differ, so this test fails if the decoder's tail rule is wrong."""
    model = tiny_qwen4_model(K, seed=2).double()
    r = model.mtp.layers[0].block.self_attn.compress_ratio
    assert r == 4 and model.mtp.selection_share is not None
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13],
               [20, 21, 1, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],
               [2, 3, 4, 5, 6, 7, 8, 9, 10]]
    B, g = len(prompts), torch.Generator().manual_seed(0)
    dec = SpecDecoder(model, K, B, 64, draft_convention="serving")
    dec.prefill(prompts)
    checked, wrong_rule_gap = set(), 0.0
    for _ in range(3):
        m = dec.m.clone()
        force = torch.randint(2, model.cfg.vocab_size, (B, K), generator=g)
        drafts, q, logits = dec.draft(force=force, keep_logits=True)
        for b in range(B):
            seq, mb = dec.seq[b, : int(m[b]) + 1].tolist(), int(m[b])
            ref, _, blocks = served_reuse_draft(model, seq, K, force[b].tolist())
            for k in range(K):
                torch.testing.assert_close(logits[k][b], ref[k], rtol=1e-4, atol=1e-5)
                checked.add((mb - 1, k + 1))
            # the example: depth 1 at 6 has one complete block, which it selects
            if mb == 7:
                assert blocks == [0] and served_positions(blocks, mb, r) == list(range(7))
                assert _own_tail_positions(blocks, mb, r, mb + 3 - 2) == [0, 1, 2, 3, 8]
            # more complete blocks than the budget's two: a real top-k was reused
            if (mb + 1) // r > 2:
                assert len(blocks) == 2
            own, _, _ = served_reuse_draft(model, seq, K, force[b].tolist(),
                                           rule=_own_tail_positions)
            wrong_rule_gap = max(wrong_rule_gap,
                                 *(float((own[k] - ref[k]).abs().max()) for k in range(1, K)))
        n, nxt = dec.verify(drafts, q)
        dec.commit(n, nxt, torch.ones(B, dtype=torch.bool))
    assert (6, 3) in checked and any(m1 >= 12 for m1, _ in checked) and (1, 2) in checked
    assert wrong_rule_gap > 1e-3  # the re-derivation tells the two tail rules apart


@pytest.mark.parametrize("trunk_input", ["pre_norm", "final_norm"])
def test_serving_equals_vllm_convention_decode(trunk_input):
    """The evaluator's serving convention = the serving test's reference decode: the same tokens and
    the same counts, vLLM's (every accepted draft) and budget-exact, with EOS and a short budget."""
    model = glm_style(seed=4, trunk_input=trunk_input)
    for max_new, eos in [(24, None), (13, None),
                         (24, generate(model, PROMPTS[:1], 24, 0).outputs[0][9])]:
        with torch.no_grad():
            res = generate(model, PROMPTS, max_new, K, eos_id=eos, draft_convention="serving")
        ref = [vllm_convention_decode(model, p, max_new, K, eos) for p in PROMPTS]
        assert res.outputs == [r[0] for r in ref]
        st = res.stats
        raw = [int(st.rounds.sum()),
               int(st.accepted_all.sum())] + st.accepted_all_at.sum(0).tolist()
        exact = [int(st.rounds.sum()), int(st.accepted.sum())] + st.accepted_at.sum(0).tolist()
        assert raw == [sum(r[1][i] for r in ref) for i in range(K + 2)]
        assert exact == [sum(r[2][i] for r in ref) for i in range(K + 2)]
        # drafts past the budget are vLLM's only
        assert raw[1] > exact[1] or max_new == 24 and eos is None


@torch.no_grad()
def test_serving_depth_k_attends_to_depth_1_entries():
    """Hand-checked on one row (prompt of 3 tokens: m = 3 after prefill). Depth 1 writes positions
    0..2 of the one MTP cache; depth 2 writes only position 3 (= m + 2 - 2) and its query reads the
    cache rows 0..2 exactly as depth 1 left them; depth 3 writes only position 4 and reads depth 1's
    rows 0..2 and depth 2's row 3. The tandem convention gives depth 2 a cache of its own."""
    model = glm_style(seed=6, agree=False).double()
    dec = SpecDecoder(model, K, 1, 40, draft_convention="serving")
    dec.prefill([[3, 4, 5]])
    assert int(dec.m[0]) == 3
    cache = dec.drafter.cache
    calls = []
    update = cache.update

    def recording(k, v, positions):
        keys, values = update(k, v, positions)
        calls.append((positions[0].tolist(), k.clone(), keys.clone()))
        return keys, values

    cache.update = recording
    dec.draft()
    assert [c[0] for c in calls] == [[0, 1, 2], [3], [4]]
    (_, k1, _), (_, k2, seen2), (_, _, seen3) = calls
    # depth 1's rows, as written
    assert seen2.shape[2] == 4 and torch.equal(seen2[:, :, :3], k1[:, :, :3])
    assert torch.equal(seen2[:, :, 3], k2[:, :, 0])  # and its own at m
    assert seen3.shape[2] == 5 and torch.equal(seen3[:, :, :3], k1) and torch.equal(seen3[:, :, 3],
                                                                                    k2[:, :, 0])
    # depth 2's key at m differs from what depth 1 would write there: the query really is depth 2's
    tandem = SpecDecoder(model, K, 1, 40, draft_convention="tandem")
    tandem.prefill([[3, 4, 5]])
    tandem.draft()
    assert len(tandem.drafter.caches) == K and not hasattr(dec.drafter, "caches")
    # its own entries
    assert not torch.allclose(tandem.drafter.caches[1].cache.keys[0][0, :, :2], k1[0, :, :2])


@pytest.mark.parametrize("family", ["glm", "qwen4"])
@torch.no_grad()
def test_serving_cache_rollback_equals_fresh_decoder(family):
    """After every round (every acceptance count), the shared MTP cache's valid prefix (positions
    0..m-1 of the round just drafted) equals a fresh decoder's that prefilled the committed tokens
    and drafted once: keys, values and module buffers (QSA's raw indexer keys and depth 1's recorded
    selections for the Qwen4-Exp drafter)."""
    model, prompts = (tiny_qwen4_model(K, seed=1), Q4_PROMPTS) if family == "qwen4" else \
        (glm_style(seed=2, agree=False), PROMPTS[:4])
    B = len(prompts)
    compared = []

    def check(dec, m, force, logits):
        fresh = SpecDecoder(model, K, B, 80, draft_convention="serving")
        fresh.prefill([dec.seq[b, : int(m[b])].tolist() for b in range(B)],
                      first_tokens=dec.seq[torch.arange(B), m])
        fresh.draft(force=force)
        a, f = dec.drafter.cache.cache, fresh.drafter.cache.cache
        for b in range(B):
            v = int(m[b])
            torch.testing.assert_close(a.keys[0][b, :, :v], f.keys[0][b, :, :v])
            torch.testing.assert_close(a.values[0][b, :, :v], f.values[0][b, :, :v])
            for name, buf in a.buffers[0].items():
                torch.testing.assert_close(buf[b, :v], f.buffers[0][name][b, :v])
            # depth 1's recorded QSA selections (index reuse): the real slots of each position
            if a.shared:
                counts = a.shared["qsa_reuse_counts"][b, :v]
                assert torch.equal(counts, f.shared["qsa_reuse_counts"][b, :v])
                real = torch.arange(a.shared["qsa_reuse_blocks"].shape[-1]) < counts[:, None]
                assert torch.equal(a.shared["qsa_reuse_blocks"][b, :v][real],
                                   f.shared["qsa_reuse_blocks"][b, :v][real])
            compared.append(sorted(a.buffers[0]) + sorted(a.shared))

    _forced_rounds(model, prompts, "serving", 6, check)
    if family == "qwen4":
        assert {"qsa_index_keys", "qsa_reuse_blocks", "qsa_reuse_counts"} <= set(compared[0])


def test_evaluator_logs_the_other_conventions_acceptance_when_it_differs():
    model = tiny_model(K, 1, vocab=8, seed=1, init_std=0.3)  # small vocabulary: chance acceptance
    prompts = [[1, 2, 3, 4, 5], [7, 0], [1, 3, 5, 7, 0, 2, 4, 6, 3], [4, 1, 2], [5]]
    common = dict(num_steps=K, max_new_tokens=24, batch_size=2)
    with torch.no_grad():
        serving, _, _ = evaluate_decoding(model, prompts, draft_convention="serving",
                                          autoregressive=False, **common)
        tandem, _, _ = evaluate_decoding(model, prompts, draft_convention="tandem",
                                         autoregressive=False, **common)
        both = other_convention_figures(model, prompts, serving, draft_convention="serving",
                                        **common)
        l2_model = tiny_model(K, 2, vocab=8, seed=1, init_std=0.3)
        l2, _, _ = evaluate_decoding(l2_model, prompts, autoregressive=False, **common)
        l2_other = other_convention_figures(l2_model, prompts, l2, **common)
    # this model tells them apart
    assert serving["acceptance_length"] != tandem["acceptance_length"]
    # the other convention's acceptance length, with its 95% interval
    assert both == {f"tandem/{k}": v for k,
                    v in tandem.items() if k.startswith("acceptance_length")}
    assert l2_other == {}  # L=2 drafts as trained under both: nothing to add


def test_config_key_and_cli_flag():
    from tandem.trainer.config_checks import ConfigError
    from tandem.trainer.eval_cli import _parser
    from tandem.trainer.recipe import load_config

    assert load_config("recipes/tiny.yaml").eval.draft_convention == "serving"
    with pytest.raises(ConfigError, match="eval.draft_convention"):
        load_config("recipes/tiny.yaml", ["eval.draft_convention=vllm"])
    assert _parser().parse_args(["--checkpoint", "x", "--draft-convention",
                                 "tandem"]).draft_convention == "tandem"
    with pytest.raises(ValueError, match="draft_convention"):
        SpecDecoder(tiny_model(K, 1), K, 1, 20, draft_convention="vllm")
