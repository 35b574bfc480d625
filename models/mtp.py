"""The multi-token-prediction module and the per-depth target masks.

Depth d = 0 is the trunk's own next-token head; depth k = 1..K is MTP step k. At position t of a
window of S+1 tokens, depth d predicts token t+1+d. Step k (looped style, DeepSeek-V3 / Qwen3-Next)
combines the previous depth's hidden state with the embedding of token t+k:

    h_k = layer[(k-1) % L]( eh_proj(cat(enorm(emb(x_{t+k})), hnorm(h_{k-1}))) )
    logits_k = head(norm_k(h_k))     (norm_k is the norm of the physical layer used)

The parallel style (Gloeckle et al. 2024) instead runs K independent layers on the trunk's hidden
state: h_k = layer[k-1](h_0).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .attention import LayerKV
from .config import ModelConfig
from .hyper_connection import HyperConnection
from .layers import RMSNorm
from .mtp_config import MTPConfig
from .qsa import IndexedAttention
from .qsa_index import SelectionShare


def depth_target_mask(loss_mask_bs: torch.Tensor, doc_ids_bs1: Optional[torch.Tensor],
                      depth: int) -> torch.Tensor:
    """Bool [B,S]: whether depth `depth` has a valid target at each position.

    Valid iff the target t+1+depth lies inside the window (no wrapped tokens), the data loss mask of
    that target is set, and no document boundary separates token t from its target (packed
    documents; doc_ids[b, i] is the document of token i: data_pipeline/batches.py get_batch).
    """
    b, s = loss_mask_bs.shape
    mask = torch.zeros(b, s, dtype=torch.bool, device=loss_mask_bs.device)
    valid = s - depth
    if valid <= 0:
        return mask
    ok = loss_mask_bs[:, depth:] > 0
    if doc_ids_bs1 is not None:
        ok = ok & (doc_ids_bs1[:, :valid] == doc_ids_bs1[:, depth + 1 : depth + 1 + valid])
    mask[:, :valid] = ok
    return mask


def depth_input_rows(tokens_bs1: torch.Tensor, doc_ids_bs1: Optional[torch.Tensor],
                     depth: int) -> torch.Tensor:
    """Bool [B,S]: the rows whose MTP step-`depth` input, token t+depth, lies inside the window and
    in token t's document. The others read zero padding or the next document, and have no target at
    this depth or a later one: an MoE layer of the step leaves them out of its loads and auxiliary
    losses and a QSA indexer out of its KL (`TandemModel.depth_states`), so a packed document's
    statistics are the document's alone."""
    b, s = tokens_bs1.shape[0], tokens_bs1.shape[1] - 1
    mask = torch.zeros(b, s, dtype=torch.bool, device=tokens_bs1.device)
    inside = min(s, s + 1 - depth)
    if inside <= 0:
        return mask
    if doc_ids_bs1 is None:
        mask[:, :inside] = True
    else:
        mask[:, :inside] = doc_ids_bs1[:, :inside] == doc_ids_bs1[:, depth: depth + inside]
    return mask


def shifted_tokens(tokens_bs1: torch.Tensor, shift: int, length: int) -> torch.Tensor:
    """tokens[:, t + shift] for t < length, zero-padded past the window (those positions are
    masked)."""
    out = tokens_bs1[:, shift : shift + length]
    pad = length - out.shape[1]
    if pad > 0:
        out = torch.cat([out, out.new_zeros(out.shape[0], pad)], dim=1)
    return out


def model_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """An RMSNorm of this model family (zero-centred for Qwen3-Next / Qwen4-Exp)."""
    return RMSNorm(dim, cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm)


def final_norm_module(cfg: ModelConfig) -> nn.Module:
    """What turns a block stack's output into the head's input: an RMSNorm, or with
    hyper-connections the stream mixer that collapses the hc_count streams (transformers'
    `hyper_connection_mixer`)."""
    if cfg.hc_count > 1:
        return HyperConnection(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps,
                               combine=False)
    return model_norm(cfg, cfg.hidden_size)


class MTPLayer(nn.Module):
    """One physical MTP layer: input combination (looped style), a transformer block, a final norm.

    Two combinations (`mtp.combine`):
    * `concat_proj` (DeepSeek-V3 / GLM-4.5 / Qwen3-Next): x = eh_proj(cat(enorm(emb),
      hnorm(h_prev))).
    * `qwen4_exp` (Qwen4-Exp's drafter, vLLM's `Qwen4ExpMTP`): h_prev is the previous depth's
      multi-stream state [B, S, hc x H] (the trunk's, before its final stream mixer, at depth 1);
      `pre_fc_norm_hidden` normalises it over all hc x H channels, `fc_hidden` (one H x H matrix
      shared by the streams) projects each stream, and fc_embedding(pre_fc_norm_embedding(emb)) is
      added to every stream with unit weight. The block keeps the streams; its output is the next
      depth's h_prev, and the layer's own stream mixer (`norm`) collapses it for the head.
    """

    def __init__(self, cfg: ModelConfig, mtp: MTPConfig, block: nn.Module):
        super().__init__()
        self.combine = mtp.style == "looped"
        self.combine_style = mtp.resolved_combine(cfg) if self.combine else "none"
        self.emb_first = mtp.concat_order == "emb_hidden"
        self.hc_count, self.hidden_size = cfg.hc_count, cfg.hidden_size
        if self.combine_style == "concat_proj":
            self.enorm = model_norm(cfg, cfg.hidden_size)
            self.hnorm = model_norm(cfg, cfg.hidden_size)
            self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        elif self.combine_style == "qwen4_exp":
            self.pre_fc_norm_embedding = model_norm(cfg, cfg.hidden_size)
            self.pre_fc_norm_hidden = model_norm(cfg, cfg.hidden_size * cfg.hc_count)
            self.fc_embedding = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
            self.fc_hidden = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = block
        self.norm = final_norm_module(cfg)

    def forward(self, h_prev_bsh: torch.Tensor, emb_bsh: Optional[torch.Tensor],
                positions_bs: torch.Tensor, cache: Optional[LayerKV] = None, **block_args):
        """`block_args`: the block's QSA selection hand-over and documents
        (`TransformerBlock.forward`)."""
        if not torch.is_autocast_enabled(h_prev_bsh.device.type):
            # a frozen trunk stored in train.frozen_dtype (bf16) hands its state and embedding to
            # an MTP module training in fp32: the layer computes in its own dtype
            dtype = next(self.parameters()).dtype
            h_prev_bsh = h_prev_bsh.to(dtype)
            emb_bsh = emb_bsh.to(dtype) if emb_bsh is not None else None
        if self.combine_style == "concat_proj":
            e, h = self.enorm(emb_bsh), self.hnorm(h_prev_bsh)
            x = self.eh_proj(torch.cat([e, h] if self.emb_first else [h, e], dim=-1))
        elif self.combine_style == "qwen4_exp":
            streams = self.pre_fc_norm_hidden(h_prev_bsh).unflatten(-1, (self.hc_count,
                                                                         self.hidden_size))
            e = self.fc_embedding(self.pre_fc_norm_embedding(emb_bsh))
            x = (self.fc_hidden(streams) + e.unsqueeze(-2)).flatten(-2)
        else:
            x = h_prev_bsh
        # The block's residual stream stays in the trunk's dtype: under autocast the projection
        # returns bf16 while the trunk's stream is fp32 (fp32 embedding, fp32 residual adds).
        # Without the cast the MTP chain would add its residuals in bf16 in one process but in fp32
        # once a pipeline boundary cast it, and a compiled MTP block would need its own graph (its
        # input dtype differs from the trunk blocks'): one more compilation of the same block per
        # run.
        return self.block(x.to(h_prev_bsh.dtype), positions_bs, cache, **block_args)


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, mtp: MTPConfig, make_block):
        super().__init__()
        self.num_steps = mtp.num_steps
        self.chained = mtp.style == "looped"
        self.layers = nn.ModuleList(MTPLayer(cfg, mtp, make_block()) for _ in range(mtp.num_layers))
        # QSA index reuse: one selection shared by every physical layer's indexed attention
        qsa = [layer.block.self_attn for layer in self.layers
               if isinstance(getattr(layer.block, "self_attn", None), IndexedAttention)]
        self.selection_share = SelectionShare() if mtp.qsa_reuse_indices and qsa else None
        for attn in qsa:
            attn.selection_share = self.selection_share

    def select_for_step(self, step: int) -> None:
        """Depth 1 records its QSA selection, later depths reuse it (no-op without index reuse)."""
        if self.selection_share is not None:
            self.selection_share.mode = "record" if step == 1 else "reuse"

    def layer_for_step(self, step: int) -> MTPLayer:
        return self.layers[(step - 1) % len(self.layers)]
