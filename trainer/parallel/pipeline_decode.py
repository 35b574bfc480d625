"""Speculative decoding on a parallel layout: pipeline stages, prompts split over data-parallel
replicas, lockstep for the collectives inside the model.

Pipeline. The training schedule (torch.distributed.pipelining) moves micro-batches of whole
sequences; decoding is a latency-bound loop of tiny forwards whose inputs depend on the last one, so
it has its own plain send/recv path over the pp group. Each rank keeps the KV caches of its own
trunk layers (a `KVCache` indexed by global layer id, allocated at a layer's first write). The
*driver* is the rank holding the stage with the trunk's head (`DecodePlan`; the last stage unless
the loss depths are spread): it runs eval/spec_decode.py's decoder unchanged on a `PipelinedModel`
view, keeping the MTP caches, drafting, verifying, accepting and committing. Which stage holds MTP
depth k is a lookup (`DecodePlan.mtp_stage`: `parallel.pp_depth_stages`, the last stage by default):
a depth held by another rank runs there, on that rank's cache of the depth, and its hidden state
comes back. Every trunk forward of the decoder (prefill, verify, teacher-forced) becomes one pass
through the stages: the driver broadcasts a header over the pp group (the committed tokens and draft
tokens to run, their positions -- i.e. where each row's accepted prefix ends -- and whether a new
cache starts), the first stage embeds, each stage runs its layers on its caches and sends the hidden
state to the next stage's rank (stage s on pp rank s % pp), the output of the trunk's last stage
lands on the driver. The other ranks (*followers*) only answer headers until the driver says stop.

Data parallelism. The prompt batches (eval.batch_size prompts each, formed as one process forms
them) are dealt round-robin to the batch replicas (dp x ep), so each batch is computed exactly as
one process computes it; drivers gather the per-batch results, so every figure equals one
process's. The collectives inside the model (expert all-to-all over ep, FSDP parameter gathers over
dp x ep) need every replica to run the same sequence of forwards: decoding loops run while any
replica has an active row (`any_active`), and a replica with no batch left decodes a padding batch.

Hybrid models (Qwen4-Exp). The hidden state between stages is every hyper-connection stream [B, S,
hc_count * H] (an MTP depth's final norm, a stream mixer, returns H); the first stage repeats the
embedding into the streams and a PLE block reads the forward's token ids (the header's body carries
them to every stage). Each stage's cache is a `models.state.DecodeCache` with the driver's ring size
(the decoder sizes its rings for the verify width and padding), and a prefill of padded rows hands
every stage the rows' last real positions (`row_end`), so Gated DeltaNet's and PLE's recurrent state
end at each row's last real token on every stage, as in one process. While the driver's
`RecallProbe` is active (the evaluator's teacher-forced pass), the other ranks' QSA layers measure
their recall too and send the values to the driver, so `eval/qsa_recall` averages every layer.

Sequence and context parallelism are switched off around decoding (state.WholeSequenceSwitch):
decode steps run the TP regions on whole sequences. Without a pipeline, the evaluator's
teacher-forced pass runs first, in the training layout (`teacher_forcing`).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from tandem.eval.draft_serving import serving_step
from tandem.eval.recall import RecallProbe
from tandem.models import TandemModel
from tandem.models.documents import Documents
from tandem.models.state import DecodeCache

from .pipeline import boundary_width, embed_streams, plan_stages, run_block
from .pipeline_plan import selection_reused

_STOP, _NO_CACHE, _NEW_CACHE, _SAME_CACHE, _MTP_STEP, _MTP_NORM, _SERVING_STEP = range(7)
# header flags: the body carries row_end; QSA layers measure their recall; the positions count from
# each packed document's start, which the stages keep apart (data.document_mask)
_ROW_END, _RECALL, _DOCUMENTS = 1, 2, 4
HEADER = 8  # cmd, batch, length, cache length, depth, ring slots, flags, serving cache span


class DecodePlan:
    """Where the decoder's pieces live: trunk stages on pp ranks, the head and each MTP depth on a
    stage."""

    def __init__(self, cfg, pp_rank: int):
        self.pp = cfg.parallel.pp
        self.pp_rank = pp_rank
        self.mine, plan = plan_stages(cfg, pp_rank)
        self.split, self.n_stages, self.trunk_end = plan.split, plan.n_stages, plan.trunk_end
        self.num_steps = cfg.mtp.num_steps
        self.head_stage = plan.depth_stage[0]
        self._depth_stage = list(plan.depth_stage)
        if selection_reused(cfg):
            # Decoding shares depth 1's QSA selection through the depths' caches on one rank, so
            # every depth drafts where depth 1 does (that stage holds the whole MTP module: the
            # depths loop over its layers), wherever training spread them.
            self._depth_stage[1:] = [plan.depth_stage[1]] * (len(plan.depth_stage) - 1)
        m = cfg.model
        qsa = [s for s in range(self.trunk_end + 1) for i in plan.split[s]
               if m.layer_type(i) == "indexed_attention"]
        self.qsa_layers = len(qsa)
        """QSA layers in the trunk: the most recall values one rank sends per forward."""
        self.recall_ranks = sorted({self.stage_rank(s) for s in qsa} - {self.driver})
        """pp ranks other than the driver whose trunk stages hold QSA layers."""

    def stage_rank(self, stage: int) -> int:
        """pp rank (index in the pp group) that holds pipeline stage `stage`."""
        return stage % self.pp

    def mtp_stage(self, depth: int) -> int:
        """The stage holding MTP depth `depth` (1-based): `parallel.pp_depth_stages`, the last by
        default. A depth past the trained ones (a looped module drafting longer than it trained)
        runs on the last trained depth's stage: a stage with a depth holds the whole MTP module,
        every layer of the loop (the lookup ran past the placement, and the first draft crashed)."""
        return self._depth_stage[min(depth, len(self._depth_stage) - 1)]

    def mtp_rank(self, depth: int) -> int:
        return self.stage_rank(self.mtp_stage(depth))

    @property
    def serving_rank(self) -> int:
        """The pp rank that drafts every depth the serving way (one cache shared by the depths of
        the one MTP layer) for a driver that holds no MTP layer: depth 1's."""
        return self.mtp_rank(1)

    @property
    def driver(self) -> int:
        """pp rank that drafts, verifies and accepts: the one holding the output head. An MTP depth
        held by another rank runs there (with its KV cache) and its hidden state comes back."""
        return self.stage_rank(self.head_stage)


class StagePass:
    """This rank's part of one forward through the trunk stages (no autograd)."""

    def __init__(self, model: nn.Module, plan: DecodePlan, group, hidden: int, dtype, device):
        self.model, self.plan, self.group = model, plan, group
        self.hidden, self.dtype, self.device = hidden, dtype, device  # hidden: the boundary width

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Optional[DecodeCache],
            documents=None):
        """Trunk stages 0 .. trunk_end in order; the trunk's output lands on the driver."""
        plan, (b, s) = self.plan, positions.shape
        end, driver = plan.trunk_end, plan.driver
        h = None
        for stage in plan.mine:
            if stage > end:
                break
            if stage == 0:
                h = embed_streams(self.model, tokens)
            else:
                h = self._recv(b, s, plan.stage_rank(stage - 1))
            for i in plan.split[stage]:
                h = run_block(self.model.layers[str(i)], h, positions, tokens,
                              cache.layer(i) if cache is not None else None, documents)
            dst = plan.stage_rank(stage + 1) if stage < end else driver
            # before the trunk's end the next stage is always on another rank
            if dst != plan.pp_rank:  # one dtype on the wire: the receiver allocates first
                dist.send(h.to(self.dtype).contiguous(), group=self.group, group_dst=dst)
        if plan.pp_rank == driver and plan.stage_rank(end) != driver:
            h = self._recv(b, s, plan.stage_rank(end))
        return h if plan.pp_rank == driver else None

    def _recv(self, b: int, s: int, src: int) -> torch.Tensor:
        h = torch.empty(b, s, self.hidden, dtype=self.dtype, device=self.device)
        dist.recv(h, group=self.group, group_src=src)
        return h


class _MTPShape:
    """What the decoder reads of an MTP module the driver does not hold."""

    def __init__(self, mtp_cfg):
        self.chained = mtp_cfg.style == "looped"
        self.layers = [None] * mtp_cfg.num_layers


class PipelinedModel:
    """The driver's view of the model: its own pieces (head, norms, embedding copy, the MTP depths
    it holds) plus a `trunk` that runs through every stage and an `mtp_step` / `logits` that run a
    depth held by another rank there. The decoder and `teacher_forced` take it as the model."""

    def __init__(self, model: nn.Module, decoding: "ParallelDecoding"):
        self._model, self._decoding, self._cache = model, decoding, None
        self.mtp = model.mtp if model.mtp is not None else _MTPShape(decoding.cfg.mtp)
        self.num_depths = 1 + decoding.cfg.mtp.num_steps
        if model.embed_tokens is None:  # a driver holding only the head: the decoder reads just
            # the embedding's device and dtype, which the head's weight shares
            self.embed_tokens = SimpleNamespace(weight=model.lm_head.weight)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def depth_states(self, h0_bsh, tokens_bs1, positions_bs, documents=None):
        return TandemModel.depth_states(self, h0_bsh, tokens_bs1, positions_bs,
                                        documents=documents)  # with the routed steps

    def _remote(self, cmd: int, depth: int, h: torch.Tensor, tokens, positions, with_cache: bool,
                out_width: Optional[int] = None, documents=None, span: int = 0) -> torch.Tensor:
        d = self._decoding
        owner = d.plan.serving_rank if cmd == _SERVING_STEP else d.plan.mtp_rank(depth)
        recall = cmd == _MTP_STEP and not with_cache and RecallProbe.active is not None
        flags = (_RECALL if recall else 0) | (_DOCUMENTS if documents is not None else 0)
        d.send_header(cmd, tokens, positions, int(with_cache), depth, flags=flags, span=span)
        dist.send(h.to(d.dtype).contiguous(), group=d.pp_group, group_dst=owner)
        out = torch.empty(*h.shape[:-1], out_width or h.shape[-1], dtype=d.dtype, device=d.device)
        dist.recv(out, group=d.pp_group, group_src=owner)
        if recall:
            d.receive_recall([owner])
        return out

    def mtp_step(self, step: int, h_prev_bsh, tokens_bs, positions_bs, cache=None, emb_bsh=None):
        """TandemModel.mtp_step routed to the rank holding the step. `emb_bsh` is always None here:
        depth_states above passes no shared embedding window, so each step looks its tokens up."""
        if self._decoding.plan.mtp_rank(step) == self._decoding.plan.pp_rank:
            return self._model.mtp_step(step, h_prev_bsh, tokens_bs, positions_bs, cache,
                                        emb_bsh=emb_bsh)
        return self._remote(_MTP_STEP, step, h_prev_bsh, tokens_bs, positions_bs, cache is not None)

    def serving_step(self, cache, k: int, h_prev, tokens, pos, span: int) -> torch.Tensor:
        """eval/draft_serving.serving_step for the driver: on its own MTP layer and `cache` when it
        holds one, else on the serving cache of the rank holding depth 1 (`serving_rank`), which
        runs every depth there: the depths share one cache, and their layer is one."""
        if self._model.mtp is not None:
            return serving_step(self._model, cache, k, h_prev, tokens, pos, span)
        return self._remote(_SERVING_STEP, k, h_prev, tokens, pos, True, span=span)

    def mtp_train_step(self, step: int, h_prev_bsh, tokens_bs, positions_bs, emb_bsh=None,
                       selection=None, documents=None, aux_grad_scale: float = 1.0,
                       qsa_dense: bool = False, counted=None):
        """TandemModel.mtp_train_step (the teacher-forced chain of `depth_states`) routed like
        `mtp_step`. A remote rank keeps the QSA selection its depth 1 made for the later depths it
        serves (with mtp.qsa_reuse_indices the decoder keeps the depths on depth 1's stage), so None
        comes back here. (Evaluation computes no auxiliary loss and runs QSA sparse:
        `aux_grad_scale`, `qsa_dense` and `counted` are the defaults.)"""
        if self._decoding.plan.mtp_rank(step) == self._decoding.plan.pp_rank:
            return self._model.mtp_train_step(step, h_prev_bsh, tokens_bs, positions_bs, emb_bsh,
                                              selection, documents, aux_grad_scale, qsa_dense,
                                              counted)
        return self._remote(_MTP_STEP, step, h_prev_bsh, tokens_bs, positions_bs, False,
                            documents=documents), None

    def logits(self, depth: int, h_bsh: torch.Tensor) -> torch.Tensor:
        if depth == 0 or self._decoding.plan.mtp_rank(depth) == self._decoding.plan.pp_rank:
            return self._model.logits(depth, h_bsh)
        # the depth's final norm runs where its layer is
        flat = h_bsh.reshape(-1, 1, h_bsh.shape[-1])
        zeros = torch.zeros(flat.shape[:2], dtype=torch.long, device=flat.device)
        # the norm of a hyper-connection model is a stream mixer: hc_count * H in, H out
        width = self._decoding.cfg.model.hidden_size
        normed = self._remote(_MTP_NORM, depth, flat, zeros, zeros, False, out_width=width)
        return self._model.lm_head.logits(normed.view(*h_bsh.shape[:-1], -1))

    def trunk(self, tokens: torch.Tensor, positions: torch.Tensor,
              cache: Optional[DecodeCache] = None, documents=None):
        if cache is None:
            cmd = _NO_CACHE
        else:
            cmd = _SAME_CACHE if cache is self._cache else _NEW_CACHE
            self._cache = cache
        d = self._decoding
        # QSA measures recall in uncached forwards
        recall = cache is None and RecallProbe.active is not None
        row_end = cache.row_end if cache is not None else None
        flags = (_RECALL if recall else 0) | (_DOCUMENTS if documents is not None else 0)
        d.send_header(cmd, tokens, positions, cache.max_len if cache is not None else 0,
                      ring=cache.ring if cache is not None else 0, row_end=row_end, flags=flags)
        h = d.stages.run(tokens, positions, cache, documents)
        if recall:
            d.receive_recall(d.plan.recall_ranks)
        return h

    def drop_cache(self) -> None:
        """Forget the last batch's trunk cache (KV buffers, recurrent state): an evaluation's end,
        where it would otherwise be held through the training steps until the next one."""
        self._cache = None


def parallel_decoding(cfg, model: nn.Module, pstate) -> Optional["ParallelDecoding"]:
    """What the trainer hands the in-loop evaluator for decoding on its layout: None in one
    process."""
    return ParallelDecoding(cfg, model, pstate) if pstate.world_size > 1 else None


class ParallelDecoding:
    """What the in-loop evaluator needs to decode on this rank's part of a parallel layout (the
    evaluator's `LayoutDecoding` protocol, eval/in_loop.py; the trainer builds it and passes it
    in)."""

    def __init__(self, cfg, model: nn.Module, pstate):
        self.cfg, self.pstate, self.base = cfg, pstate, model
        self._tf_selection = None  # a served teacher-forced chain's QSA selection (`_serve_depth`)
        self.device = pstate.device.device
        self.pipeline = pstate.pipeline
        self.dtype = next(model.parameters()).dtype
        # replicas: the ranks holding the same parameters (dp x cp x ep; the cp ranks decode prompts
        # of their own as extra replicas), in lockstep for FSDP's gathers over them
        self.replicas = pstate.degrees.replicas
        self.replica = pstate.batch_mesh.get_local_rank() if self.replicas > 1 else 0
        self.replica_group = pstate.batch_mesh.get_group() if self.replicas > 1 else None
        if self.pipeline is not None:
            pp_mesh = pstate.mesh["pp"]
            self.pp_group = pp_mesh.get_group()
            self.plan = DecodePlan(cfg, pp_mesh.get_local_rank())
            self.is_driver = self.plan.pp_rank == self.plan.driver
            mine = [k for k in range(1, cfg.mtp.num_steps + 1)
                    if self.plan.mtp_rank(k) == self.plan.pp_rank]
            if mine and not self.is_driver and getattr(model, "mtp", None) is None:
                raise ValueError(f"MTP depths {mine} are placed on pp rank {self.plan.pp_rank}, "
                                 "which holds no MTP "
                                 "module")
            self.stages = StagePass(model, self.plan, self.pp_group, boundary_width(cfg.model),
                                    self.dtype, self.device)
            self.model = PipelinedModel(model, self) if self.is_driver else None
        else:
            self.plan, self.is_driver, self.model = None, True, model
        self.forces_in_layout = self.pipeline is None  # (eval/in_loop.py LayoutDecoding)

    # --- around an evaluation --------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self):
        """Whole-sequence TP regions and the FSDP roots' own parameters gathered (the decoder calls
        model pieces directly, bypassing the roots' pre-forward hooks; blocks gather in theirs)."""
        switch = self.pstate.whole_sequence_switch
        try:
            with (switch.whole_sequences() if switch is not None else contextlib.nullcontext(),
                  self.teacher_forcing()):
                yield
        finally:
            if isinstance(self.model, PipelinedModel):
                self.model.drop_cache()

    @contextlib.contextmanager
    def teacher_forcing(self):
        """The FSDP roots' own parameters gathered, the sequence splitting left on."""
        roots = [self.base, *(self.pipeline.fsdp_roots() if self.pipeline is not None else [])]
        roots = [r for r in roots if isinstance(r, FSDPModule)]
        for root in roots:
            root.unshard()
        try:
            yield
        finally:
            for root in roots:
                root.reshard()

    def share(self, out: Optional[dict]) -> dict:
        """The driver's figures on every rank of its pipeline (rank 0 holds the first stage)."""
        if self.plan is None:
            return out
        box = [out]
        dist.broadcast_object_list(box, group=self.pp_group, group_src=self.plan.driver)
        return box[0]

    # --- the pipeline protocol -------------------------------------------------------------------
    def send_header(self, cmd: int, tokens=None, positions=None, cap: int = 0, depth: int = 0,
                    ring: int = 0, row_end: Optional[torch.Tensor] = None, flags: int = 0,
                    span: int = 0) -> None:
        """Driver: announce a forward. The body is [3, B, S]: token ids (every stage: PLE hashes
        them), positions, and each row's last real position (row_end, repeated along S; zeros when
        unset)."""
        b, s = positions.shape if positions is not None else (0, 0)
        flags |= _ROW_END if row_end is not None else 0
        head = torch.tensor([cmd, b, s, cap, depth, ring, flags, span], dtype=torch.long,
                            device=self.device)
        dist.broadcast(head, group=self.pp_group, group_src=self.plan.driver)
        if cmd != _STOP:
            ends = (
                row_end.to(torch.long)[:, None].expand(b, s)
                if row_end is not None
                else torch.zeros_like(positions)
            )
            body = torch.stack([tokens.to(torch.long), positions.to(torch.long),
                                ends.to(positions.device, torch.long)])
            dist.broadcast(body.contiguous(), group=self.pp_group, group_src=self.plan.driver)

    def send_recall(self, probe: RecallProbe) -> None:
        """Follower: the recall values this rank's QSA layers measured in one forward, to the driver
        (a fixed-size message: the count, then the values)."""
        msg = torch.zeros(1 + max(self.plan.qsa_layers, 1), dtype=torch.float32, device=self.device)
        values = [v.float().reshape(()) for v in probe.values]
        msg[0] = len(values)
        if values:
            msg[1:1 + len(values)] = torch.stack(values).to(self.device)
        dist.send(msg, group=self.pp_group, group_dst=self.plan.driver)

    def receive_recall(self, ranks) -> None:
        """Driver: add the other ranks' recall values of the forward that just ran to the active
        probe."""
        for src in ranks:
            msg = torch.empty(1 + max(self.plan.qsa_layers, 1), dtype=torch.float32,
                              device=self.device)
            dist.recv(msg, group=self.pp_group, group_src=src)
            if RecallProbe.active is not None:
                RecallProbe.active.values.extend(msg[1:1 + int(msg[0])].unbind())

    def stop(self) -> None:
        """Driver: the followers' `follow` returns."""
        if self.plan is not None:
            self.send_header(_STOP)

    def follow(self) -> None:
        """Follower: run this rank's stages for every forward the driver announces, until it
        stops."""
        cache, mtp_caches, plan = None, {}, self.plan
        while True:
            head = torch.empty(HEADER, dtype=torch.long, device=self.device)
            dist.broadcast(head, group=self.pp_group, group_src=plan.driver)
            cmd, b, s, cap, depth, ring, flags, span = head.tolist()
            if cmd == _STOP:
                return
            body = torch.empty(3, b, s, dtype=torch.long, device=self.device)
            dist.broadcast(body, group=self.pp_group, group_src=plan.driver)
            recall = bool(flags & _RECALL)
            documents = Documents.from_positions(body[1]) if flags & _DOCUMENTS else None
            if cmd in (_MTP_STEP, _MTP_NORM):
                if plan.mtp_rank(depth) == plan.pp_rank:
                    self._serve_depth(cmd, depth, body, cap, mtp_caches, cache, recall, documents)
                continue
            if cmd == _SERVING_STEP:
                if plan.serving_rank == plan.pp_rank:
                    self._serve_serving_step(depth, body, span, mtp_caches, cache)
                continue
            # the decoder's ring size: recurrent state must outlast a verify forward
            if cmd == _NEW_CACHE:
                cache = DecodeCache(self.cfg.model.num_layers, b, cap, self.dtype, self.device,
                                    ring=ring)
                mtp_caches = {}
            if cache is not None:
                cache.row_end = body[2, :, 0].clone() if flags & _ROW_END else None
            with RecallProbe(self.base) if recall else contextlib.nullcontext() as probe:
                self.stages.run(body[0], body[1], cache if cmd != _NO_CACHE else None, documents)
            if recall and plan.pp_rank in plan.recall_ranks:
                self.send_recall(probe)

    def _serve_depth(self, cmd: int, depth: int, body, with_cache: int, mtp_caches: dict, cache,
                     recall: bool = False, documents=None) -> None:
        """Run MTP depth `depth` (its step, with this rank's cache of that depth, or its final norm)
        on a hidden state from the driver and send the result back (then its QSA recall, if
        asked)."""
        b, s = body.shape[1:]
        h = torch.empty(b, s, boundary_width(self.cfg.model), dtype=self.dtype, device=self.device)
        dist.recv(h, group=self.pp_group, group_src=self.plan.driver)
        if cmd == _MTP_NORM:
            out = self.base.final_norm(depth, h)
        else:
            layer = None
            if with_cache:
                # one cache per depth (depths share weights, not states)
                if depth not in mtp_caches:
                    mtp_caches[depth] = DecodeCache(1, b, cache.max_len, self.dtype, self.device,
                                                    ring=cache.ring,
                                                    shared=cache.shared).layer(0)  # QSA index reuse
                layer = mtp_caches[depth]
            with (
                RecallProbe(self.base.mtp.layer_for_step(depth))
                if recall
                else contextlib.nullcontext() as probe
            ):
                if layer is None:
                    # a teacher-forced chain (no cache): depth 1's QSA selection is handed to the
                    # later depths the driver asks for next, as `depth_states` does
                    selection = self._tf_selection if depth > 1 else None
                    out, self._tf_selection = self.base.mtp_train_step(depth, h, body[0], body[1],
                                                                       selection=selection,
                                                                       documents=documents)
                else:
                    out = self.base.mtp_step(depth, h, body[0], body[1], layer)
        dist.send(out.to(self.dtype).contiguous(), group=self.pp_group, group_dst=self.plan.driver)
        if recall:
            self.send_recall(probe)

    def _serve_serving_step(self, depth: int, body, span: int, mtp_caches: dict, cache) -> None:
        """Run MTP depth `depth` the serving way (eval/draft_serving.serving_step) on this rank's
        one serving cache of the decode, for a driver that holds no MTP layer, and send the result
        back."""
        b, s = body.shape[1:]
        h = torch.empty(b, s, boundary_width(self.cfg.model), dtype=self.dtype, device=self.device)
        dist.recv(h, group=self.pp_group, group_src=self.plan.driver)
        if "serving" not in mtp_caches:
            mtp_caches["serving"] = DecodeCache(1, b, cache.max_len, self.dtype, self.device,
                                                ring=cache.ring).layer(0)
        out = serving_step(self.base, mtp_caches["serving"], depth, h, body[0], body[1], span)
        dist.send(out.to(self.dtype).contiguous(), group=self.pp_group, group_dst=self.plan.driver)

    # --- data-parallel split (drivers) -----------------------------------------------------------
    def my_batches(self, n_batches: int) -> List[Optional[int]]:
        """Global indices of the prompt batches this replica decodes, None for padding slots (every
        replica runs the same number of slots)."""
        per = math.ceil(n_batches / self.replicas)
        return [i if i < n_batches else None
                for i in (self.replica + j * self.replicas for j in range(per))]

    def any_active(self) -> Callable[[bool], bool]:
        if self.replicas == 1:
            return lambda local: local

        def reduce(local: bool) -> bool:
            flag = torch.tensor([int(local)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.replica_group)
            return bool(flag.item())

        return reduce

    def gather(self, results: list) -> list:
        """Every replica's (batch index, result) pairs, in batch order."""
        if self.replicas == 1:
            return sorted(results, key=lambda r: r[0])
        parts = [None] * self.replicas
        dist.all_gather_object(parts, results, group=self.replica_group)
        return sorted((r for part in parts for r in part), key=lambda r: r[0])
