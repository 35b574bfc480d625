"""Tiny models for the evaluator's tests (random ones, ones whose MTP drafts are mostly right, a
Qwen4-Exp hybrid with its drafter) and `vllm_convention_decode`, a cache-free re-derivation of how
vLLM's MTP proposer drafts and counts (the serving test and the serving convention's unit tests
compare against it)."""

from __future__ import annotations

import torch

from tandem.models import MTPConfig, TandemModel, flavors


def tiny_model(num_steps: int = 3, num_layers: int = 1, *, vocab: int = 64, seed: int = 0,
               style: str = "looped",
               init_std: float = 0.02, dtype: torch.dtype = torch.float32,
               moe: bool = True, flavor: str = "debug") -> TandemModel:
    torch.manual_seed(seed)
    cfg = flavors.model_config(flavor, vocab_size=vocab, num_experts=4 if moe else 0, top_k=2,
                               max_seq_len=256, init_std=init_std)
    model = TandemModel(cfg, MTPConfig(num_steps=num_steps, num_layers=num_layers, style=style))
    return model.to(dtype).eval()


@torch.no_grad()
def make_agreeing(model: TandemModel, noise: float = 0.0, seed: int = 0) -> TandemModel:
    """Make the MTP drafts agree with the trunk: the trunk's residual branches (attention, Gated
    DeltaNet, MLP and PLE outputs) are scaled by `noise` (so with noise=0 its next token is a
    function f(x_t) of the current token), and every MTP layer passes on only the token embedding
    (eh_proj = [I, 0] plus noise; Qwen4-Exp's drafter: fc_embedding = I plus noise, fc_hidden scaled
    by noise) so step k predicts f(x_{t+k}). With noise=0 every draft is accepted; small noise gives
    partial acceptance."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight",
                          "experts.down_proj", "ple.value_proj.weight")):
            p.mul_(noise)
    # A well-spread embedding and head so f is far from ties.
    H = model.cfg.hidden_size
    model.embed_tokens.weight.copy_(torch.randn(model.embed_tokens.weight.shape, generator=g))
    model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g))
    if model.mtp is not None:
        for layer in model.mtp.layers:
            if layer.combine_style == "qwen4_exp":
                # the streams stay near the repeated embedding; the layer mixes them with the
                # trunk's final mixer (its per-stream norm makes the drafter's normalised embedding
                # and the trunk's raw one agree)
                fc = (torch.eye(H) + noise * torch.randn(H, H, generator=g),
                      noise * torch.randn(H, H, generator=g))
                layer.fc_embedding.weight.copy_(fc[0].to(layer.fc_embedding.weight.dtype))
                layer.fc_hidden.weight.copy_(fc[1].to(layer.fc_hidden.weight.dtype))
                layer.norm.load_state_dict(model.norm.state_dict())
            if layer.combine_style != "concat_proj":
                continue
            w = torch.zeros(H, 2 * H)
            eye = torch.eye(H)
            if layer.emb_first:
                w[:, :H] = eye
            else:
                w[:, H:] = eye
            w += noise * torch.randn(w.shape, generator=g)
            layer.eh_proj.weight.copy_(w.to(layer.eh_proj.weight.dtype))
    return model


def tiny_qwen4_model(num_steps: int = 3, *, vocab: int = 64, seed: int = 0,
                     reuse_indices: bool = True) -> TandemModel:
    """A tiny Qwen4-Exp hybrid (Gated DeltaNet, QSA, hyper-connection streams, PLE, MoE with a gated
    shared expert) with its drafter (`mtp.combine=qwen4_exp`, one looped QSA layer; `reuse_indices`:
    mtp.qsa_reuse_indices), every parameter moved away from its init
    (tests/unit/test_qwen4_spec_decode.py's shape)."""
    cfg = flavors.model_config("debug_qwen4", vocab_size=vocab, init_std=0.3)
    torch.manual_seed(seed)
    model = TandemModel(cfg, MTPConfig(num_steps=num_steps, num_layers=1,
                                       qsa_reuse_indices=reuse_indices))
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@torch.inference_mode()
def vllm_convention_draft(model, seq, k, force=None):
    """Depths 1..k's draft logits ([k] tensors [V]) and drafts after the committed tokens `seq`
    (x_0..x_m, x_m the newest), drafted as vLLM's MTP proposer does, with no cache: the MTP layer
    runs over one causal sequence whose rows 0..m-1 hold the depth-1 inputs (trunk state t -- normed
    under mtp.trunk_input=final_norm --, token t+1; the embedding zeroed at position 0 for the
    concat_proj combine, as GLM-4.5's and DeepSeek-V3's MTP layers do, not for Qwen4-Exp's) and
    whose rows m, m+1, .. hold depth 2, 3, ..'s single input (the previous depth's output and
    draft), which is exactly what vLLM's one draft KV cache holds. `force` [k] replaces the drafts
    fed onwards. Independent of eval/draft_serving.py, which drafts the same way on position-indexed
    caches."""
    m = len(seq) - 1
    pos_all = torch.arange(m + k + 1).unsqueeze(0)
    h_in = model.trunk(torch.tensor([list(seq[:m])]), pos_all[:, :m])
    if model.mtp_cfg.trunk_input == "final_norm":
        h_in = model.norm(h_in)  # what vLLM hands its proposer
    e_in = model.embed_tokens(torch.tensor([list(seq[1 : m + 1])]))
    if model.mtp.layer_for_step(1).combine_style == "concat_proj":
        e_in[:, 0] = 0.0  # GLM-4.5 / DeepSeek-V3 zero the MTP embedding input at position 0
    if getattr(model.mtp, "selection_share", None) is not None:
        # vLLM's reusing steps attend depth 1's packed row at m - 1 verbatim, which no cache-free
        # training forward reproduces; tests/unit/test_draft_conventions.py re-derives that case
        # itself
        raise ValueError("vllm_convention_draft does not re-derive QSA index reuse "
                         "(mtp.qsa_reuse_indices)")
    logits, drafts = [], []
    for depth in range(1, k + 1):
        last = model.mtp.layer_for_step(depth)(h_in, e_in, pos_all[:, : h_in.shape[1]])[:, -1:]
        logits.append(model.logits(depth, last)[0, 0])
        drafts.append(int(logits[-1].argmax()) if force is None else int(force[depth - 1]))
        # depth + 1: hidden = this depth's output, token = its draft, at the next position
        h_in = torch.cat([h_in, last], 1)
        e_in = torch.cat([e_in, model.embed_tokens(torch.tensor([[drafts[-1]]]))], 1)
    return logits, drafts


@torch.inference_mode()
def vllm_convention_decode(model, prompt, max_new, k, eos=None):
    """Greedy speculative decode of one prompt with the drafting and counting of vLLM 0.32's MTP
    proposer (`llm_base_proposer.py` with `Glm4MoeMTP` / `DeepSeekMTP` / `Qwen4ExpMTP`; drafting:
    `vllm_convention_draft`). Returns (tokens, counts, budget-exact counts); counts are [drafts,
    accepted, accepted at position 1..k]: vLLM's (every accepted draft of a round, also past
    max_tokens or the stop token) and Tandem's budget-exact ones (only drafts that reach the
    output). No caches: each forward recomputes the whole prefix."""
    seq = list(prompt)
    pos_all = torch.arange(len(prompt) + max_new + k + 2).unsqueeze(0)

    def trunk(tokens):
        return model.trunk(torch.tensor([tokens]), pos_all[:, : len(tokens)])

    seq.append(int(model.logits(0, trunk(seq)[:, -1:]).argmax(-1)))
    out = [seq[-1]]
    raw, exact = [0] * (k + 2), [0] * (k + 2)
    while len(out) < max_new and eos not in out:
        m = len(seq) - 1
        _, ds = vllm_convention_draft(model, seq, k)
        a = model.logits(0, trunk(seq + ds)[:, m:]).argmax(-1)[0].tolist()
        n = 0
        while n < k and ds[n] == a[n]:
            n += 1
        new = ds[:n] + [a[n]]
        emitted = min(n + 1, max_new - len(out))
        if eos in new[:emitted]:
            emitted = new.index(eos) + 1
        n_exact = emitted - 1
        for counts, c in ((raw, n), (exact, n_exact)):
            counts[0] += 1
            counts[1] += c
            for i in range(c):
                counts[2 + i] += 1
        seq += new
        out += new
    out = out[:max_new]
    return (out[: out.index(eos) + 1] if eos in out else out), raw, exact


@torch.no_grad()
def transformers_mtp_decode(hf, prompt: torch.Tensor, max_new_tokens: int):
    """transformers' own greedy MTP decoding (`generate(use_mtp=True)`) of one prompt [1, n]: its
    new tokens, and how many of its drafts were accepted: each round's drafts, recorded as its
    `MTPCandidateGenerator` returns them, counted up to the first that differs from the token
    generated at its position. A last round's draft that lands on the budget's last token counts,
    as in `DecodeStats.accepted_all` (the budget-exact `accepted` counts that token as the
    verifier's)."""
    from transformers.generation import candidate_generator

    cls = candidate_generator.MTPCandidateGenerator
    original, drafts = cls.get_candidates, []

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        drafts.append((input_ids.shape[1], ids[0, input_ids.shape[1]:].tolist()))
        return ids, logits

    cls.get_candidates = recording
    try:
        out = hf.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, use_mtp=True)
    finally:
        cls.get_candidates = original
    out, accepted = out[0].tolist(), 0
    for start, tokens in drafts:
        for i, token in enumerate(tokens):
            if start + i >= len(out) or out[start + i] != token:
                break
            accepted += 1
    return out[prompt.shape[1]:], accepted
