"""Qwen4-Exp trunk parity with transformers' `Qwen4ExpForCausalLM` (the independent oracle), on a
tiny random config that switches every part on: Gated DeltaNet layers, QSA layers whose budget is
well below the sequence length (selection active), PLE n-gram memory on two layers, 4
hyper-connection streams and a 512-expert-style MoE in miniature (softmax router, gated shared
expert). fp32.

- a transformers-saved directory (PLE tables split into shards) imports into Tandem: logits within
  1e-5 relative, gradients of a loss within 2e-4;
- greedy decoding with Tandem's decoder state gives transformers' generated tokens;
- a Tandem-built model exports (`--family qwen4_exp`) into what transformers loads with the same
  logits;
- blocks with tied indexer scores: Tandem selects as transformers does with a stable top-k.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as T

from tandem.eval.spec_decode import generate
from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.gated_deltanet import qkv_rows_from_hf
from tandem.models.mtp_config import MTPConfig
from tandem.trainer.hf.export import export_hf
from tandem.trainer.hf.importer import load_hf_model
from tests.eval_helpers import make_agreeing

VOCAB, EOS, S = 96, 1, 40


def hf_config(**over):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2,
              head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=24,
              num_experts=6,
              num_experts_per_tok=2, hc_count=4, hc_lowrank=8, ple_layer_ids=[1, 3], ngram_size=3,
              heads_per_ngram=2,
              ngram_vocab_size_base=97, split_ngram_parts=4, indexer_n_heads=16, indexer_kv_heads=1,
              indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
              full_attention_interval=2, eos_token_id=EOS, max_position_embeddings=128,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5})
    kw.update(over)
    return T.Qwen4ExpTextConfig(**kw)


# 16 indexer heads: a block's score is a sum of ReLUs, exactly 0 when every head's dot product is
# negative; with few heads such ties (which transformers breaks arbitrarily, Tandem towards the
# earlier block) would decide the selection.
def make_hf(seed=0, **over):
    torch.manual_seed(seed)
    model = T.Qwen4ExpForCausalLM(hf_config(**over)).eval()
    with torch.no_grad():  # away from the init (zero norms, zero PLE conv) so every tensor matters
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0, 0.15 if p.ndim > 1 else 0.1)
    return model


def tokens(b, s, seed=1):
    ids = torch.randint(2, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))
    ids[0, s // 3] = EOS  # PLE's n-grams stop at an end of document
    return ids


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf()
    path = tmp_path_factory.mktemp("q4") / "hf"
    hf.save_pretrained(path)
    model, cfg = load_hf_model(str(path))
    return hf, model, cfg, path


# fp32 gradients of sums over every token differ by their summation order: the routed experts are
# combined in fp32 in a fixed order here (models/moe.py) and by index_add_ in transformers, and the
# difference reaches 1.24e-4 of the largest element of a hyper-connection weight's gradient
# (cancelling sums); a wrong formula is off by O(1)
GRAD_RTOL = 2e-4

def test_import_logits_and_gradients_match_transformers(pair):
    hf, model, cfg, _ = pair
    assert [cfg.model.layer_type(i) for i in range(4)] == ["linear_attention",
                                                           "indexed_attention"] * 2
    assert cfg.model.ple_layers == [0, 2] and cfg.model.hc_count == 4
    ids = tokens(2, S)
    pos = torch.arange(S).expand(2, S)
    ref = hf(ids).logits
    ours = model.logits(0, model.trunk(ids, pos))
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * weight).sum().backward()
    (ours * weight).sum().backward()
    hf_params = dict(hf.named_parameters())
    pairs = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
        "norm.input_mix_weight_up.weight":
            "model.hyper_connection_mixer.input_mix_weight_up.weight",
        "layers.0.linear_attn.A_log": "model.layers.0.linear_attn.A_log",
        "layers.0.linear_attn.in_proj_qkv.weight": "model.layers.0.linear_attn.in_proj_qkv.weight",
        "layers.0.ple.ple_embedding.ngram_embedding.weight":
            "model.layers.0.ple.ple_embedding.ngram_embedding.weight",
        "layers.0.ple.conv1d.weight": "model.layers.0.ple.conv1d.weight",
        "layers.1.self_attn.q_proj.weight": "model.layers.1.self_attn.q_proj.weight",
        "layers.1.self_attn.q_norm.weight": "model.layers.1.self_attn.q_norm.weight",
        "layers.1.attn_hyper_connection.block_inject_weight.weight":
            "model.layers.1.attn_hyper_connection.block_inject_weight.weight",
        "layers.3.mlp.router.weight": "model.layers.3.mlp.gate.weight",
        "layers.3.mlp.shared_expert_gate.weight": "model.layers.3.mlp.shared_expert_gate.weight",
        "layers.3.mlp.experts.down_proj": "model.layers.3.mlp.experts.down_proj",
    }
    ours_params = dict(model.named_parameters())
    # Gated DeltaNet's qkv rows are stored by key-head group here, [q | k | v] in transformers
    qkv_rows = qkv_rows_from_hf(2, 4, 8, 8)
    for mine, theirs in pairs.items():
        a, b = ours_params[mine].grad, hf_params[theirs].grad
        assert a is not None and b is not None, mine
        if mine.endswith("in_proj_qkv.weight"):
            b = b[qkv_rows]
        assert (a - b).abs().max() <= GRAD_RTOL * max(b.abs().max().item(), 1e-3), mine
    # the experts' gate/up gradients against transformers' fused gate_up_proj
    gate_up = hf_params["model.layers.3.mlp.experts.gate_up_proj"].grad
    inner = gate_up.shape[1] // 2
    for mine, part in (("layers.3.mlp.experts.gate_proj", gate_up[:, :inner]),
                       ("layers.3.mlp.experts.up_proj",
                                                                                gate_up[:,
                                                                                        inner:])):
        assert (ours_params[mine].grad - part).abs().max() <= GRAD_RTOL * part.abs().max()
    model.zero_grad(set_to_none=True)


def test_greedy_decoding_with_state_matches_transformers_generate(pair):
    hf, model, cfg, _ = pair
    prompt = tokens(1, 13, seed=3)[0].tolist()
    new = 12
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        out = generate(model, [prompt], new, num_steps=0).outputs
    assert out[0][:new] == ref


def run_tokens(b, s, seed):
    """Token ids with what real text puts into a linear-attention chunk: a 100-token run of one
    token across two chunk boundaries (positions 30..129) and a period-3 stretch after it."""
    ids = tokens(b, s, seed=seed)
    ids[:, 30:130] = ids[:, 30:31]
    ids[:, 133:] = ids[:, 130:133].repeat(1, s // 3)[:, :s - 133]
    return ids


@pytest.fixture(scope="module")
def slow_pair(tmp_path_factory):
    """The tiny model with slow linear-attention decay, A = exp(A_log) ~ U(0.001, 0.05), so the
    state carries across chunks and the chunk solve sees strongly coupled tokens."""
    hf = make_hf(seed=4, max_position_embeddings=256)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.001, 0.05).log())
    path = tmp_path_factory.mktemp("q4slow") / "hf"
    hf.save_pretrained(path)
    model, _ = load_hf_model(str(path))
    return hf, model


def test_logits_match_transformers_past_several_chunks_on_runs_of_one_token(slow_pair):
    hf, model = slow_pair
    s = 160  # two full 64-token chunks and a partial one: the state crosses chunk boundaries
    ids = run_tokens(1, s, seed=6)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model.logits(0, model.trunk(ids, torch.arange(s).expand(1, s)))
    # per token: a wrong chunk solve or boundary shows at the positions it breaks
    err_t = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert err_t.max() <= 1e-5, int(err_t.argmax())


def test_greedy_decoding_after_a_long_run_matches_transformers_generate(slow_pair):
    hf, model = slow_pair
    # the run, then the periodic stretch: chunked prefill
    prompt = run_tokens(1, 140, seed=7)[0].tolist()
    new = 12
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        out = generate(model, [prompt], new, num_steps=0).outputs
    assert out[0][:new] == ref


def test_tied_block_scores_select_as_a_stable_top_k_does(tmp_path, monkeypatch):
    """With 2 indexer heads, on a run of one token and on a repeated 4-token pattern, many blocks
    score exactly 0 (every head's dot product negative) and the ties decide the selection. Tandem
    breaks them towards the earlier block in every path; transformers' `topk` in no fixed order
    (its logits then differ by up to 30%). With its block `topk` made stable, earlier first,
    transformers gives Tandem's logits, per token."""
    hf = make_hf(seed=0, indexer_n_heads=2)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_hf_model(str(tmp_path / "hf"))
    s = 64
    ids = torch.stack([torch.full((s,), 7), torch.tensor([5, 6, 7, 8] * (s // 4))])
    with torch.no_grad():
        ours = model.logits(0, model.trunk(ids, torch.arange(s).expand(2, s)))
    topk, tied = torch.Tensor.topk, []

    def stable_topk(scores, k, dim=-1, largest=True, sorted=True):
        if scores.dim() != 1 or not largest:  # the router's top-k is 2-D
            return topk(scores, k, dim, largest, sorted)
        order = torch.sort(scores, descending=True, stable=True).indices
        tied.append(k < len(order) and bool(scores[order[k - 1]] == scores[order[k]]))
        return torch.return_types.topk((scores[order[:k]], order[:k]))

    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)
    with torch.no_grad():
        ref = hf(ids).logits
    assert sum(tied) > 20  # the ties at the k-th block are real and many (53 of them)
    err_t = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert err_t.max() <= 1e-5, err_t.argmax().tolist()


@pytest.mark.parametrize("reuse", [True, False])
def test_the_drafters_qsa_reuse_survives_the_round_trip(tmp_path, reuse):
    """The export records whether depths 2..K reuse depth 1's QSA selection
    (`index_share_for_mtp_iteration`, which vLLM reads, default off); the import left it at
    Tandem's default (on), so `tandem eval --hf` drafted a reuse-off drafter as it was not
    trained."""
    from tests.eval_helpers import tiny_qwen4_model

    out = tmp_path / "out"
    export_hf(tiny_qwen4_model(3, vocab=64, reuse_indices=reuse), str(out), "qwen4_exp")
    assert json.loads((out / "config.json").read_text())["index_share_for_mtp_iteration"] is reuse
    _, cfg = load_hf_model(str(out))
    assert cfg.mtp.qsa_reuse_indices is reuse


def test_export_loads_in_transformers_with_same_logits(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=8,
                      moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
                      top_k=2,
                      num_shared_experts=1, shared_expert_gate=True, first_k_dense=0,
                      router_score="softmax",
                      balance="aux_loss", zero_centered_norm=True, full_attention_interval=2,
                      partial_rotary_factor=0.5,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8,
                      indexer_heads=16, indexer_head_dim=8, indexer_budget=8,
                      indexer_compress_ratio=4, hc_count=4,
                      hc_lowrank=8, ple_layers=[0, 2], heads_per_ngram=2, ngram_vocab_base=97,
                      eos_token_id=EOS, max_seq_len=128)
    mtp = MTPConfig(num_steps=2, num_layers=1)
    torch.manual_seed(0)
    model = TandemModel(cfg, mtp).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path / "export"
    export_hf(model, str(out), "qwen4_exp", cfg=cfg, mtp=mtp)
    hf = T.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokens(2, S, seed=4)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model.logits(0, model.trunk(ids, torch.arange(S).expand(2, S)))
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    prompt = tokens(1, 11, seed=5)[0].tolist()
    # greedy tokens: transformers on the export = Tandem's own decoder, spec and AR
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert generate(model, [prompt], 10, 0).outputs[0] == theirs
    # ... and speculative decoding with drafts the trunk partly accepts (this random drafter's are
    # all rejected), on the export of a model whose drafter agrees with its trunk
    agreeing = make_agreeing(copy.deepcopy(model), 0.05, seed=2)
    export_hf(agreeing, str(tmp_path / "agreeing"), "qwen4_exp", cfg=cfg, mtp=mtp)
    hf_agreeing = T.AutoModelForCausalLM.from_pretrained(tmp_path / "agreeing").eval()
    with torch.no_grad():
        theirs = hf_agreeing.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        spec = generate(agreeing, [prompt], 10, 2)
    assert spec.outputs[0] == theirs
    assert spec.stats.accepted_at[0].min() > 0, spec.stats.accepted_at  # at both depths
    # ... and the exported directory imports back with its MTP drafter, drafting the K=2 its one
    # layer was trained at (config.json's tandem_mtp_num_steps)
    back, bcfg = load_hf_model(str(out))
    assert (bcfg.mtp.num_steps, bcfg.mtp.num_layers) == (2, 1)
    assert bcfg.mtp.resolved_combine(bcfg.model) == "qwen4_exp"
    for name, p in back.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name]), name


@pytest.mark.parametrize("name, over, edit", [
    # a legacy rope_scaling wins over rope_parameters, which transformers then ignores
    ("rope_scaling", {}, lambda c: c.update(rope_scaling={"rope_type": "default",
                                                          "rope_theta": 50.0})),
    # fields left out read as Qwen4ExpTextConfig's defaults (the import guessed or failed)
    ("defaults", dict(shared_expert_intermediate_size=512, linear_num_key_heads=16,
                      linear_num_value_heads=32),
     lambda c: [c.pop(k) for k in ("shared_expert_intermediate_size", "linear_num_key_heads",
                                   "linear_num_value_heads")]),
    # PLE layers listed out of order: transformers sorts them and numbers the tables so
    ("ple_order", {}, lambda c: c.update(ple_layer_ids=[3, 1])),
    # 768-row tables in 512 parts: torch.chunk saved 384 blocks of 2 rows
    ("ple_blocks", dict(split_ngram_parts=512, ngram_vocab_size_base=157), None),
])
def test_config_fields_read_as_transformers_reads_them(name, over, edit, tmp_path):
    """A config.json transformers reads its own way: Tandem's logits equal the ones transformers
    computes from the same directory (rope_scaling was read second, off by 0.69; the others were
    refused on loading)."""
    make_hf(**over).save_pretrained(tmp_path)
    if edit is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    hf = T.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    model, _ = load_hf_model(str(tmp_path))
    ids = tokens(2, 24)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model.logits(0, model.trunk(ids, torch.arange(24).expand(2, 24)))
    assert (ref - ours).abs().max().item() < 1e-4, name
