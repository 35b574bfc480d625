"""Context parallelism (parallel.cp) in the cost model: which window rows each cp rank holds, its
training FLOPs under either sharding, and the memory and collective bytes CP adds to a rank.

A window of S tokens is cut into 2 x cp chunks (zigzag: rank r holds chunks r and 2cp - 1 - r) or cp
chunks (contiguous: rank r holds chunk r). Per-token work (projections, MLP / MoE,
hyper-connections, PLE, Gated DeltaNet's delta rule, the heads) is the same for every token, so it
splits evenly either way. What depends on position is the window work of cost.py `window_work`: full
causal attention over t + 1 keys (quadratic) and QSA's indexer scoring of floor((t + 1) / r) blocks
(S^2 / r), with QSA's attention over a fixed budget (linear). Zigzag pairs an early chunk with a
late one, so every rank gets the same share of it; contiguous gives the last rank (2cp - 1) / cp
times the mean of it.

Under CP, Gated DeltaNet runs each chunk from the state [I | 0] with its value width augmented by dk
(the chunk's transition operator and its final state from a zero state come out of one pass), the
ranks all-gather every chunk's (transition [H, dk, dk], final state [H, dk, dv]) in fp32, and each
folds its predecessors' into the state entering its chunks. Memory per rank, kept for backward per
layer and micro-batch in flight (`context_bytes`): attention's and QSA's gathered K and V ([B, S,
kv_heads / tp, head_dim] each), QSA's gathered raw indexer keys ([B, S, D_i]) and its selections
([B, S/cp, budget/r] blocks and [B, S/cp, budget + r - 1] slots, int64), GDN's exchanged states and
augmented value columns, and the conv halos (GDN: kernel - 1 rows of its conv input; PLE:
(ple_conv_kernel - 1) x ngram_size rows of the hc x H stream). Transient, once: QSA's streamed
top-k, one block of `QSA_STREAM_ELEMS` scores (fp32) and their sort keys (int64), never the [S/cp x
S/r] matrix.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import numpy as np

from tandem.models import ModelConfig, MTPConfig

from .config_checks import ConfigError
from .cost import (
    GDN_CHUNK,
    attention_widths,
    forward_flops_per_token,
    mean_window_work,
    mtp_kind,
    mtp_reuses_selection,
    qsa_score_work,
    window_work,
)
from .estimate_bytes import compute_bytes
from .parallel.validate import microbatch_sequences, validate_context_parallel

CP_SIZES = (4, 8, 16, 32, 64, 128)
"""The cp sizes `tandem launch slurm --check` sizes a CP recipe at (docs/long_context.md)."""
QSA_STREAM_ELEMS = 1 << 26
"""Scores one streamed top-k step holds (models/qsa.py chunk_elems)."""
DEVICE_GIB = {"cuda": ("H200", 139.0), "npu": ("Ascend 910B", 60.0)}
"""What a rank may use: an H200 (141 GB; 139 GiB as PyTorch sees it) and a 910B (64 GB; ~60 GiB)."""


def rank_chunks(seq_len: int, cp: int, sharding: str) -> List[List[Tuple[int, int]]]:
    """Each cp rank's [start, end) window rows, in window order."""
    if sharding == "zigzag":
        c = seq_len // (2 * cp)
        return [[(r * c, (r + 1) * c), ((2 * cp - 1 - r) * c, (2 * cp - r) * c)] for r in range(cp)]
    c = seq_len // cp
    return [[(r * c, (r + 1) * c)] for r in range(cp)]


def mixer_counts(cfg: ModelConfig, mtp: MTPConfig) -> Dict[str, int]:
    """How many token mixers of each kind a window runs through: the trunk's and one per MTP
    depth."""
    out: Dict[str, int] = {}
    for i in range(cfg.num_layers):
        out[cfg.layer_type(i)] = out.get(cfg.layer_type(i), 0) + 1
    if mtp.num_steps:
        out[mtp_kind(cfg)] = out.get(mtp_kind(cfg), 0) + mtp.num_steps
    return out


def gdn_context_flops(cfg: ModelConfig, tokens: int, window_chunks: int) -> float:
    """Forward FLOPs one GDN layer adds under CP for `tokens` rows: the value width augmented by dk
    per value head (the chunked rule's 4 C dv + 6 dk dv terms at dv + dk), the entering state
    applied once to each row (2 dk dv: its key-side part travels in the augmented values), and the
    fold through all `window_chunks` chunks of the window, which every rank runs (T S: 2 dk^2 dv
    each; trainer/parallel/context.py `carry`)."""
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim

    per_token = nv * (4 * GDN_CHUNK * dk + 6 * dk * dk + 2 * dk * dv)
    return tokens * per_token + window_chunks * nv * 2 * dk * dk * dv


def rank_training_flops(cfg: ModelConfig, mtp: MTPConfig, seq_len: int, cp: int,
                        sharding: str) -> List[float]:
    """Training FLOPs (3x the forward) each cp rank spends on one sequence: per-token work for its
    rows, the window work of each of its rows' positions, and under cp > 1 Gated DeltaNet's exchange
    work."""
    layers, head = forward_flops_per_token(cfg, mtp, seq_len)
    counts = mixer_counts(cfg, mtp)
    # the MTP depths reusing depth 1's QSA selection score no blocks (their forward FLOPs leave the
    # indexer out): their window work is QSA's without the scores
    reused = sum(mtp_reuses_selection(cfg, mtp, d) for d in range(1, mtp.num_steps + 1))
    visible = np.arange(1, seq_len + 1, dtype=np.float64)
    scores = reused * qsa_score_work(cfg, visible)
    flat = layers + (1 + mtp.num_steps) * head - sum(n * mean_window_work(cfg, k, seq_len) for k,
                                                     n in counts.items()) + float(scores.mean())
    work = sum(n * window_work(cfg, k, visible) for k, n in counts.items()) - scores
    cum = np.concatenate([[0.0], np.cumsum(work)])
    gdn = counts.get("linear_attention", 0) if cp > 1 else 0
    out = []
    for spans in rank_chunks(seq_len, cp, sharding):
        rows = sum(b - a for a, b in spans)
        fwd = rows * flat + sum(cum[b] - cum[a] for a, b in spans)
        fwd += gdn * gdn_context_flops(cfg, rows, len(spans) * cp)
        out.append(3 * fwd)
    return out


def balance(cfg: ModelConfig, mtp: MTPConfig, seq_len: int, cp: int, sharding: str) -> float:
    """The most expensive cp rank's training FLOPs over the mean."""
    flops = rank_training_flops(cfg, mtp, seq_len, cp, sharding)
    return max(flops) / (sum(flops) / len(flops))


def context_bytes(cfg, layers: List[int], depths: int, act_bytes: int) -> Dict[str, float]:
    """Bytes CP adds to a rank holding trunk `layers` and `depths` MTP depths, per micro-batch in
    flight (kept for backward), by part; `stream`: QSA's transient top-k block; `sent`: bytes the
    rank sends per micro-batch, forward and backward (all-gathers of K/V, indexer keys, GDN states
    and the MoE aux loss's router logits with their gradients' reduce-scatters, QSA's positions,
    halo exchanges), as bench/comm_volume.py measures them (a ring's (cp - 1)/cp of each
    all-gather's output)."""
    m, p = cfg.model, cfg.parallel
    if p.cp <= 1:
        return {}
    b, s, cp = microbatch_sequences(cfg), cfg.data.seq_len, p.cp
    chunks = 2 if p.cp_sharding == "zigzag" else 1
    kinds = [m.layer_type(i) for i in layers] + [mtp_kind(m)] * depths
    n_attn = sum(k != "linear_attention" for k in kinds)
    n_qsa = sum(k == "indexed_attention" for k in kinds)
    n_gdn = sum(k == "linear_attention" for k in kinds)
    # the keys and values gathered per token: GQA's K and V heads, or MLA's expanded per-head ones
    kv = (max(m.num_kv_heads // p.tp, 1) * m.resolved_head_dim * 2 if not m.kv_lora_rank
          else sum(attention_widths(m)) // p.tp)
    nv, dk, dv = max(m.linear_num_value_heads // p.tp,
                     1), m.linear_key_head_dim, m.linear_value_head_dim
    conv = (2 * m.linear_num_key_heads * dk + m.linear_num_value_heads * dv) // p.tp
    k_sel = m.indexer_budget // m.indexer_compress_ratio
    slots = m.indexer_budget + m.indexer_compress_ratio - 1
    # MTP depths reusing depth 1's selection run no indexer, so they gather no raw indexer keys
    indexing = n_qsa - sum(mtp_reuses_selection(m, cfg.mtp, d) for d in range(1, depths + 1))
    # every chunk's (transition, final state), gathered over the window, fp32
    gdn_gathered = n_gdn * b * chunks * cp * nv * dk * (dk + dv) * 4
    out = {
        "gathered_kv": n_attn * b * s * kv * act_bytes + indexing * b * s * m.indexer_head_dim
        * act_bytes, "qsa_selection": n_qsa * b * (s / cp) * (k_sel + slots) * 8,
        # and the state entering each chunk, which the fold keeps for its backward
        "gdn_states": gdn_gathered + n_gdn * b * chunks * cp * nv * dk * dv * 4,
        "gdn_width": n_gdn * 2 * b * (s / cp) * nv * dk * _gdn_value_bytes(cfg, act_bytes),
        "halos": chunks * b * act_bytes * (n_gdn * (m.linear_conv_kernel - 1) * conv + sum(
            (m.ple_conv_kernel - 1) * m.ngram_size * m.hc_count * m.hidden_size for i in layers
            if i in m.ple_layers)),
    }
    out["stream"] = QSA_STREAM_ELEMS * (4 + 8) if n_qsa else 0.0
    # an all-gather (and its gradient's reduce-scatter) sends this much of the whole
    share = (cp - 1) / cp
    # sent once, forward (no gradient): QSA's gathered positions (and the documents' starts), PLE's
    # n-gram ids halo; the MoE aux / z loss's 2E + 3 fp32 sums, all-reduced forward and backward (a
    # ring all-reduce sends twice `share` of it)
    ids = n_qsa * b * s * 8 * (2 if cfg.data.document_mask else 1)
    # the indexing QSA layers whose indexer learns by its KL send their raw keys' gradient and
    # gather the window's count of queries with a visible block ([B, S] int64, sent once); the
    # other indexing layers' raw keys get no gradient
    kl = indexing if m.indexer_loss_coef > 0 else 0
    ids += kl * b * s * 8 - (indexing - kl) * b * s * m.indexer_head_dim * act_bytes
    ple_ids = chunks * b * 8 * min(m.ngram_size - 1,
                                   s // (cp * chunks)) * sum(i in m.ple_layers for i in layers)
    aux = m.computes_aux_loss
    n_moe = sum(m.is_moe_layer(i) for i in layers) + (depths if cfg.mtp.moe and m.num_experts > 0
                                                      else 0)
    router = n_moe * 2 * 2 * 4 * (2 * m.num_experts + 3) if aux else 0
    # a halo's all-gather sends the rank's own tails (the size of the halo it receives) to each
    # other rank (a chunk shorter than a halo sends all its rows, and the halo is made of several
    # chunks' rows)
    length = s // (cp * chunks)
    halo_rows = n_gdn * min(m.linear_conv_kernel - 1, length) * conv + sum(
        min((m.ple_conv_kernel - 1) * m.ngram_size, length) * m.hc_count * m.hidden_size
        for i in layers if i in m.ple_layers)
    out["sent"] = share * (2 * (out["gathered_kv"] + gdn_gathered) + ids + router) + (cp
                                                                                           - 1) * (
        2 * chunks * b * act_bytes * halo_rows + ple_ids)
    return out


def _gdn_value_bytes(cfg, act_bytes: int) -> int:
    """Bytes per element of Gated DeltaNet's augmented values under CP: the compute dtype's in
    fla's kernel (CUDA, no packed documents), fp32 in the torch chunked form that runs everywhere
    else (models/gated_deltanet.py `_torch_inputs`: the state accumulates over the window)."""
    fla = (cfg.device == "cuda" and cfg.model.linear_kernel != "torch"
           and not cfg.data.document_mask)
    return act_bytes if fla else 4


def describe(cfg, parts: Dict[str, float], flops_balance: Dict[str, float]) -> str:
    """The --check line for CP: chunking, what it keeps and sends per rank, and the FLOPs
    balance."""
    p, s = cfg.parallel, cfg.data.seq_len
    chunks = 2 if p.cp_sharding == "zigzag" else 1
    gib = {k: v / 2**30 for k, v in parts.items()}
    kept = " ".join(f"{k}={gib[k]:.2f}" for k in ("gathered_kv", "qsa_selection", "gdn_states",
                                                  "gdn_width", "halos"))
    bal = " ".join(f"{k}={v:.3f}x" for k, v in flops_balance.items())
    return (f"\n  context parallel: cp={p.cp} {p.cp_sharding}, {chunks} chunk(s) of "
            f"{s // (p.cp * chunks)} tokens "
            f"per rank ({s // p.cp} of the {s}-token window); kept per micro-batch in flight "
            f"(GiB): {kept}; "
            f"QSA streamed top-k {gib.get('stream', 0):.2f} GiB transient; sent per rank per "
            "micro-batch "
            f"{gib['sent']:.2f} GiB; FLOPs per rank max/mean: {bal}")


def device_fit(cfg, total_gib: float) -> str:
    """`N GiB of the device's M (x%): fits` or `... does not fit`, for the recipe's device."""
    if cfg.device not in DEVICE_GIB:  # a CPU process: no device memory to hold it to
        return f"{total_gib:.1f} GiB"
    name, cap = DEVICE_GIB[cfg.device]
    verdict = "fits" if total_gib <= cap else "DOES NOT FIT"
    return f"{total_gib:.1f} of {name}'s {cap:.0f} GiB ({100 * total_gib / cap:.0f}%): {verdict}"


def cp_sweep(cfg, per_node: int, estimate_fn, sizes=CP_SIZES) -> List[str]:
    """Per-rank memory and node count of the recipe's layout at each cp size (dp, tp, pp, ep kept),
    one line each: `estimate_fn(cfg, world)` is trainer/estimate.py's estimate (parameters counted
    once)."""

    lines = []
    for size in sizes:
        trial = copy.deepcopy(cfg)
        trial.parallel.cp = size
        p = trial.parallel
        world = p.pp * max(p.dp, 1) * size * p.ep * p.tp
        try:
            validate_context_parallel(trial)
        except ConfigError as exc:
            lines.append(f"cp={size}: not possible ({exc})")
            continue
        est = estimate_fn(trial, world)
        nodes = (
            f"{world // per_node} nodes"
            if world % per_node == 0
            else f"{world / per_node:.2f} nodes"
        )
        lines.append(f"cp={size}: world {world} = {nodes} of {per_node}, per rank activations="
                     f"{est.activations_gib_per_rank:.1f} context={est.context_gib_per_rank:.1f} "
                     f"total {device_fit(trial, est.total_gib_per_rank)}")
    return lines


def context_fields(cfg, layers: List[List[int]], depths: List[int], held: List[float]) -> dict:
    """trainer/estimate.py's Estimate fields for CP (none at cp = 1), from each pp rank's trunk
    `layers` and MTP `depths`: the bytes of the rank holding the most (each rank keeps `held`
    micro-batches of them at its peak, as its schedule runs its stages: estimate.py
    _RankLayout.microbatches_held; QSA's transient block counts once), the FLOPs balance of both
    shardings, the note."""
    p = cfg.parallel
    if p.cp <= 1:
        return {}
    act_bytes = compute_bytes(cfg)  # the compute dtype's: bf16 under mixed precision, else fp32
    ranks = [context_bytes(cfg, mine, d, act_bytes) for mine, d in zip(layers, depths)]
    held = [held[r] * sum(v for k, v in parts.items() if k not in ("stream", "sent"))
            + parts["stream"] for r, parts in enumerate(ranks)]
    top = max(range(len(ranks)), key=held.__getitem__)
    parts = dict(ranks[top], held=held[top])
    bal = {s: balance(cfg.model, cfg.mtp, cfg.data.seq_len, p.cp, s) for s in ("zigzag",
                                                                               "contiguous")}
    return dict(context_gib_per_rank=held[top] / 2**30, context_parts=parts, cp_balance=bal,
                context_note=describe(cfg, parts, bal))
