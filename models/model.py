"""The assembled model: MoE decoder trunk + MTP module + shared output head.

One implementation serves training (`forward`), the speculative decoder (`trunk`, `mtp_step`,
`logits` with a KV cache) and export. Parameter names follow the Hugging Face Llama/Qwen/GLM layout
(`embed_tokens`, `layers.<i>.self_attn.q_proj`, `mlp.experts`, `norm`, `lm_head`) so imports and
exports are a name mapping. Trunk layers live in a ModuleDict keyed by their global index, so a
pipeline stage that keeps a subset still has the same parameter names (checkpoints stay portable).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from .attention import LayerKV
from .block import OutputHead, TransformerBlock, block_kwargs
from .config import ModelConfig
from .context import WholeWindow
from .documents import Documents
from .layers import STEP_COUNTERS, InitRule, InitScales, draw_init
from .loss import (
    IGNORE,
    chunked_argmax,
    chunked_soft_cross_entropy_sum,
)
from .moe import MoE
from .mtp import (
    MTPModule,
    depth_input_rows,
    depth_target_mask,
    final_norm_module,
    shifted_tokens,
)
from .mtp_config import MTPConfig
from .qsa_index import QSASelection


def _teacher_at(teacher_bsh: torch.Tensor, depth: int) -> torch.Tensor:
    """The trunk's head input at position t+depth, aligned to position t: MTP depth k at t drafts
    token t+1+k, which the trunk predicts at t+k. The wrapped-around tail is masked by the depth's
    mask."""
    return torch.cat([teacher_bsh[:, depth:], teacher_bsh[:, :depth]], dim=1)


def _rows(x_bs: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> [B*S, ...]: one row per position, in the loss functions' order."""
    return x_bs.reshape(-1, *x_bs.shape[2:])


def window_documents(doc_ids_bs1: Optional[torch.Tensor], s: int) -> Optional[Documents]:
    """The packed documents of a training window's S inputs (None without doc ids: one per row)."""
    return Documents.from_doc_ids(doc_ids_bs1[:, :s]) if doc_ids_bs1 is not None else None


def window_positions(documents: Optional[Documents], b: int, s: int, device) -> torch.Tensor:
    """[B, S] positions of a training window's inputs: from each document's start when documents are
    kept apart, else from the row's start."""
    if documents is not None:
        return documents.positions()
    return torch.arange(s, device=device).expand(b, s)


@dataclass
class ModelOutput:
    loss_sums: torch.Tensor
    """[K+1] summed cross-entropy per depth (0 = main head), in the autograd graph."""
    token_counts: torch.Tensor
    """[K+1] number of valid targets per depth (the normaliser)."""
    chain: Optional[torch.Tensor] = None
    """The MTP chain's last hidden state computed (h_0 when no MTP step ran): what a pipeline stage
    passes on to the stage holding the next depths."""
    selection: Optional[QSASelection] = None
    """MTP depth 1's QSA selection after the depths run (mtp.qsa_reuse_indices): what a pipeline
    stage passes on with the chain when a later stage holds depths that reuse it."""


@dataclass
class SelectionCarry:
    """MTP depth 1's QSA selection carried along one forward's MTP chain: `depth_states` reads the
    selection it starts from (one a previous pipeline stage made) and leaves the last one here."""

    value: Optional[QSASelection] = None


class SequenceLayout(nn.Module):
    """Where the sequence dimension of the hidden states lives between the blocks: whole, as in one
    process (this class, the default), or one rank's shard of it under sequence parallelism
    (trainer/parallel/tensor.py `SequenceShards`, built with the same three methods). The model asks
    it for whole hidden states before the head and for its MTP embeddings; it holds no
    parameters."""

    def whole(self, h_bsh: torch.Tensor) -> torch.Tensor:
        """The whole sequence [B, S, H] from what the blocks hand on (here already whole)."""
        return h_bsh

    def embed_window(self, embed_tokens: nn.Module, ids_bl: torch.Tensor) -> torch.Tensor:
        """The embeddings of a window of whole sequences, looked up once (`shifted_embeddings`)."""
        return embed_tokens(ids_bl)

    def rows(self, window_blh: torch.Tensor, first: int, rows: int) -> torch.Tensor:
        """The rows first..first+rows of an `embed_window` output that the blocks compute on."""
        return window_blh[:, first : first + rows]


class TandemModel(nn.Module):
    def __init__(self, cfg: ModelConfig, mtp: MTPConfig, sequence: Optional[SequenceLayout] = None,
                 distill: str = "none", context: Optional[WholeWindow] = None):
        super().__init__()
        self.cfg, self.mtp_cfg = cfg, mtp
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(cfg, cfg.is_moe_layer(i), cfg.layer_type(i),
                                     cfg.ple_layers.index(i) if i in cfg.ple_layers else None)
            for i in range(cfg.num_layers)})
        self.norm = final_norm_module(cfg)
        self.lm_head = OutputHead(cfg.hidden_size, cfg.vocab_size, mtp.loss_head_backward)
        mtp_moe = mtp.moe and cfg.num_experts > 0
        # MTP blocks use the trunk's attention kind (QSA when the trunk has it) and never PLE.
        mtp_kind = "indexed_attention" if cfg.uses_qsa else "attention"
        self.mtp = (MTPModule(cfg, mtp, lambda: TransformerBlock(cfg, mtp_moe, mtp_kind))
                    if mtp.num_steps > 0 else None)
        # MTP targets: `none` (data labels), `argmax` / `soft` (self-distillation from the trunk's
        # own next-token prediction at the target position: train.distill).
        self.distill = distill
        # Whole sequences between the blocks (the default), or under sequence parallelism this
        # rank's shard (trainer/parallel/tensor.py `SequenceShards`): the head's input is gathered
        # whole, and the trunk and MTP steps share one lookup, each rank reading its rows.
        self.sequence = sequence if sequence is not None else SequenceLayout()
        # Which rows of a window this rank computes: all, or under context parallelism its chunks
        # (trainer/parallel/context.py); per-position inputs are cut to them (models/context.py).
        self.context = context if context is not None else WholeWindow()
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_depths(self) -> int:
        return 1 + (self.mtp_cfg.num_steps if self.mtp is not None else 0)

    @property
    def init_scales(self) -> InitScales:
        depth = self.cfg.num_layers + (self.mtp_cfg.num_layers if self.mtp_cfg.num_steps > 0 else 0)
        return InitScales(self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * depth))

    def init_rule(self, name: str) -> InitRule:
        """How parameter `name` starts: what the closest module holding it says (its `param_init`,
        asked with the name relative to it: `out_proj.weight` for a Gated DeltaNet layer's output
        projection), else zeros for a bias and normal(0, model.init_std) for everything else. The
        one definition of the initial distribution: `reset_parameters` draws it from the global RNG;
        the trainer draws it shard by shard from per-parameter seeds
        (trainer/parallel/sharded_params.py)."""
        scales, parts = self.init_scales, name.split(".")
        for cut in range(len(parts) - 1, -1, -1):
            param_init = getattr(self.get_submodule(".".join(parts[:cut])), "param_init", None)
            rule = param_init(".".join(parts[cut:]), scales) if param_init is not None else None
            if rule is not None:
                return rule
        return ("zeros", 0.0) if parts[-1] == "bias" else ("normal", scales.std)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            draw_init(p, self.init_rule(name))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute every buffer (rotary tables, router biases and load counts) in place: after
        `to_empty` (meta-device construction) they hold garbage."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_buffers"):
                m.reset_buffers()
        for name, b in self.named_buffers():
            if name.endswith(("e_score_correction_bias", *STEP_COUNTERS)):
                b.zero_()

    # --- pieces shared by training and decoding -------------------------------------------------
    def trunk(self, input_ids_bs: torch.Tensor, positions_bs: torch.Tensor, cache=None,
              emb_bsh: Optional[torch.Tensor] = None,
              documents: Optional[Documents] = None, aux_grad_scale: float = 1.0,
              qsa_dense: bool = False, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Trunk hidden states before the final norm (h_0 of the MTP chain). `emb_bsh`: the tokens'
        embedding when the caller already looked it up (`shifted_embeddings`). `documents`: packed
        documents kept apart (then `positions_bs` count from each document's start).
        `aux_grad_scale`, `qsa_dense`: see `forward`; `counted`: `counted_rows`."""
        h = self.embed_tokens(input_ids_bs) if emb_bsh is None else emb_bsh
        if self.cfg.hc_count > 1:
            h = h.repeat(1, 1, self.cfg.hc_count)  # every stream starts as the embedding
        extra = block_kwargs(documents, self.context, aux_grad_scale, qsa_dense, counted)
        for i, layer in self.layers.items():
            h = layer(h, positions_bs, cache.layer(int(i)) if cache is not None else None,
                      input_ids_bs if layer.ple is not None else None, **extra)
        return h

    def mtp_step(self, step: int, h_prev_bsh: torch.Tensor, tokens_bs: torch.Tensor,
                 positions_bs: torch.Tensor,
                 cache: Optional[LayerKV] = None, emb_bsh: Optional[torch.Tensor] = None):
        """MTP step `step` (1-based): h_step from h_{step-1} (h_0 for the parallel style) and token
        t+step. `emb_bsh`: the embedding of tokens t+step when already looked up (training reuses
        one lookup). Decoding (`cache` given) shares QSA selections through the depths' caches
        (`select_for_step`); training chains them explicitly (`mtp_train_step`)."""
        self.mtp.select_for_step(step)
        return self._mtp_layer(step, h_prev_bsh, tokens_bs, positions_bs, cache, emb_bsh)

    def mtp_train_step(self, step: int, h_prev_bsh: torch.Tensor, tokens_bs: torch.Tensor,
                       positions_bs: torch.Tensor, emb_bsh: Optional[torch.Tensor] = None,
                       selection: Optional[QSASelection] = None,
                       documents: Optional[Documents] = None, aux_grad_scale: float = 1.0,
                       qsa_dense: bool = False, counted: Optional[torch.Tensor] = None):
        """The training form of `mtp_step`: returns (h_step, the QSA selection later depths reuse).
        With mtp.qsa_reuse_indices depth 1 selects and returns its selection and depths 2..K attend
        over the one handed in (none in the dense warm-up, which selects nothing); otherwise every
        depth selects for itself and None is passed along."""
        extra = block_kwargs(documents, self.context, aux_grad_scale, qsa_dense, counted)
        if self.mtp.selection_share is None:
            return self._mtp_layer(step, h_prev_bsh, tokens_bs, positions_bs, None, emb_bsh,
                                   **extra), None
        if step == 1:
            return self._mtp_layer(step, h_prev_bsh, tokens_bs, positions_bs, None, emb_bsh,
                                   return_selection=True, **extra)
        if selection is None and not qsa_dense:
            raise RuntimeError("mtp.qsa_reuse_indices: MTP depth 1 must run before the depths that "
                               "reuse its QSA selection, and hand it on")
        h = self._mtp_layer(step, h_prev_bsh, tokens_bs, positions_bs, None, emb_bsh,
                            selection=selection, **extra)
        return h, selection

    def _mtp_layer(self, step, h_prev_bsh, tokens_bs, positions_bs, cache, emb_bsh, **block_args):
        layer = self.mtp.layer_for_step(step)
        if self.mtp_cfg.trunk_input == "final_norm" and (step == 1 or not self.mtp.chained):
            # h_0 is the trunk's normed output in this convention
            h_prev_bsh = self.norm(h_prev_bsh)
        emb = (self.embed_tokens(tokens_bs) if emb_bsh is None
               else emb_bsh) if layer.combine else None
        return layer(h_prev_bsh, emb, positions_bs, cache, **block_args)

    def shared_lookup(self) -> bool:
        """Whether training embeds every position once and the MTP steps read it shifted
        (`shifted_embeddings`): with looped MTP steps (they embed tokens). Under sequence
        parallelism step k's shard needs k rows of the next rank's shard, so the window is looked up
        whole there (`sequence.embed_window`) and each rank reads its rows of it
        (`sequence.rows`)."""
        return self.mtp is not None and self.mtp.chained

    def shifted_embeddings(self, tokens_bs1: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """One embedding lookup serving the trunk (shift 0) and MTP steps `first`..`last`: row j
        holds token j+first (token 0 past the window, as `shifted_tokens` pads), so shift k reads
        rows [k-first, k-first+S) (`window_rows`). One lookup, and under tensor parallelism one
        vocabulary-parallel all-reduce, instead of one per step (under sequence parallelism one
        all-reduce of the whole window instead of a reduce-scatter per step)."""
        s = tokens_bs1.shape[1] - 1
        if self.context.sharded:  # this rank's rows of each shift, shift by shift
            ids = torch.cat([self.context.local(shifted_tokens(tokens_bs1, k, s))
                             for k in range(first, last + 1)], 1)
        else:
            ids = shifted_tokens(tokens_bs1, first, s + last - first)
        return self.sequence.embed_window(self.embed_tokens, ids)

    def window_rows(self, emb_window: Tuple[torch.Tensor, int], shift: int, s: int) -> torch.Tensor:
        """The embedding of tokens t+shift for the S positions (this rank's shard of them under
        sequence parallelism) from a `shifted_embeddings` window (window, its first shift)."""
        window, first = emb_window
        if self.context.sharded:  # `shifted_embeddings` laid this rank's rows out shift by shift
            rows = self.context.local_rows(s)
            return self.sequence.rows(window, (shift - first) * rows, rows)
        return self.sequence.rows(window, shift - first, s)

    def counted_rows(self, tokens_bs1: torch.Tensor,
                     padding_bs: Optional[torch.Tensor]) -> torch.Tensor:
        """[B, rows] bool, False where the row is padding (`padding_bs` [B, S], None: none is): the
        rows an MoE layer counts in its loads and auxiliary losses and a QSA indexer in its KL
        (`MoE.forward`), this rank's rows (context parallelism: its chunks of the window). Given
        even when every row counts, so that the trunk's blocks and the MTP steps (which narrow it:
        `depth_states`) take the same arguments and share a compiled graph."""
        ones = torch.ones(tokens_bs1.shape[0], tokens_bs1.shape[1] - 1, dtype=torch.bool,
                          device=tokens_bs1.device)
        return self.context.local(ones if padding_bs is None else ~padding_bs.bool())

    def depth_states(self, h0_bsh: torch.Tensor, tokens_bs1: torch.Tensor,
                     positions_bs: torch.Tensor,
                     depths: Optional[Sequence[int]] = None, h_chain: Optional[torch.Tensor] = None,
                     chain_depth: int = 0, emb_window: Optional[Tuple[torch.Tensor, int]] = None,
                     documents: Optional[Documents] = None, carry: Optional[SelectionCarry] = None,
                     aux_grad_scale: float = 1.0, qsa_dense: bool = False,
                     counted: Optional[torch.Tensor] = None,
                     doc_ids_bs1: Optional[torch.Tensor] = None):
        """Yield (depth, pre-norm hidden state) for `depths` (default 0 .. K) in order,
        teacher-forced on the true tokens: step k reads h_{k-1} (h_0 for parallel heads) and token
        t+k. The chain may start later (a pipeline stage after the one that ran depth
        `chain_depth`): `h_chain` is then h_{chain_depth}. With mtp.detach_trunk no MTP gradient
        reaches the trunk. `emb_window`: (`shifted_embeddings` output, its first shift) covering
        every step run; without it each step looks its tokens up. `carry`: depth 1's QSA selection
        in and out (a chain started after depth 1 reuses the one it brings). `aux_grad_scale`,
        `qsa_dense`: see `forward`; `counted`: `counted_rows` (every depth's rows are the trunk's
        positions), narrowed at each chained step to `depth_input_rows` (from `doc_ids_bs1`)."""
        s = tokens_bs1.shape[1] - 1
        wanted = range(self.num_depths) if depths is None else depths
        h = h0_bsh if h_chain is None else h_chain
        carry = SelectionCarry() if carry is None else carry
        if 0 in wanted:
            yield 0, h0_bsh
        for depth in range(chain_depth + 1, max(wanted, default=0) + 1):
            if not self.mtp.chained and depth not in wanted:
                continue  # parallel heads read h_0 only
            h_in = h if self.mtp.chained else h0_bsh
            if self.mtp_cfg.detach_trunk and (depth == 1 or not self.mtp.chained):
                h_in = h_in.detach()
            emb = self.window_rows(emb_window, depth, s) if emb_window is not None else None
            tokens = self.context.local(shifted_tokens(tokens_bs1, depth, s))
            rows = counted  # a chained step's: those whose input token is in their document too
            if self.mtp.chained:
                rows = self.context.local(depth_input_rows(tokens_bs1, doc_ids_bs1, depth)) & (
                    True if counted is None else counted)
            h, carry.value = self.mtp_train_step(depth, h_in, tokens, positions_bs,
                                                 emb_bsh=emb, selection=carry.value,
                                                 documents=documents,
                                                 aux_grad_scale=aux_grad_scale,
                                                 qsa_dense=qsa_dense, counted=rows)
            yield depth, h

    def final_norm(self, depth: int, h_bsh: torch.Tensor) -> torch.Tensor:
        return self.norm(h_bsh) if depth == 0 else self.mtp.layer_for_step(depth).norm(h_bsh)

    def logits(self, depth: int, h_bsh: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of depth `depth` (0 = trunk) from its pre-norm hidden state."""
        return self.lm_head.logits(self.final_norm(depth, h_bsh))

    # --- training -------------------------------------------------------------------------------
    def forward(self, tokens_bs1: torch.Tensor, loss_mask_bs: Optional[torch.Tensor] = None,
                doc_ids_bs1: Optional[torch.Tensor] = None, document_mask: bool = False,
                loss_grad_scales: Optional[torch.Tensor] = None,
                aux_grad_scale: float = 1.0, qsa_dense: bool = False,
                padding_bs: Optional[torch.Tensor] = None) -> ModelOutput:
        """Per-depth summed losses over a window of S+1 tokens (inputs are the first S).
        `document_mask` (data.document_mask): the documents `doc_ids_bs1` delimits do not see each
        other. `loss_grad_scales`: the gradient d total / d loss_sums[depth] the caller's loss will
        send back ([num_depths], on the device: each depth's coefficient over its global target
        count); with it the fused head keeps one weight-gradient buffer for every depth
        (models/loss.py). None: the weight's gradient is recomputed in backward. `aux_grad_scale`:
        the gradient the caller's objective gives each auxiliary loss of this forward, an MoE
        layer's balance + z loss and a QSA indexer's KL (the trainer's: 1 / the micro-batches of its
        global step). `qsa_dense`: QSA's dense warm-up stage (trainer/qsa_training.py).
        `padding_bs` [B, S] bool: the inputs that are padding (the data's `padding`), which MoE
        layers leave out of their loads and auxiliary losses and QSA indexers out of their KL
        (`counted_rows`)."""
        b, s1 = tokens_bs1.shape
        s = s1 - 1
        if s > self.cfg.max_seq_len:  # (the RoPE tables end there: an IndexError deep inside)
            raise ValueError(f"a window of {s} inputs is longer than model.max_seq_len="
                             f"{self.cfg.max_seq_len} (load_hf_model: its max_seq_len argument)")
        if loss_mask_bs is None:
            loss_mask_bs = torch.ones(b, s, device=tokens_bs1.device)
        documents = window_documents(doc_ids_bs1, s) if document_mask else None
        # built over the whole window, then cut to this rank's rows (context parallelism; else all
        # rows)
        positions = self.context.local(window_positions(documents, b, s, tokens_bs1.device))
        documents = documents.local(self.context) if documents is not None else None
        counted = self.counted_rows(tokens_bs1, padding_bs)
        # A frozen trunk (MTP fine-tuning) runs without autograd, so its memory stays near
        # inference, and sparse, as it is served (its indexers are not training).
        emb_window = None
        if self.shared_lookup():
            # the trunk's embedding output, shifted by k, is what MTP step k embeds: one lookup for
            # all
            emb_window = (self.shifted_embeddings(tokens_bs1, 0, self.mtp_cfg.num_steps), 0)
        with torch.no_grad() if self.trunk_frozen() else nullcontext():
            emb = self.window_rows(emb_window, 0, s) if emb_window is not None else None
            h = self.trunk(self.context.local(tokens_bs1[:, :s]), positions, emb_bsh=emb,
                           documents=documents, aux_grad_scale=aux_grad_scale,
                           qsa_dense=qsa_dense and not self.trunk_frozen(), counted=counted)
        return self.losses_from_hidden(h, tokens_bs1, loss_mask_bs, doc_ids_bs1, positions,
                                       emb_window=emb_window, documents=documents,
                                       loss_grad_scales=loss_grad_scales,
                                       aux_grad_scale=aux_grad_scale, qsa_dense=qsa_dense,
                                       counted=counted)

    def losses_from_hidden(self, h0_bsh: torch.Tensor, tokens_bs1: torch.Tensor,
                           loss_mask_bs: torch.Tensor,
                           doc_ids_bs1: Optional[torch.Tensor], positions_bs: torch.Tensor,
                           depths: Optional[Sequence[int]] = None,
                           h_chain: Optional[torch.Tensor] = None, chain_depth: int = 0,
                           emb_window: Optional[Tuple[torch.Tensor, int]] = None,
                           documents: Optional[Documents] = None,
                           selection: Optional[QSASelection] = None,
                           loss_grad_scales: Optional[torch.Tensor] = None,
                           aux_grad_scale: float = 1.0, qsa_dense: bool = False,
                           counted: Optional[torch.Tensor] = None) -> ModelOutput:
        """Main-head loss and every MTP depth's loss from the trunk's hidden states (a pipeline
        stage runs exactly this for the `depths` it holds, continuing the MTP chain from `h_chain` =
        h_{chain_depth}; the sums and counts then cover those depths only). Under sequence
        parallelism h0 is this rank's shard of the sequence; the MTP chain stays sharded and only
        the head inputs are gathered. `emb_window`: see `depth_states`; without it (a pipeline stage
        after the trunk's first: the trunk's embedding output is on another rank, and sending it
        would add a boundary tensor per micro-batch) the steps run here share one lookup of their
        own. `selection`: depth 1's QSA selection when an earlier stage ran depth 1
        (mtp.qsa_reuse_indices).
        """
        s = tokens_bs1.shape[1] - 1
        wanted_steps = [d for d in (range(self.num_depths) if depths is None else depths) if d > 0]
        if emb_window is None and wanted_steps and self.shared_lookup():
            emb_window = (self.shifted_embeddings(tokens_bs1, chain_depth + 1, max(wanted_steps)),
                          chain_depth + 1)
        teacher_bsh, teacher_ids = self._teachers(h0_bsh, bool(wanted_steps))
        # (a pipeline stage after the trunk's head may hold no h_0)
        frozen_main = (h0_bsh is not None and not h0_bsh.requires_grad
                       and not self.lm_head.weight.requires_grad)
        chain = h0_bsh if h_chain is None else h_chain
        counts: List[torch.Tensor] = []
        sums: dict = {}
        # (depth, head input, targets) of every plain cross-entropy: one pass through the head
        ce = []
        carry = SelectionCarry(selection)
        for depth, h_prev in self.depth_states(h0_bsh, tokens_bs1, positions_bs, depths, h_chain,
                                               chain_depth, emb_window, documents, carry,
                                               aux_grad_scale=aux_grad_scale,
                                               qsa_dense=qsa_dense, counted=counted,
                                               doc_ids_bs1=doc_ids_bs1):
            if depth > 0:
                chain = h_prev
            # Every row stays; a row without a valid target gets IGNORE (models/loss.py: no h[mask],
            # whose data-dependent shape costs host syncs and a compiled graph). The count stays on
            # the device. the window's targets, then this rank's rows of them (context parallelism:
            # never shifted after cutting, so a target across a chunk edge is the one one process
            # reads)
            mask = self.context.local(depth_target_mask(loss_mask_bs, doc_ids_bs1, depth))
            targets_n = _rows(torch.where(mask, self.context.local(shifted_tokens(tokens_bs1, depth
                                                                                  + 1, s)), IGNORE))
            counts.append(mask.sum())
            loss, head_input = self._depth_loss(depth, h_prev, mask, targets_n, teacher_bsh,
                                                teacher_ids, frozen_main)
            if head_input is None:
                sums[depth] = loss
            else:
                ce.append((depth, *head_input))
        if ce:
            ce_depths = [d for d, _, _ in ce]
            scales = (torch.stack([loss_grad_scales[d] for d in ce_depths])
                      if loss_grad_scales is not None else None)
            per_depth = self.lm_head.loss_sums(torch.stack([h for _, h, _ in ce]),
                                               torch.stack([t for _, _, t in ce]),
                                               self.mtp_cfg.loss_chunk_tokens, scales)
            sums.update(zip(ce_depths, per_depth.unbind(0)))
        return ModelOutput(torch.stack([sums[d] for d in sorted(sums)]), torch.stack(counts), chain,
                           carry.value)

    def _teachers(self, h0_bsh: torch.Tensor, any_mtp: bool):
        """(the trunk's normed h_0, its head input; under train.distill=argmax also its predicted
        tokens) as the MTP depths' teacher, when self-distillation or the acceptance objective needs
        one."""
        if not any_mtp or (self.distill == "none" and self.mtp_cfg.loss.objective != "acceptance"):
            return None, None
        with torch.no_grad():
            # depth k at t reads the teacher at t + k, on another rank's rows near a context chunk's
            # edge: the teacher is the whole window's (gathered), each depth then takes its own rows
            teacher_bsh = self.sequence.whole(self.norm(h0_bsh.detach()))
            if self.distill != "argmax":
                return self.context.gather(teacher_bsh), None
            flat = teacher_bsh.reshape(-1, teacher_bsh.shape[-1])
            ids = chunked_argmax(flat, self.lm_head.weight, self.mtp_cfg.loss_chunk_tokens)
            return teacher_bsh, self.context.gather(ids.view(teacher_bsh.shape[:2]))

    def _depth_loss(self, depth: int, h_bsh: torch.Tensor, mask: torch.Tensor,
                    targets_n: torch.Tensor, teacher_bsh, teacher_ids, frozen_main: bool):
        """(depth's loss sum, None), or (None, (head input, targets)) for the shared cross-entropy
        pass."""
        whole, chunk = self.sequence.whole, self.mtp_cfg.loss_chunk_tokens
        if depth == 0 and frozen_main:
            with torch.no_grad():  # frozen trunk: the main loss is only reported
                hn = _rows(whole(self.final_norm(0, h_bsh)))
                return self.lm_head.loss_sums(hn[None], targets_n[None], chunk)[0], None
        hn = _rows(whole(self.final_norm(depth, h_bsh)))
        local = self.context.local  # the teachers are the whole window's (`_teachers`)
        if depth > 0 and teacher_ids is not None:
            # The trunk predicts token t+1+depth at position t+depth.
            window = teacher_ids.shape[1]
            return None, (hn, _rows(torch.where(mask, local(shifted_tokens(teacher_ids, depth,
                                                                           window)), IGNORE)))
        if depth > 0 and self.mtp_cfg.loss.objective == "acceptance":
            return self.lm_head.acceptance_loss_sum(hn, _rows(local(_teacher_at(teacher_bsh,
                                                                                depth))), targets_n,
                                                    chunk,
                                                    self.mtp_cfg.loss.acceptance_ce_weight), None
        if depth > 0 and teacher_bsh is not None:
            teacher_nh = _rows(local(_teacher_at(teacher_bsh, depth)))
            return chunked_soft_cross_entropy_sum(hn, teacher_nh, self.lm_head.weight, chunk,
                                                  _rows(mask)), None
        return None, (hn, targets_n)

    # --- bookkeeping ----------------------------------------------------------------------------
    def trunk_frozen(self) -> bool:
        """True when no trunk parameter trains (train.freeze_trunk)."""
        return not any(p.requires_grad for name,
                       p in self.named_parameters() if not name.startswith("mtp."))

    def moe_layers(self) -> List[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]
