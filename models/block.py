"""One decoder block: a token mixer (full attention, QSA sparse attention or Gated DeltaNet, each
built from the config) and an MLP or MoE, around the residual scheme (plain, or hyper-connections
over `hc_count` streams), with optional PLE n-gram injection; and the shared output head."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .attention import Attention, LayerKV
from .config import ModelConfig
from .context import WholeWindow
from .documents import Documents
from .gated_deltanet import GatedDeltaNet
from .hyper_connection import HyperConnection
from .latent_attention import LatentAttention
from .layers import SwiGLU
from .loss import (
    chunked_acceptance_loss_sum,
    head_cross_entropy_sums,
)
from .moe import MoE
from .mtp import (
    model_norm,
)
from .ple import PLELayer
from .qsa import IndexedAttention
from .qsa_index import QSASelection


def make_token_mixer(cfg: ModelConfig, kind: str) -> nn.Module:
    """The token mixer of one block: full attention (GQA, or MLA when model.kv_lora_rank > 0), QSA
    sparse attention or Gated DeltaNet."""
    if kind == "attention":
        return LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg)
    if kind == "indexed_attention":
        return IndexedAttention(
            hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.resolved_head_dim, partial_rotary_factor=cfg.partial_rotary_factor,
            rope_theta=cfg.rope_theta, max_seq_len=cfg.max_seq_len, eps=cfg.rms_norm_eps,
            indexer_heads=cfg.indexer_heads, indexer_head_dim=cfg.indexer_head_dim,
            budget=cfg.indexer_budget, compress_ratio=cfg.indexer_compress_ratio, form=cfg.qsa_form,
            indexer_loss_coef=cfg.indexer_loss_coef)
    if kind == "linear_attention":
        return GatedDeltaNet(
            hidden_size=cfg.hidden_size, num_k_heads=cfg.linear_num_key_heads,
            num_v_heads=cfg.linear_num_value_heads,
            head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim,
            conv_kernel=cfg.linear_conv_kernel, eps=cfg.rms_norm_eps, gate_act=cfg.linear_gate_act,
            kernel=cfg.linear_kernel)
    raise ValueError(f"unknown token mixer {kind!r}")


def block_kwargs(documents: Optional[Documents] = None, context: Optional[WholeWindow] = None,
                 aux_grad_scale: float = 1.0, qsa_dense: bool = False,
                 counted: Optional[torch.Tensor] = None) -> dict:
    """The keyword arguments every caller of a block (the trunk, the MTP chain, a pipeline stage)
    hands it: the packed documents, the window's context-parallel split when it is split, the
    gradient scale of the auxiliary losses, QSA's dense warm-up and the rows that are not padding
    (`TandemModel.counted_rows`); each only when it differs from the block's default, so an
    unsplit, unpacked forward calls the block exactly as decoding does."""
    kwargs = {} if documents is None else {"documents": documents}
    if counted is not None:
        kwargs["counted"] = counted
    if aux_grad_scale != 1.0:
        kwargs["aux_grad_scale"] = aux_grad_scale
    if context is not None and context.sharded:
        kwargs["context"] = context
    if qsa_dense:
        kwargs["qsa_dense"] = True
    return kwargs


class TransformerBlock(nn.Module):
    """A token mixer plus an MLP or MoE around a residual scheme, with optional PLE n-gram memory.

    With `hc_count == 1` the residual is the plain pre-norm one (`input_layernorm`,
    `post_attention_layernorm`). With hyper-connections (`hc_count > 1`, Qwen4-Exp) the block
    carries `hc_count` streams [B, S, hc x H]: `attn_hyper_connection` / `mlp_hyper_connection` each
    mix the normalised streams into the sublayer's input and inject its output back into every
    stream with learned weights (they replace the two norms). A PLE layer adds its n-gram features
    to the streams first; it is the only part that reads the token ids."""

    def __init__(self, cfg: ModelConfig, moe: bool, kind: str = "attention",
                 ple_index: Optional[int] = None):
        super().__init__()
        self.kind = kind
        mixer = make_token_mixer(cfg, kind)
        # transformers' names: Gated DeltaNet is `linear_attn`, every attention is `self_attn`
        if kind == "linear_attention":
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.hc_count = cfg.hc_count
        if cfg.hc_count > 1:
            self.attn_hyper_connection = HyperConnection(cfg.hidden_size, cfg.hc_count,
                                                         cfg.hc_lowrank, cfg.rms_norm_eps)
            self.mlp_hyper_connection = HyperConnection(cfg.hidden_size, cfg.hc_count,
                                                        cfg.hc_lowrank, cfg.rms_norm_eps)
        else:
            self.input_layernorm = model_norm(cfg, cfg.hidden_size)
            self.post_attention_layernorm = model_norm(cfg, cfg.hidden_size)
        self.mlp = MoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.ple = None
        if ple_index is not None:
            self.ple = PLELayer(
                hidden_size=cfg.hidden_size, hc_count=cfg.hc_count,
                embed_dim=cfg.resolved_ple_embed_dim,
                conv_kernel=cfg.ple_conv_kernel, ngram_size=cfg.ngram_size,
                heads_per_ngram=cfg.heads_per_ngram,
                vocab_size=cfg.vocab_size, ngram_vocab_base=cfg.ngram_vocab_base,
                ngram_vocab_multiple=cfg.ngram_vocab_multiple, seed=cfg.ngram_seed,
                ple_layer_index=ple_index, eos_token_id=cfg.eos_token_id, eps=cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor,
                cache: Optional[LayerKV] = None,
                input_ids_bs: Optional[torch.Tensor] = None,
                selection: Optional[QSASelection] = None,
                return_selection: bool = False, documents: Optional[Documents] = None,
                context: Optional[WholeWindow] = None, aux_grad_scale: float = 1.0,
                qsa_dense: bool = False, counted: Optional[torch.Tensor] = None):
        """`selection` / `return_selection`: the QSA selection handed between MTP depths in training
        (`IndexedAttention.forward`); with `return_selection` the block returns (output, selection).
        They are arguments and results, not module state, so activation checkpointing's
        recomputation and pipelined micro-batches see the selection of their own forward.
        `documents`: packed documents (models/documents.py), which every part of the block keeps
        apart. `context`: the window's split over context-parallel ranks (models/context.py), which
        the token mixer and PLE read across. `aux_grad_scale`: the gradient an MoE's auxiliary
        losses and a QSA indexer's KL get (`MoE.forward`, `IndexedAttention.forward`). `qsa_dense`:
        QSA's dense warm-up stage (training only; other token mixers ignore it). `counted`: the
        rows that are not padding, which an MoE's load counters and auxiliary losses and a QSA
        indexer's KL count (`MoE.forward`; None: all)."""
        sel_out = None
        extra = {} if documents is None else {"documents": documents}
        if context is not None:
            extra["context"] = context
        mixer_args = dict(extra)
        if self.kind == "indexed_attention" and (qsa_dense or aux_grad_scale != 1.0):
            mixer_args.update(dense=qsa_dense, aux_grad_scale=aux_grad_scale)
        if self.kind == "indexed_attention" and counted is not None:
            mixer_args["counted"] = counted

        def mix(h: torch.Tensor) -> torch.Tensor:
            nonlocal sel_out
            if not (return_selection or selection is not None):
                return self.mixer(h, positions_bs, cache, **mixer_args)
            if self.kind != "indexed_attention":
                raise ValueError(f"a QSA selection was handed to a {self.kind} block")
            y, sel_out = self.mixer(h, positions_bs, cache, selection, True, **mixer_args)
            return y

        # an MoE's auxiliary losses average over the whole window (context parallelism), with the
        # gradient the caller's objective gives them
        mlp_args = {}
        if isinstance(self.mlp, MoE):
            mlp_args = {"aux_grad_scale": aux_grad_scale}
            if context is not None:
                mlp_args["context"] = context
            if counted is not None:
                mlp_args["counted"] = counted
        if self.hc_count == 1:
            x_bsh = x_bsh + mix(self.input_layernorm(x_bsh))
            out = x_bsh + self.mlp(self.post_attention_layernorm(x_bsh), **mlp_args)
            return (out, sel_out) if return_selection else out
        if self.ple is not None:
            if input_ids_bs is None:
                raise ValueError("a block with PLE needs the token ids (input_ids_bs)")
            x_bsh = x_bsh + self.ple(x_bsh, input_ids_bs, positions_bs, cache, **extra)
        mixed, weights = self.attn_hyper_connection(x_bsh)
        x_bsh = self.attn_hyper_connection.inject(x_bsh, mix(mixed), weights)
        mixed, weights = self.mlp_hyper_connection(x_bsh)
        out = self.mlp_hyper_connection.inject(x_bsh, self.mlp(mixed, **mlp_args), weights)
        return (out, sel_out) if return_selection else out


class OutputHead(nn.Module):
    """The vocabulary projection shared by the trunk and every MTP depth (tensor parallelism swaps
    it for a vocab-parallel version with the same two methods)."""

    def __init__(self, hidden_size: int, vocab_size: int, backward: str = "recompute"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.backward = backward  # MTPConfig.loss_head_backward

    def logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        # in h's dtype without autocast: an MTP depth training in fp32 over a frozen head stored in
        # train.frozen_dtype (bf16), as its loss computes (loss._compute_dtype)
        weight = self.weight if torch.is_autocast_enabled(h_normed.device.type) else (
            self.weight.to(h_normed.dtype))
        return nn.functional.linear(h_normed, weight)

    def loss_sums(self, h_normed_dnh: torch.Tensor, targets_dn: torch.Tensor, chunk_tokens: int,
                  grad_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[D] summed cross-entropies of D depths' rows in one chunked pass
        (`head_cross_entropy_sums`)."""
        return head_cross_entropy_sums(h_normed_dnh, self.weight, targets_dn, chunk_tokens,
                                       self.backward, grad_scales)

    def acceptance_loss_sum(self, h_normed_nh: torch.Tensor, teacher_nh: torch.Tensor,
                            targets_n: torch.Tensor,
                            chunk_tokens: int, ce_weight: float) -> torch.Tensor:
        return chunked_acceptance_loss_sum(h_normed_nh, teacher_nh, self.weight, targets_n,
                                           chunk_tokens, ce_weight)
