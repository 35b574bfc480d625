"""Where everything lives in a pipeline: trunk layers and loss depths per stage, and what crosses
each stage boundary.

A pipeline has `pp * virtual` stages; stage s lives on pp rank s % pp. The trunk's layers are split
over the stages (`parallel.pp_layout`, even by default). The loss *depths* -- depth 0 is the trunk's
own head, depth k the MTP step k with its head -- are placed on stages too
(`parallel.pp_depth_stages`, all on the last stage by default, Megatron's placement). A depth's loss
is computed where it lives.

Why spread the depths: every depth ends in a vocabulary head, and with a large vocabulary one head
costs several transformer layers (the GPU recipe: one head 1.26 GFLOP per token to train, one MoE
layer 0.32). With all K+1 heads and the K MTP layers on the last stage, that stage bounds the whole
pipeline. Spread, the MTP chain continues through the stages after the trunk: a stage computing
depth k receives h_{k-1} from the stage before it, exactly as trunk stages receive the residual
stream.

The rules (checked by `check`): depths sit at or after the stage holding the trunk's last layer,
MTP depths in order (depth k needs h_{k-1}), the last stage holds a depth, and no stage is empty.
`parallel.pp_balance` picks the layout and the depth placement that minimise the most expensive
stage by `trainer/estimate.py`'s per-token training FLOPs (a linear partition of the sequence of
trunk layers and depths, with every position of depth 0 among the MTP depths tried).

Across a boundary after the trunk travel the chain's state h (h_0, the trunk output, until an MTP
depth ran) and, when a later stage still needs it and the chain has moved on, h_0 itself: for the
trunk's head, for the parallel MTP style (every depth reads h_0) and for the teacher of
`train.distill` / `mtp.loss.objective=acceptance` (the trunk's normed h_0).

Stages that compute depths hold the output head, the final norm where needed, the token embedding
(MTP steps embed tokens t+k) and the MTP module; copies on several pp ranks are kept identical by
summing their gradients over the ranks that hold them (the shared-embedding rule generalised). A
piece two stages of one rank use is an FSDP unit of its own (`shared_within_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..config_checks import ConfigError
from ..cost import (
    final_norm_forward_flops,
    head_forward_flops,
    head_passes,
    mtp_layer_training_flops,
    trunk_layer_training_flops,
)


def stage_layer_split(num_layers: int, num_stages: int, layout: List[int]) -> List[List[int]]:
    """Global trunk-layer indices of each pipeline stage (explicit layout, or as even as
    possible)."""
    if layout:
        counts = list(layout)
    else:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def num_stages(cfg) -> int:
    p = cfg.parallel
    return p.pp * (p.pp_virtual_stages if p.pp_schedule == "interleaved_1f1b" else 1)


# --- balancing ------------------------------------------------------------------------------------
def item_flops(cfg) -> Tuple[List[float], List[float]]:
    """Training FLOPs per token of (each trunk layer, each depth 0..K) by estimate.py's accounting,
    each layer by its own kind (attention, QSA over its selected tokens, Gated DeltaNet, with its
    hyper-connections and PLE; a QSA layer also pays its indexer KL's dense no-grad target): a layer
    3x its forward, a depth its MTP layer (3x: the qwen4_exp or concat combine, block and stream
    mixer; no indexer or KL target where it reuses depth 1's QSA selection) plus its head (3x
    fused, 4x where it recomputes its logits in backward: cost.head_passes) over the depth's share
    of valid targets, and depth 0 the trunk's final norm (a stream mixer under
    hyper-connections)."""
    m, mtp, s = cfg.model, cfg.mtp, cfg.data.seq_len
    layers = [trunk_layer_training_flops(m, i, s) for i in range(m.num_layers)]
    head = head_passes(mtp) * head_forward_flops(m)
    depths = [head * (s - d) / s + (mtp_layer_training_flops(m, mtp, s, d) if d
                                        else 3 * final_norm_forward_flops(m))
              for d in range(1 + mtp.num_steps)]
    return layers, depths


def _partition(weights: Sequence[float], parts: int) -> Optional[List[int]]:
    """Sizes of `parts` contiguous non-empty groups of `weights` minimising the largest group
    sum."""
    n = len(weights)
    if n < parts:
        return None
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[j][i]: first i items in j groups
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for i in range(j, n + 1):
            for k in range(j - 1, i):
                cost = max(best[j - 1][k], prefix[i] - prefix[k])
                if cost < best[j][i] - 1e-9:
                    best[j][i], cut[j][i] = cost, k
    sizes, i = [], n
    for j in range(parts, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def selection_reused(cfg) -> bool:
    """Whether MTP depths 2..K reuse depth 1's QSA selection (mtp.qsa_reuse_indices with QSA MTP
    layers): the selection travels with the MTP chain, across a stage boundary where the depths are
    spread."""
    return bool(cfg.mtp.qsa_reuse_indices and cfg.mtp.num_steps >= 2 and cfg.model.uses_qsa)


def balanced_placement(cfg, stages: int) -> Tuple[List[int], List[int]]:
    """(trunk layers per stage, stage of each depth 0..K) minimising the most expensive stage."""
    layers, depths = item_flops(cfg)
    k = len(depths) - 1
    groups = [[d] for d in range(1, k + 1)]
    best = None
    # depth 0 goes before MTP group slot+1 (slot = len: after the last)
    for slot in range(len(groups) + 1):
        order = list(groups)
        order.insert(slot, [0])
        sizes = _partition(layers + [sum(depths[d] for d in group) for group in order], stages)
        if sizes is None:
            continue
        layout, depth_stage, pos = [], [0] * (k + 1), 0
        for stage, size in enumerate(sizes):
            items = range(pos, pos + size)
            layout.append(sum(1 for i in items if i < len(layers)))
            for i in items:
                if i >= len(layers):
                    for d in order[i - len(layers)]:
                        depth_stage[d] = stage
            pos += size
        cost = max(stage_flops(layers, depths, layout, depth_stage))
        if best is None or cost < best[0] - 1e-9:
            best = (cost, layout, depth_stage)
    if best is None:
        raise ConfigError(f"parallel.pp_balance: {stages} pipeline stages exceed the {len(layers)} "
                          "trunk layers "
                          f"plus {k + 1} loss depths there are to place")
    return best[1], best[2]


def stage_flops(layers: Sequence[float], depths: Sequence[float], layout: Sequence[int],
                depth_stage: Sequence[int]) -> List[float]:
    out, start = [], 0
    for stage, count in enumerate(layout):
        out.append(sum(layers[start:start + count]) + sum(f for d, f in enumerate(depths)
                                                          if depth_stage[d] == stage))
        start += count
    return out


# --- the plan -------------------------------------------------------------------------------------
@dataclass
class StagePlan:
    index: int
    layers: List[int]
    """Global trunk-layer ids."""
    depths: List[int]
    """Loss depths computed here, in order (0 = the trunk's head, k = MTP step k and its head)."""
    chain_in: int
    """MTP depth of the chain state this stage receives (0: h_0 or a trunk state)."""
    recv_h0: bool
    """Whether h_0 arrives as a second tensor (the chain has moved past it and this stage or a later
    one still needs it)."""
    send_h0: bool
    recv_selection: bool = False
    """Whether MTP depth 1's QSA selection arrives after the hidden states (mtp.qsa_reuse_indices
    with depth 1 on an earlier stage and a reusing depth here or later)."""
    send_selection: bool = False


class PipelinePlan:
    """The placement of one config (the same on every rank)."""

    def __init__(self, cfg):
        p, m, mtp = cfg.parallel, cfg.model, cfg.mtp
        self.pp, self.n_stages, self.num_depths = p.pp, num_stages(cfg), 1 + mtp.num_steps
        if p.pp_balance:
            layout, depth_stage = balanced_placement(cfg, self.n_stages)
        else:
            layout = list(p.pp_layout)
            depth_stage = list(p.pp_depth_stages) or [self.n_stages - 1] * self.num_depths
        self.layout = layout or [len(s) for s in stage_layer_split(m.num_layers, self.n_stages, [])]
        if len(self.layout) != self.n_stages:
            raise ConfigError(f"parallel.pp_layout has {len(self.layout)} entries but the pipeline "
                              "has "
                              f"{self.n_stages} stages (parallel.pp={p.pp} x "
                              f"{self.n_stages // p.pp} virtual)")
        if len(depth_stage) != self.num_depths:
            raise ConfigError(f"parallel.pp_depth_stages has {len(depth_stage)} entries but there "
                              "are "
                              f"{self.num_depths} loss depths (the trunk's head and "
                              f"mtp.num_steps={mtp.num_steps})")
        self.split = stage_layer_split(m.num_layers, self.n_stages, self.layout)
        self.depth_stage = depth_stage
        self.trunk_end = max((s for s in range(self.n_stages) if self.split[s]), default=0)
        self.spread = any(s != self.n_stages - 1 for s in depth_stage)
        # what needs h_0 after the chain moved on: the trunk's head, every depth of the parallel
        # style, and every MTP depth when a teacher (the trunk's normed h_0) is read
        teacher = cfg.train.distill != "none" or mtp.loss.objective == "acceptance"
        needs_h0 = {depth_stage[0]}
        if mtp.style != "looped" or teacher:
            needs_h0 |= {depth_stage[d] for d in range(1, self.num_depths)}
        elif mtp.trunk_input == "final_norm" and self.num_depths > 1:
            needs_h0.add(depth_stage[1])  # step 1 normalises h_0 with the trunk's final norm
        self.teacher, self.parallel_style = teacher, mtp.style != "looped"
        self.norm_input = mtp.trunk_input == "final_norm"
        self.tied = m.tie_embeddings
        self.stages: List[StagePlan] = []
        chain = 0
        for s in range(self.n_stages):
            depths = [d for d in range(self.num_depths) if depth_stage[d] == s]
            chain_in = chain
            chain = max([chain] + [d for d in depths if d > 0])
            later = any(t > s for t in needs_h0)
            self.stages.append(StagePlan(s, self.split[s], depths, chain_in, recv_h0=False,
                                         send_h0=chain > 0 and later and s < self.n_stages - 1))
        for s in range(1, self.n_stages):
            self.stages[s].recv_h0 = self.stages[s - 1].send_h0
        if selection_reused(cfg):
            # the selection crosses every boundary between depth 1's stage and the last reusing
            # depth's
            last_reuse = max(depth_stage[2:])
            for s in range(depth_stage[1], last_reuse):
                self.stages[s].send_selection = self.stages[s + 1].recv_selection = True

    def stage_rank(self, stage: int) -> int:
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> List[int]:
        return [s for s in range(self.n_stages) if s % self.pp == pp_rank]

    def stage_pieces(self, stage: int) -> List[str]:
        """The shared model pieces stage `stage` uses: `embed_tokens` (the first stage; the looped
        MTP steps embed tokens t+k; a head tied to it, so that both are one parameter that the
        pipeline sums like every piece held twice), `norm` (the trunk's head, the teacher,
        `mtp.trunk_input=final_norm`), `lm_head` and `mtp`."""
        st, pieces = self.stages[stage], []
        if stage == 0 or (any(st.depths) and not self.parallel_style) or (self.tied and st.depths):
            pieces.append("embed_tokens")
        first_step = 1 in st.depths or (self.parallel_style and any(st.depths))
        if 0 in st.depths or (self.teacher and any(st.depths)) or (self.norm_input and first_step):
            pieces.append("norm")
        if st.depths:
            pieces.append("lm_head")
        if any(st.depths):
            pieces.append("mtp")
        return pieces

    def holders(self) -> Dict[str, List[int]]:
        """pp ranks holding each shared piece (see `stage_pieces`)."""
        out: Dict[str, set] = {"embed_tokens": set(), "norm": set(), "lm_head": set(), "mtp": set()}
        for s in range(self.n_stages):
            for piece in self.stage_pieces(s):
                out[piece].add(self.stage_rank(s))
        return {k: sorted(v) for k, v in out.items()}

    def shared_within_rank(self) -> List[str]:
        """Pieces that two stages of one rank use (on any rank, so that every copy is held alike):
        FSDP cannot put them in both stages' roots, so each is an FSDP unit of its own, gathered
        through the step and reduce-scattered once after the rank's last stage using it
        (data.PieceUnits); under dp_mode=allreduce they stay whole (replicated, summed like the
        all-reduce mode)."""
        out = []
        for piece in ("embed_tokens", "norm", "lm_head", "mtp"):
            per_rank = [sum(piece in self.stage_pieces(s) for s in self.stages_of(r))
                        for r in range(self.pp)]
            if max(per_rank) > 1:
                out.append(piece)
        return out

    def check(self, cfg) -> None:
        """One-line ConfigError for a placement the pipeline cannot run."""
        p, m = cfg.parallel, cfg.model
        n, k = self.n_stages, self.num_depths - 1
        if p.pp_balance and (p.pp_layout or p.pp_depth_stages):
            raise ConfigError("parallel.pp_balance=true computes parallel.pp_layout and "
                              "parallel.pp_depth_stages; "
                              "leave them empty")
        if sum(self.layout) != m.num_layers or min(self.layout) < 0 or self.layout[0] < 1:
            raise ConfigError(f"parallel.pp_layout={list(self.layout)} must sum to "
                              f"model.num_layers={m.num_layers}, "
                              "with at least one layer on the first stage and none negative")
        ds = self.depth_stage
        past = [x for x in ds if not 0 <= x < n]
        if past:
            raise ConfigError(f"parallel.pp_depth_stages={list(ds)} names stage {past[0]}, but "
                              f"the pipeline has stages 0..{n - 1}")
        if min(ds) < self.trunk_end or max(ds) != n - 1:
            raise ConfigError(f"parallel.pp_depth_stages={list(ds)} must place every depth at or "
                              "after stage "
                              f"{self.trunk_end} (the trunk's last layer) and one on the last "
                              f"stage {n - 1}")
        if any(ds[d] > ds[d + 1] for d in range(1, k)):
            raise ConfigError(f"parallel.pp_depth_stages={list(ds)}: MTP depths must be in "
                              "pipeline order "
                              "(depth k reads depth k-1's hidden state)")
        empty = [st.index for st in self.stages if not st.layers and not st.depths]
        if empty:
            raise ConfigError(f"pipeline stage(s) {empty} hold no trunk layer and no loss depth "
                              f"(parallel.pp_layout={list(self.layout)}, "
                              f"parallel.pp_depth_stages={list(ds)}): set parallel.pp_balance="
                              "true or place them with parallel.pp_layout / pp_depth_stages, or "
                              "use fewer stages (parallel.pp, pp_virtual_stages)")
        if self.spread and m.tie_embeddings:
            raise ConfigError("model.tie_embeddings=true is not supported with loss depths spread "
                              "over pipeline "
                              "stages (parallel.pp_depth_stages / pp_balance)")
