"""Tiny models for the evaluator's tests: random ones, and ones whose MTP drafts are mostly right."""

from __future__ import annotations

import torch

from tandem.models import MTPConfig, ModelConfig, TandemModel


def tiny_model(num_steps: int = 3, num_layers: int = 1, *, vocab: int = 64, seed: int = 0, style: str = "looped",
               init_std: float = 0.02, dtype: torch.dtype = torch.float32, moe: bool = True) -> TandemModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, moe_intermediate_size=32, num_experts=4 if moe else 0, top_k=2,
                      max_seq_len=256, init_std=init_std)
    model = TandemModel(cfg, MTPConfig(num_steps=num_steps, num_layers=num_layers, style=style))
    return model.to(dtype).eval()


@torch.no_grad()
def make_agreeing(model: TandemModel, noise: float = 0.0, seed: int = 0) -> TandemModel:
    """Make the MTP drafts agree with the trunk: the trunk's residual branches are scaled by `noise`
    (so with noise=0 its next token is a function f(x_t) of the current token), and every MTP layer
    projects only the token embedding (eh_proj = [I, 0] plus noise) so step k predicts f(x_{t+k}).
    With noise=0 every draft is accepted; small noise gives partial acceptance."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            p.mul_(noise)
    # A well-spread embedding and head so f is far from ties.
    H = model.cfg.hidden_size
    model.embed_tokens.weight.copy_(torch.randn(model.embed_tokens.weight.shape, generator=g))
    model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g))
    if model.mtp is not None:
        for layer in model.mtp.layers:
            if not layer.combine:
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
