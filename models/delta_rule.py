"""The gated delta rule of Gated DeltaNet (models/gated_deltanet.py), in two forms.

Two forms of the same rule, both in fp32, autocast or not (the recurrence is where rounding builds
up):
* recurrent: token by token, O(T * Dk * Dv) per head and only the state in memory; used for
  decoding.
* chunked (training and long prefills): the sequence is cut into chunks of C = 64 tokens. Inside a
  chunk the C sequential writes are folded into one unit-lower-triangular solve (the WY / UT form),
  so all chunks are processed in parallel with matmuls, and only a loop over T / C chunks carries
  the state. Per head: compute O(T*C*(Dk+Dv) + T*Dk*Dv), activations O(T*(C+Dk+Dv)) plus one Dk x Dv
  state per chunk kept for backward. The solve is by substitution (`unit_lower_inverse`): what real
  text puts into a chunk (runs of one token, periodic tokens, near-duplicate keys, slow decay) makes
  the powers of the chunk's matrix huge while its inverse stays bounded, so any series in those
  powers loses everything in fp32 (tests/unit/test_gated_deltanet.py's adversarial cases). fla's
  Triton kernels (flash-linear-attention) do the same in fused form and are used when available on
  CUDA (`kernel="auto"`). Ascend (and CPU) runs this pure-PyTorch chunked form: torch_npu ships no
  Gated DeltaNet kernel this module is written against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps inside the root, as fla and transformers do, so checkpoints see identical keys.
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q_bhtk, k_bhtk, v_bhtv, g_bht, beta_bht, state_bhkv=None,
                               keep_states=False, resets_bt=None):
    """Token-by-token rule (fp32 inputs; q/k normalised and q scaled already). Returns the outputs
    [B, H, T, Dv], the final state [B, H, Dk, Dv] and, with keep_states, every step's state
    [B, T, H, Dk, Dv] (the decoder writes each one to its ring slot). `resets_bt` [B, T] bool: a
    document starts there, so the state entering that token is zero."""
    b, h, t, dk = k_bhtk.shape
    s = state_bhkv if state_bhkv is not None else k_bhtk.new_zeros(b, h, dk, v_bhtv.shape[-1])
    outs, states = [], []
    for i in range(t):
        k_bhk = k_bhtk[:, :, i]
        s = s * g_bht[:, :, i].exp()[..., None, None]
        if resets_bt is not None:
            s = torch.where(resets_bt[:, i, None, None, None], 0.0, s)
        recalled_bhv = (k_bhk.unsqueeze(-2) @ s).squeeze(-2)
        delta_bhv = beta_bht[:, :, i, None] * (v_bhtv[:, :, i] - recalled_bhv)
        s = s + k_bhk.unsqueeze(-1) * delta_bhv.unsqueeze(-2)
        outs.append((q_bhtk[:, :, i].unsqueeze(-2) @ s).squeeze(-2))
        if keep_states:
            states.append(s)
    out_bhtv = torch.stack(outs, 2) if outs else v_bhtv.new_zeros(v_bhtv.shape)
    return out_bhtv, s, (torch.stack(states, 1) if keep_states else None)


SOLVE_BLOCK = 16


def _diagonal_blocks(a_ncc: torch.Tensor, size: int) -> torch.Tensor:
    """The diagonal size x size blocks [..., C / size, size, size] of a [..., C, C] (a view)."""
    m = a_ncc.shape[-1] // size
    blocks = a_ncc.unflatten(-2, (m, size)).unflatten(-1, (m, size)).diagonal(dim1=-4, dim2=-2)
    return blocks.movedim(-1, -3)


def _unit_lower_inverse_forward(a_ncc: torch.Tensor) -> torch.Tensor:
    c = a_ncc.shape[-1]
    n = SOLVE_BLOCK
    while n < c:
        n *= 2
    a = F.pad(a_ncc, (0, n - c, 0, n - c)) if n != c else a_ncc  # zero rows/columns: identity there
    # Forward substitution inside each diagonal block, all blocks of all chunks at once: row i of
    # T = (I + A)^-1 is e_i - A[i, :i] T[:i, :], built from rows that are already final.
    diag = _diagonal_blocks(a, SOLVE_BLOCK)
    t = torch.eye(SOLVE_BLOCK, dtype=a.dtype, device=a.device).expand(diag.shape).clone()
    for i in range(1, SOLVE_BLOCK):
        t[..., i, :] -= (diag[..., i:i + 1, :] @ t).squeeze(-2)
    # Merge neighbouring blocks with the exact inverse of a block lower-triangular matrix,
    # [[T11, 0], [-T22 A21 T11, T22]]: products of bounded factors only.
    size = SOLVE_BLOCK
    while size < n:
        a21 = _diagonal_blocks(a, 2 * size)[..., size:, :size]
        t11, t22 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        t21 = -(t22 @ a21 @ t11)
        t = torch.cat([torch.cat([t11, torch.zeros_like(t11)], -1), torch.cat([t21, t22], -1)], -2)
        size *= 2
    t = t.squeeze(-3)
    return t[..., :c, :c] if n != c else t


class _UnitLowerInverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_ncc):
        t_ncc = _unit_lower_inverse_forward(a_ncc)
        ctx.save_for_backward(t_ncc)
        return t_ncc

    @staticmethod
    def backward(ctx, grad_t):
        # dT = -T dA T, so dL/dA = -T^T (dL/dT) T^T, of which only the strictly-lower part is an
        # input.
        (t_ncc,) = ctx.saved_tensors
        t_t = t_ncc.transpose(-1, -2)
        return -(t_t @ grad_t @ t_t).tril(-1)


def unit_lower_inverse(a_ncc: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C] (any C; batched over the leading
    dims).

    The delta rule's A (beta * decayed dot products of L2-normalised keys) has |A_ij| < 1, but
    inside a run of one token, periodic text or near-duplicate keys its powers grow binomially
    (~1e17 at C = 64) while the inverse stays bounded, so a series in powers of A ((I - A)(I +
    A^2)(I + A^4)...) cancels to nothing in fp32. This solves by substitution instead, which never
    forms a power of A: forward substitution in 16 x 16 diagonal blocks, then exact block-inverse
    merges, all batched matmuls and elementwise ops (so it runs wherever matmul does: CUDA, NPU,
    CPU, with no LAPACK triangular solve). Backward is the closed form from the saved inverse, which
    is as well conditioned as the forward."""
    return _UnitLowerInverse.apply(a_ncc)


def chunked_gated_delta_rule(q_bhtk, k_bhtk, v_bhtv, g_bht, beta_bht, state_bhkv=None, chunk=CHUNK,
                             resets_bt=None):
    """The same rule, C = `chunk` tokens at a time. Returns (outputs [B, H, T, Dv], final state).

    Inside a chunk write G_i = g_1 + ... + g_i (log decay since the chunk start) and S_0 for the
    state entering it. Unrolling the recurrence, S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i-G_j} k_j
    u_j^T with the written errors u_j = beta_j (v_j - e^{G_j} S_0^T k_j - sum_{m<j} e^{G_j-G_m}
    (k_j.k_m) u_m). That is a unit-lower-triangular system (I + A) U = beta V - beta e^G K S_0 (T =
    (I + A)^-1 from `unit_lower_inverse`), so U = W - Kc S_0 with W, Kc independent of the state:
    one batched solve for all chunks, then a short loop over chunks that only needs matmuls with the
    carried state.

    `resets_bt` [B, T] bool (packed documents): the state entering a reset token is zero. Inside a
    chunk the tokens fall into segments between resets; a token reads and writes only within its
    segment, only the first segment reads the entering state and only the last one's writes carry
    to the next chunk.

    The log decay between two tokens, G_i - G_j, is summed directly over g_{j+1..i} (and the decay
    to the chunk's end over g_{i+1..}), never taken as a difference of running sums: after a
    fast-forgetting token (g ~ -100, which real gates reach) both sums carry its magnitude, and
    their difference keeps only |G| * 6e-8 of fp32 precision, a relative 4e-4 in the slow tokens'
    outputs after it, in one document or, across a reset, from the one before.
    """
    b, h, t, dk = k_bhtk.shape
    dv = v_bhtv.shape[-1]
    pad = (-t) % chunk
    # Zero padding is inert: beta = 0 writes nothing and g = 0 does not decay.
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q_bhtk, k_bhtk, v_bhtv))
    g, beta = (F.pad(x, (0, pad)) for x in (g_bht, beta_bht))
    n = (t + pad) // chunk
    q, k, v = (x.view(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.view(b, h, n, chunk), beta.view(b, h, n, chunk)

    visible = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # between_bhncc[i, j] = g_{j+1} + ... + g_i for j < i (0 on and above the diagonal)
    between_bhncc = g[..., :, None].expand(*g.shape, chunk).masked_fill(
        ~visible.tril(-1), 0.0).cumsum(-2)
    G_bhnc = g.cumsum(-1)                    # since the chunk's start: read by its first segment
    if resets_bt is not None:
        # segment within chunk
        seg_b1nc = F.pad(resets_bt, (0, pad)).view(b, 1, n, chunk).long().cumsum(-1)
        visible = visible & (seg_b1nc[..., :, None] == seg_b1nc[..., None, :])
        G_bhnc = G_bhnc.masked_fill(seg_b1nc != 0, float("-inf"))  # later segments start at zero
        writes_end_b1nc = seg_b1nc == seg_b1nc[..., -1:]
    # e^{G_i - G_j} for j <= i, masked before exp to the pairs in one segment
    decay_bhncc = between_bhncc.masked_fill(~visible, float("-inf")).exp()
    k_beta = k * beta[..., None]
    A_bhncc = ((k_beta @ k.transpose(-1, -2)) * decay_bhncc).tril(-1)
    T_bhncc = unit_lower_inverse(A_bhncc)
    W_bhncv = T_bhncc @ (v * beta[..., None])
    from_start = G_bhnc.exp()[..., None]                             # decay since the chunk's start
    to_end = between_bhncc[..., -1, :]                               # decay up to the chunk's end
    if resets_bt is not None:  # masked before exp: across segments the difference means nothing
        to_end = to_end.masked_fill(~writes_end_b1nc, float("-inf"))
    to_end = to_end.exp()[..., None]
    chunk_decay_bhn11 = G_bhnc[..., -1].exp()[..., None, None]
    Kc_bhnck = T_bhncc @ (k_beta * from_start)
    # intra-chunk reads, diagonal included
    attn_bhncc = (q @ k.transpose(-1, -2)) * decay_bhncc
    q_from_start = q * from_start                                    # reads of the entering state
    # writes decayed to the chunk end
    k_to_end = k * to_end

    s = state_bhkv if state_bhkv is not None else q.new_zeros(b, h, dk, dv)
    outs = []
    # Each tensor cut into its chunks once: indexing one chunk out of a tensor that needs a
    # gradient costs a zero fill of the whole tensor in backward, once per chunk (a backward
    # quadratic in the sequence: 32 s instead of 4 at 65536 tokens); unbind's backward is one stack.
    chunks = zip(*(x.unbind(2) for x in (W_bhncv, Kc_bhnck, q_from_start, attn_bhncc,
                                          chunk_decay_bhn11, k_to_end)))
    for W_bhcv, Kc_bhck, q_start_bhck, attn_bhcc, decay_bh11, k_end_bhck in chunks:
        u_bhcv = W_bhcv - Kc_bhck @ s
        outs.append(q_start_bhck @ s + attn_bhcc @ u_bhcv)
        s = s * decay_bh11 + k_end_bhck.transpose(-1, -2) @ u_bhcv
    out_bhtv = torch.stack(outs, 2).view(b, h, n * chunk, dv)[:, :, :t]
    return out_bhtv, s
