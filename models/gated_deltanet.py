"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next / Qwen3.5 / Qwen4-Exp.

Each value head keeps a fast-weight memory S (a Dk x Dv matrix) that maps keys to values. Reading
is a query times the memory, o_t = S_t^T q_t. Writing is one step of online regression: first the
whole memory fades by a data-dependent factor a_t = exp(g_t) in (0, 1], then the value it would
currently recall for k_t is moved towards v_t by a learning rate beta_t in (0, 1):

    S_t = a_t * S_{t-1} + k_t * (beta_t * (v_t - a_t * S_{t-1}^T k_t))^T
        = a_t * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

(the "delta rule": only the error of the memory's prediction is written). q and k are
L2-normalised, q is scaled by Dk^-0.5, g_t = -exp(A_log) * softplus(a_t + dt_bias) and
beta_t = sigmoid(b_t). Value heads are grouped: each q/k head serves num_v_heads // num_k_heads
consecutive value heads. Around the rule: q, k, v come from one projection followed by a causal
depthwise conv (kernel `conv_kernel`) and SiLU; the output is RMS-normalised per head, gated by
act(z) (silu or sigmoid, `gate_act`) and projected back.

The rule itself, in its recurrent and chunked forms, is models/delta_rule.py.

Storage order (differs from transformers): `in_proj_qkv`'s output rows and the depthwise `conv1d`
channels are stored by key-head group, [q_g | k_g | v of the value heads g serves] for each key head
g, where transformers stores [q (all key heads) | k (all key heads) | v (all value heads)]. A
contiguous block of groups is then a whole set of heads, so tensor parallelism shards these two
parameters with a plain Shard(0) (Megatron's layout). The Hugging Face import/export permutes the
rows (`qkv_rows_from_hf`); checkpoints of transformers keep its order.

Tensor parallelism (trainer/parallel/tensor_hybrid.py): in_proj_qkv and conv1d shard by key-head
groups, in_proj_z/b/a, dt_bias and A_log by value heads, out_proj is row-parallel and the gated
norm's per-head_v_dim weight stays replicated. The module never trusts its constructor's head counts
at run time: the local value heads are the width of in_proj_b's output and the local key heads
follow from the fixed ratio num_v_heads / num_k_heads; `computed_params` is where the
tensor-parallel module hands forward its local shards of the non-Linear parameters.

Decoding follows models/state.py: the recurrent state after the token at position p lives in slot p
% (ring + 1) of the `gdn_state` ring [B, ring + 1, Hv, Dk, Dv] (fp32), the conv input of position p
in slot p % (ring + conv_kernel - 1) of `gdn_conv` [B, ring + conv_kernel - 1, conv channels] (a
resume reads one state and conv_kernel - 1 conv inputs). A forward over R <= ring tokens runs the
recurrent form and writes every position (so a speculative verify can resume from any accepted
prefix); a longer one (a prefill) runs the chunked form with padded tokens made inert and writes
only the state after `row_end` and the last conv_kernel - 1 real conv inputs. fla is used for the
chunked form only; the short cached forwards always run the torch recurrence (they need every step's
state).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .context import WholeWindow
from .delta_rule import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from .documents import Documents, causal_conv_taps, flat_cu_seqlens
from .layers import InitRule, InitScales, draw_init, rms_norm

_fla_chunk = None
"""flash-linear-attention's chunk_gated_delta_rule once `fla_kernel` has imported it (optional CUDA
kernels; the pure-PyTorch path below computes the same thing)."""
_fla_imported = False


def fla_kernel():
    """fla's kernel, imported on first need, None where it is not importable (a missing package,
    triton or CUDA unusable). Not at import: fla's import queries the current CUDA device (GPU 0
    in a rank that has not yet chosen its own) and loads triton, in every command that imports the
    model, those that never run a GPU kernel too."""
    global _fla_chunk, _fla_imported
    if _fla_chunk is None and not _fla_imported:
        _fla_imported = True
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
        except Exception:  # noqa: BLE001
            _fla_chunk = None
    return _fla_chunk


def qkv_rows_from_hf(num_k_heads: int, num_v_heads: int, head_k_dim: int,
                     head_v_dim: int) -> torch.Tensor:
    """Row permutation p of in_proj_qkv / conv1d with ours = theirs[p]: transformers' [q | k | v]
    order to this module's key-head-group order [q_g | k_g | v_g] (see the module docstring);
    theirs[p] = ours exports back."""
    key_dim, group_v = num_k_heads * head_k_dim, num_v_heads // num_k_heads * head_v_dim
    rows = []
    for g in range(num_k_heads):
        rows += [torch.arange(g * head_k_dim, (g + 1) * head_k_dim),
                 key_dim + torch.arange(g * head_k_dim, (g + 1) * head_k_dim),
                 2 * key_dim + torch.arange(g * group_v, (g + 1) * group_v)]
    return torch.cat(rows)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm times act(gate): plain `w * x_hat` (not zero-centred), normalised in
    fp32."""

    def __init__(self, dim: int, eps: float, act: str):
        super().__init__()
        self.eps, self.act = eps, act
        self.weight = nn.Parameter(torch.ones(dim))

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        return "ones", 0.0

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # The cast order matches transformers (w * x_hat in the input dtype, the gate in fp32) so
        # bf16 checkpoints reproduce the reference bit for bit where the math allows.
        y = rms_norm(x, self.weight, self.eps)
        g32 = F.silu(gate.float()) if self.act == "silu" else torch.sigmoid(gate.float())
        return (y * g32).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int,
                 conv_kernel: int, eps: float = 1e-6, gate_act: str = "silu", kernel: str = "auto"):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads "
                             f"{num_k_heads}")
        if gate_act not in ("silu", "sigmoid"):
            raise ValueError(
                f"Gated DeltaNet output gate must be silu or sigmoid, got {gate_act!r}"
            )
        if kernel not in ("auto", "fla", "torch"):
            raise ValueError(f"model.linear_kernel must be auto, fla or torch, got {kernel!r}")
        if kernel == "fla" and fla_kernel() is None:
            raise ValueError("model.linear_kernel=fla needs flash-linear-attention (pip install "
                             "flash-linear-attention), which is not importable here; use auto or "
                             "torch")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel, self.kernel = conv_kernel, kernel
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * key_dim + value_dim
        # output rows by key-head group [q_g | k_g | v_g] (transformers: [q | k | v];
        # qkv_rows_from_hf)
        self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        # Applied through F.conv1d with groups = the local channel count (see forward), never
        # through the module's own groups, so a channel-sharded weight needs no change here.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps, gate_act)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """dt_bias = 1 and A = exp(A_log) ~ U(0.01, 16), as transformers initialises them (the lower
        bound keeps log A finite; `param_init`). In place, so it is a no-op on the meta device."""
        for name in ("dt_bias", "A_log"):
            draw_init(getattr(self, name), self.param_init(name, None))
        draw_init(self.norm.weight, self.norm.param_init("weight", None))

    def computed_params(self):
        """(conv1d weight, A_log, dt_bias) as forward computes with them: the parameters themselves
        here; the tensor-parallel wrapper returns its local head shards."""
        return self.conv1d.weight, self.A_log, self.dt_bias

    def _use_fla(self, x: torch.Tensor) -> bool:
        # fla is Triton (CUDA only) and some versions reject fp32 inputs: "auto" keeps those on
        # torch.
        if self.kernel == "fla":
            return True
        return (self.kernel == "auto" and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
                and fla_kernel() is not None)

    def _chunked(self, q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn, state_bhkv, documents=None):
        """Chunked rule on [B, S, heads, dim] inputs (q/k heads already grouped up to the value
        heads). Returns (outputs [B, S, Hv, Dv] in v's dtype, final fp32 state). `documents`: the
        state resets at each document's start (training rows; no final state is needed then)."""
        if self._use_fla(v_bsnv):
            if documents is not None:
                return self._fla_varlen(q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn, documents), None
            out, final = _fla_chunk(q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn.to(v_bsnv.dtype),
                                    scale=self.head_k_dim ** -0.5, initial_state=state_bhkv,
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
            return out.to(v_bsnv.dtype), final.float()
        q, k, v, g, beta = self._torch_inputs(q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn)
        resets = documents.positions() == 0 if documents is not None else None
        # fp32 matmuls even under bf16 autocast: the chunk solve and the carried state are the
        # recurrence (a bf16 state drifts over thousands of tokens; fla keeps its state in fp32 too)
        with torch.autocast(v_bsnv.device.type, enabled=False):
            out_bhtv, final = chunked_gated_delta_rule(q, k, v, g, beta, state_bhkv,
                                                       resets_bt=resets)
        return out_bhtv.transpose(1, 2).to(v_bsnv.dtype), final

    def _fla_varlen(self, q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn, documents):
        """fla's variable-length form: the rows' documents laid end to end as one sequence, cut by
        `cu_seqlens` (fla's kernels restart the state at each cut)."""
        b, s = q_bsnk.shape[:2]
        cu_seqlens = flat_cu_seqlens(documents)
        flat = lambda x: x.reshape(1, b * s, *x.shape[2:])  # noqa: E731
        out, _ = _fla_chunk(flat(q_bsnk), flat(k_bsnk), flat(v_bsnv), flat(g_bsn),
                            flat(beta_bsn.to(v_bsnv.dtype)),
                            scale=self.head_k_dim ** -0.5, output_final_state=False,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        return out.reshape(b, s, *out.shape[2:]).to(v_bsnv.dtype)

    def _torch_inputs(self, q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn):
        # fp32 throughout: the state accumulates over thousands of tokens.
        q = l2_normalize(q_bsnk.float()) * self.head_k_dim ** -0.5
        k = l2_normalize(k_bsnk.float())
        return (q.transpose(1, 2), k.transpose(1, 2), v_bsnv.float().transpose(1, 2),
                g_bsn.float().transpose(1, 2), beta_bsn.float().transpose(1, 2))

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        """transformers' values, and the output projection as every residual one."""
        if name == "out_proj.weight":
            return "normal", scales.residual_std
        return {"A_log": ("a_log", 0.0), "dt_bias": ("ones", 0.0)}.get(name)

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache=None,
                documents: Optional[Documents] = None,
                context: Optional[WholeWindow] = None) -> torch.Tensor:
        """`documents` (packed training rows, no cache): the conv and the state restart at each
        document's start; `positions_bs` count from it. `context` (training under context
        parallelism): the rows are this rank's chunks of the window (`_over_chunks`)."""
        conv_w, a_log, dt_bias = self.computed_params()
        kernel = conv_w.shape[-1]
        qkv_bsc = self.in_proj_qkv(x_bsh)
        z_bsnv = self.in_proj_z(x_bsh).unflatten(-1, (-1, self.head_v_dim))
        b_bsn, a_bsn = self.in_proj_b(x_bsh), self.in_proj_a(x_bsh)
        if cache is None and context is not None and context.sharded:
            out_bsnv = self._over_chunks(qkv_bsc, b_bsn, a_bsn, positions_bs, documents, context)
            return self.out_proj(self.norm(out_bsnv, z_bsnv).flatten(-2))
        rings = state0_bhkv = None
        if cache is None:
            conv_in_bsc = F.pad(qkv_bsc, (0, 0, kernel - 1, 0))  # causal: left zero padding
        else:
            rings, conv_in_bsc, state0_bhkv = self._resume(cache, qkv_bsc, positions_bs, kernel,
                                                           b_bsn.shape[-1])
        if documents is not None and cache is None:
            mixed_bsc = F.silu(causal_conv_taps(qkv_bsc, conv_w[:, 0], positions_bs))
        else:
            mixed_bcs = F.conv1d(conv_in_bsc.transpose(1, 2), conv_w, groups=qkv_bsc.shape[-1])
            mixed_bsc = F.silu(mixed_bcs).transpose(1, 2)
        q_bsnk, k_bsnk, v_bsnv = self._split_heads(mixed_bsc, b_bsn.shape[-1])
        beta_bsn = b_bsn.sigmoid()
        g_bsn = -a_log.float().exp() * F.softplus(a_bsn.float() + dt_bias)  # log decay, <= 0
        heads = (q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn)
        if cache is None:
            out_bsnv, _ = self._chunked(*heads, None, documents)
        elif cache.keeps_every_position(x_bsh.shape[1]):
            out_bsnv = self._verify(heads, state0_bhkv, rings, positions_bs, qkv_bsc)
        else:
            out_bsnv = self._prefill(heads, state0_bhkv, rings, positions_bs, qkv_bsc, cache,
                                     kernel)
        y_bsnv = self.norm(out_bsnv, z_bsnv)
        return self.out_proj(y_bsnv.flatten(-2))

    def _over_chunks(self, qkv_bsc, b_bsn, a_bsn, positions_bs, documents, context: WholeWindow):
        """The rule on this rank's chunks of the window (context parallelism), each a batch row: the
        conv reads the kernel - 1 rows before its chunk (`context.halo`), the entering state comes
        from every earlier chunk (`context.carry`). Each chunk runs once from the state [I | 0] with
        values [0 | v]: the rule is linear in (state, values), so the first Dk columns follow the
        chunk's transition M (entered with X it leaves M X + F, F its final state from zero) and the
        outputs split alike, o_t = (q_t M_t) X + o_t(0); one (M, F) per chunk is exchanged, fp32. A
        document start zeroes M from there on (the carry is cut). fla's kernel runs it on CUDA
        without packed documents (its variable-length form restarts documents from zero, not from a
        carried state)."""
        conv_w, a_log, dt_bias = self.computed_params()
        kernel = conv_w.shape[-1]
        qkv, pos = context.split(qkv_bsc), context.split(positions_bs)
        extended = torch.cat([context.halo(qkv, kernel - 1), qkv], 1)
        if documents is not None:
            ext_pos = torch.cat([pos.new_zeros(pos.shape[0], kernel - 1), pos], 1)
            mixed = F.silu(causal_conv_taps(extended, conv_w[:, 0], ext_pos))[:, kernel - 1:]
        else:
            mixed = F.silu(F.conv1d(extended.transpose(1, 2), conv_w,
                                    groups=qkv.shape[-1])).transpose(1, 2)
        b_split = context.split(b_bsn)
        q_bsnk, k_bsnk, v_bsnv = self._split_heads(mixed, b_split.shape[-1])
        g_bsn = -a_log.float().exp() * F.softplus(context.split(a_bsn).float() + dt_bias)
        if self._use_fla(v_bsnv) and documents is None:
            return context.join(self._fla_over_chunk(q_bsnk, k_bsnk, v_bsnv, g_bsn,
                                                     b_split.sigmoid(), context))
        q, k, v, g, beta = self._torch_inputs(q_bsnk, k_bsnk, v_bsnv, g_bsn, b_split.sigmoid())
        bc, h, length, dk = q.shape
        eye = torch.eye(dk, device=q.device).expand(bc, h, dk, dk)
        with torch.autocast(qkv_bsc.device.type, enabled=False):
            out_aug, final_aug = chunked_gated_delta_rule(
                q, k, torch.cat([v.new_zeros(bc, h, length, dk), v], -1), g, beta,
                torch.cat([eye, v.new_zeros(bc, h, dk, v.shape[-1])], -1),
                resets_bt=(pos == 0) if documents is not None else None)
            entering = context.carry(final_aug[..., :dk], final_aug[..., dk:])
            out_bhtv = out_aug[..., dk:] + out_aug[..., :dk] @ entering
        return context.join(out_bhtv.transpose(1, 2).to(v_bsnv.dtype))

    def _fla_over_chunk(self, q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn, context: WholeWindow):
        """`_over_chunks`' rule through fla's kernel: [B*c, L, H, dim] inputs, the same augmented
        values and entering state, outputs [B*c, L, H, Dv] in v's dtype."""
        bc, length, h, dk = k_bsnk.shape
        eye = torch.eye(dk, device=v_bsnv.device).expand(bc, h, dk, dk)
        state0 = torch.cat([eye, eye.new_zeros(bc, h, dk, v_bsnv.shape[-1])], -1)
        v_aug = torch.cat([v_bsnv.new_zeros(bc, length, h, dk), v_bsnv], -1)
        out, final = _fla_chunk(q_bsnk, k_bsnk, v_aug, g_bsn, beta_bsn.to(v_bsnv.dtype),
                                scale=dk ** -0.5,
                                initial_state=state0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        final = final.float()
        entering = context.carry(final[..., :dk], final[..., dk:])  # [B*c, H, Dk, Dv]
        with torch.autocast(v_bsnv.device.type, enabled=False):
            out = out[..., dk:].float() + torch.einsum("blhk,bhkv->blhv", out[..., :dk].float(),
                                                       entering)
        return out.to(v_bsnv.dtype)

    def _resume(self, cache, qkv_bsc: torch.Tensor, positions_bs: torch.Tensor, kernel: int,
                hv: int):
        """((conv ring, state ring), the conv's input with the kernel - 1 previous inputs in front,
        the state after the previous position): what a forward continuing from the cache reads."""
        rows_b = torch.arange(qkv_bsc.shape[0], device=qkv_bsc.device)
        conv_ring = cache.ring_buffer("gdn_conv", (qkv_bsc.shape[-1],), qkv_bsc.dtype,
                                      lookback=kernel - 1)
        state_ring = cache.ring_buffer("gdn_state", (hv, self.head_k_dim, self.head_v_dim),
                                       torch.float32, lookback=1)
        start_b = positions_bs[:, 0]
        # The previous kernel-1 conv inputs (positions start-K+1 .. start-1), zeros before position
        # 0.
        prev_pos_bk = start_b[:, None] + torch.arange(1 - kernel, 0, device=qkv_bsc.device)
        prev_bkc = conv_ring[rows_b[:, None], prev_pos_bk % conv_ring.shape[1]].masked_fill(
            (prev_pos_bk < 0)[..., None], 0)
        conv_in_bsc = torch.cat([prev_bkc.to(qkv_bsc.dtype), qkv_bsc], 1)
        state0_bhkv = state_ring[rows_b, (start_b - 1) % state_ring.shape[1]].masked_fill(
            (start_b == 0)[:, None, None, None], 0)
        return (conv_ring, state_ring), conv_in_bsc, state0_bhkv

    def _split_heads(self, mixed_bsc: torch.Tensor, hv: int):
        """q, k (repeated to the value heads) and v from the conv's output. Local head counts come
        from the projection widths (tensor parallelism shards them by heads)."""
        b, s = mixed_bsc.shape[:2]
        dk, dv = self.head_k_dim, self.head_v_dim
        hk = hv * self.num_k_heads // self.num_v_heads
        # channels by key-head group: [q_g | k_g | v of the hv // hk value heads g serves]
        q_bsgk, k_bsgk, v_bsgv = mixed_bsc.unflatten(-1, (hk, -1)).split([dk, dk, hv // hk * dv],
                                                                         -1)
        q_bsnk, k_bsnk = (t.repeat_interleave(hv // hk, dim=2) for t in (q_bsgk, k_bsgk))
        return q_bsnk, k_bsnk, v_bsgv.reshape(b, s, hv, dv)

    def _verify(self, heads, state0_bhkv, rings, positions_bs: torch.Tensor, qkv_bsc: torch.Tensor):
        """Short forward (decode step or speculative verify): keep every position's state and conv
        input so that any accepted prefix can be resumed from (the rings' slots cover the forward
        plus what a resume reads before it: models/state.py)."""
        conv_ring, state_ring = rings
        rows_b = torch.arange(positions_bs.shape[0], device=positions_bs.device)
        q, k, v, g, beta = self._torch_inputs(*heads)
        with torch.autocast(qkv_bsc.device.type, enabled=False):
            out_bhtv, _, states_bshkv = recurrent_gated_delta_rule(q, k, v, g, beta, state0_bhkv,
                                                                   keep_states=True)
        state_ring[rows_b[:, None], positions_bs % state_ring.shape[1]] = states_bshkv.detach()
        conv_ring[rows_b[:, None],
                  positions_bs % conv_ring.shape[1]] = qkv_bsc.detach().to(conv_ring.dtype)
        return out_bhtv.transpose(1, 2).to(heads[2].dtype)

    def _prefill(self, heads, state0_bhkv, rings, positions_bs: torch.Tensor, qkv_bsc: torch.Tensor,
                 cache, kernel: int):
        """Long prefill: chunked form; padded tokens (past row_end) get beta = 0 and g = 0, which
        leaves the state untouched, so the final state is the state after each row's last real
        token."""
        conv_ring, state_ring = rings
        q_bsnk, k_bsnk, v_bsnv, g_bsn, beta_bsn = heads
        s, conv_slots = qkv_bsc.shape[1], conv_ring.shape[1]
        rows_b = torch.arange(positions_bs.shape[0], device=positions_bs.device)
        start_b = positions_bs[:, 0]
        row_end_b = cache.row_end if cache.row_end is not None else positions_bs[:, -1]
        real_bs1 = (positions_bs <= row_end_b[:, None])[..., None]
        out_bsnv, final_bhkv = self._chunked(q_bsnk, k_bsnk, v_bsnv, g_bsn * real_bs1,
                                             beta_bsn * real_bs1, state0_bhkv)
        state_ring[rows_b, row_end_b % state_ring.shape[1]] = final_bhkv.detach()
        # The last kernel - 1 real conv inputs (what the next forward reads); those before this
        # forward's start keep their slots.
        keep_pos_br = row_end_b[:, None] + torch.arange(2 - kernel, 1, device=qkv_bsc.device)
        j_br = keep_pos_br - start_b[:, None]
        fresh_br1 = (j_br >= 0)[..., None]
        slots_br = keep_pos_br % conv_slots
        new_brc = torch.where(fresh_br1,
                              qkv_bsc[rows_b[:, None], j_br.clamp(0, s - 1)].to(conv_ring.dtype),
                              conv_ring[rows_b[:, None], slots_br])
        conv_ring[rows_b[:, None], slots_br] = new_brc.detach()
        return out_bsnv
