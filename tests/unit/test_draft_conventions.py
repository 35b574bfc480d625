"""The evaluator's two drafting conventions (eval/draft_serving.py, `eval.draft_convention`).

* both give greedy speculative output equal to autoregressive decoding (fp32), for the GLM-4.5 /
  DeepSeek-V3 combine (concat_proj, with either trunk input) and Qwen4-Exp's drafter (QSA index reuse
  on and off);
* `serving` drafts as vLLM's proposer: its draft logits, round after round with rollbacks, equal a
  cache-free re-derivation (eval/testing.vllm_convention_draft), and its decode equals the serving
  test's `vllm_convention_decode` in tokens and in both counts (vLLM's and budget-exact);
* hand-checked: depth k's single query writes only position m + k - 2 of the one MTP cache and reads
  depth 1's entries at 0..m-1 there;
* the shared cache keeps the rollback contract: after every round its valid prefix equals a fresh
  decoder's on the committed tokens;
* the evaluator logs the other convention's acceptance when it differs; the config key and the CLI flag.
"""

from __future__ import annotations

import pytest
import torch

from tandem.eval.metrics import evaluate_decoding
from tandem.eval.spec_decode import SpecDecoder, acceptance_metrics, generate
from tandem.eval.testing import (make_agreeing, tiny_model, tiny_qwen4_model, vllm_convention_decode,
                                 vllm_convention_draft)

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 3], [40, 41, 42], [6]]
Q4_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 1, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def glm_style(seed=3, trunk_input="pre_norm", agree=True):
    model = tiny_model(K, 1, seed=seed)
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


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("convention", ["serving", "tandem"])
def test_qwen4_drafter_greedy_equals_autoregressive(convention, reuse):
    model = tiny_qwen4_model(K, reuse_indices=reuse)
    assert (model.mtp.selection_share is not None) == reuse
    with torch.no_grad():
        ar = generate(model, Q4_PROMPTS, 20, 0)
        sp = generate(model, Q4_PROMPTS, 20, K, draft_convention=convention)
    assert sp.outputs == ar.outputs
    assert int(sp.stats.rounds.sum()) > 0


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


@pytest.mark.parametrize("family", ["glm", "glm_final_norm", "qwen4", "qwen4_no_reuse"])
@torch.no_grad()
def test_serving_draft_logits_equal_cache_free_reference(family):
    """Round after round (rollbacks of every length), the serving convention's per-depth draft logits
    equal vLLM's drafting re-derived without caches (for Qwen4-Exp with QSA index reuse: depth k
    attends over depth 1's selection at m - 1); the tandem convention's do not (the test tells the two
    apart)."""
    if family.startswith("qwen4"):
        model, prompts = tiny_qwen4_model(K, seed=2, reuse_indices=family == "qwen4"), Q4_PROMPTS
    else:
        trunk_input = "final_norm" if family.endswith("norm") else "pre_norm"
        model, prompts = glm_style(seed=5, agree=False, trunk_input=trunk_input), PROMPTS[:4]
    model = model.double()
    # fp64 throughout except what the hybrid keeps in fp32 (its cached and uncached forms round apart)
    tol = dict(rtol=1e-4, atol=1e-5) if family.startswith("qwen4") else dict(rtol=1e-9, atol=1e-10)
    differs = []

    def check(conv):
        def run(dec, m, force, logits):
            for b in range(len(prompts)):
                seq = dec.seq[b, : int(m[b]) + 1].tolist()
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


@pytest.mark.parametrize("trunk_input", ["pre_norm", "final_norm"])
def test_serving_equals_vllm_convention_decode(trunk_input):
    """The evaluator's serving convention = the serving test's reference decode: the same tokens and
    the same counts, vLLM's (every accepted draft) and budget-exact, with EOS and a short budget."""
    model = glm_style(seed=4, trunk_input=trunk_input)
    for max_new, eos in [(24, None), (13, None), (24, generate(model, PROMPTS[:1], 24, 0).outputs[0][9])]:
        with torch.no_grad():
            res = generate(model, PROMPTS, max_new, K, eos_id=eos, draft_convention="serving")
        ref = [vllm_convention_decode(model, p, max_new, K, eos) for p in PROMPTS]
        assert res.outputs == [r[0] for r in ref]
        st = res.stats
        raw = [int(st.rounds.sum()), int(st.accepted_all.sum())] + st.accepted_all_at.sum(0).tolist()
        exact = [int(st.rounds.sum()), int(st.accepted.sum())] + st.accepted_at.sum(0).tolist()
        assert raw == [sum(r[1][i] for r in ref) for i in range(K + 2)]
        assert exact == [sum(r[2][i] for r in ref) for i in range(K + 2)]
        assert raw[1] > exact[1] or max_new == 24 and eos is None  # drafts past the budget are vLLM's only


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
    cache = dec.serving.cache
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
    assert seen2.shape[2] == 4 and torch.equal(seen2[:, :, :3], k1[:, :, :3])  # depth 1's rows, as written
    assert torch.equal(seen2[:, :, 3], k2[:, :, 0])  # and its own at m
    assert seen3.shape[2] == 5 and torch.equal(seen3[:, :, :3], k1) and torch.equal(seen3[:, :, 3], k2[:, :, 0])
    # depth 2's key at m differs from what depth 1 would write there: the query really is depth 2's
    tandem = SpecDecoder(model, K, 1, 40, draft_convention="tandem")
    tandem.prefill([[3, 4, 5]])
    tandem.draft()
    assert len(tandem.mtp_caches) == K and dec.mtp_caches == []
    assert not torch.allclose(tandem.mtp_caches[1].cache.keys[0][0, :, :2], k1[0, :, :2])  # its own entries


@pytest.mark.parametrize("family", ["glm", "qwen4"])
@torch.no_grad()
def test_serving_cache_rollback_equals_fresh_decoder(family):
    """After every round (every acceptance count), the shared MTP cache's valid prefix (positions
    0..m-1 of the round just drafted) equals a fresh decoder's that prefilled the committed tokens and
    drafted once: keys, values and module buffers (QSA's raw indexer keys and depth 1's recorded
    selections for the Qwen4-Exp drafter)."""
    model, prompts = (tiny_qwen4_model(K, seed=1), Q4_PROMPTS) if family == "qwen4" else \
        (glm_style(seed=2, agree=False), PROMPTS[:4])
    B = len(prompts)
    compared = []

    def check(dec, m, force, logits):
        fresh = SpecDecoder(model, K, B, 80, draft_convention="serving")
        fresh.prefill([dec.seq[b, : int(m[b])].tolist() for b in range(B)], first_tokens=dec.seq[torch.arange(B), m])
        fresh.draft(force=force)
        a, f = dec.serving.cache.cache, fresh.serving.cache.cache
        for b in range(B):
            v = int(m[b])
            torch.testing.assert_close(a.keys[0][b, :, :v], f.keys[0][b, :, :v])
            torch.testing.assert_close(a.values[0][b, :, :v], f.values[0][b, :, :v])
            for name, buf in a.buffers[0].items():
                torch.testing.assert_close(buf[b, :v], f.buffers[0][name][b, :v])
            if a.shared:  # depth 1's recorded QSA selections (index reuse): the real slots of each position
                counts = a.shared["qsa_reuse_counts"][b, :v]
                assert torch.equal(counts, f.shared["qsa_reuse_counts"][b, :v])
                real = torch.arange(a.shared["qsa_reuse_blocks"].shape[-1]) < counts[:, None]
                assert torch.equal(a.shared["qsa_reuse_blocks"][b, :v][real], f.shared["qsa_reuse_blocks"][b, :v][real])
            compared.append(sorted(a.buffers[0]) + sorted(a.shared))

    _forced_rounds(model, prompts, "serving", 6, check)
    if family == "qwen4":
        assert {"qsa_index_keys", "qsa_reuse_blocks", "qsa_reuse_counts"} <= set(compared[0])


def test_evaluator_logs_the_other_conventions_acceptance_when_it_differs():
    model = tiny_model(K, 1, vocab=8, seed=1, init_std=0.3)  # small vocabulary: chance acceptance
    prompts = [[1, 2, 3, 4, 5], [7, 0], [1, 3, 5, 7, 0, 2, 4, 6, 3], [4, 1, 2], [5]]
    common = dict(num_steps=K, max_new_tokens=24, batch_size=2, autoregressive=False)
    with torch.no_grad():
        serving, _, _ = evaluate_decoding(model, prompts, draft_convention="serving", **common)
        tandem, _, _ = evaluate_decoding(model, prompts, draft_convention="tandem", **common)
        both, _, _ = evaluate_decoding(model, prompts, draft_convention="serving", compare_conventions=True, **common)
        l2, _, _ = evaluate_decoding(tiny_model(K, 2, vocab=8, seed=1, init_std=0.3), prompts,
                                     compare_conventions=True, **common)
    assert serving["acceptance_length"] != tandem["acceptance_length"]  # this model tells them apart
    assert both == {**serving, "tandem/acceptance_length": tandem["acceptance_length"]}
    assert not any("/acceptance_length" in k for k in l2)  # L=2 drafts as trained under both: nothing to add


def test_config_key_and_cli_flag():
    from tandem.eval.cli import _parser
    from tandem.trainer.config import ConfigError, load_config

    assert load_config("recipes/tiny.yaml").eval.draft_convention == "serving"
    with pytest.raises(ConfigError, match="eval.draft_convention"):
        load_config("recipes/tiny.yaml", ["eval.draft_convention=vllm"])
    assert _parser().parse_args(["--checkpoint", "x", "--draft-convention", "tandem"]).draft_convention == "tandem"
    with pytest.raises(ValueError, match="draft_convention"):
        SpecDecoder(tiny_model(K, 1), K, 1, 20, draft_convention="vllm")
