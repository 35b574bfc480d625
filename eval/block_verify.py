"""Block verification of a speculative draft (Sun et al. 2024, "Block Verification Accelerates
Speculative Decoding", their Algorithm 2), batched over sequences.

Token-wise speculative sampling (sampling.speculative_accept) judges draft i on its own ratio
p/q and stops at the first rejection. Block verification judges the drafted block as a whole: a
later draft that the target likes more than the drafter did can pay for an earlier one it liked
less, so a prefix can be kept even though one of its tokens would have failed the token-wise test.
The output is still distributed exactly as sampling from the target alone, and the expected number
of accepted drafts is never below token-wise verification's on the same drafts (the paper proves
both; it also shows the rule is optimal among valid verifiers of a single draft block).

The rule, for one sequence. Drafts X_1..X_K, X^i = (X_1, .., X_i) (X^0 empty). The trunk gives the
target distributions P_i = p(. | context, X^i) at the K+1 verify positions i = 0..K; the drafter
sampled X_{i+1} from Q_i = q(. | context, X^i), i = 0..K-1.

* Running weight of the prefix: w_0 = 1 and w_i = min(1, w_{i-1} P_{i-1}(X_i) / Q_{i-1}(X_i)) -- the
  target/draft likelihood ratio of X^i, capped at 1 after every factor (not only at the end).
* Leftover mass after the prefix: r_i = sum_x max(w_i P_i(x) - Q_i(x), 0), i = 0..K-1.
* Stopping thresholds: h_i = r_i / (r_i + 1 - w_i) for i = 1..K-1 (taken as 1 when the denominator
  is 0, i.e. w_i = 1 and P_i = Q_i: a later threshold is then 1 as well, so the value never
  decides anything), and h_K = w_K.
* With independent uniforms u_1..u_K, the number of accepted drafts is tau = the LARGEST i in 1..K
  with u_i < h_i, or 0 when there is none. A failed test does not end the scan; any later success
  overrides it (this is where block verification gains over token-wise).
* The next token Y is drawn from P_K when tau = K, else from the block residual
  norm(max(w_tau P_tau - Q_tau, 0)) (for tau = 0 that is token-wise's norm(max(P_0 - Q_0, 0))).

Special cases. K = 1 is token-wise speculative sampling exactly (h_1 = w_1 = min(1, P_0(X_1) /
Q_0(X_1))). With one-hot P and Q (temperature 0) w_i is 1 along the prefix that matches the
target's argmax and 0 after the first mismatch, h_i is 1 at the last matched position and 0 past
it, so tau is the exact-match length and the residual is one-hot at the target's argmax: both rules
reduce to greedy exact-match acceptance (SpecDecoder.verify takes that path directly at T = 0).

tests/unit/test_block_verify.py checks the output distribution exactly by enumeration and by a
chi-square test through the decoder, and the expected accepted length against token-wise
verification exactly on small vocabularies.
"""

from __future__ import annotations

from typing import Tuple

import torch

VERIFY_RULES = ("token", "block")
"""Values of `eval.verify` / `tandem eval --verify`: token-wise speculative sampling or block
verification."""


def block_thresholds(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> Tuple[torch.Tensor,
                                                                                      torch.Tensor]:
    """(w [B,K+1], h [B,K]): the prefix weights w_0..w_K and the thresholds h_1..h_K (module
    docstring).

    p [B,K+1,V] target probabilities at the verify positions, q [B,K,V] the draft probabilities the
    drafts [B,K] were sampled from. Computed in p's dtype."""
    B, K = drafts.shape
    pd = p[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qd = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1).to(p.dtype)
    # a sampled draft has q > 0; the clamp only keeps a forced draft with q = 0 finite
    ratio = pd / qd.clamp(min=torch.finfo(p.dtype).tiny)
    # a NaN probability (a diverged model) passes no test, as in token-wise verification: it
    # passed the clamps below as NaN, whose threshold fell to the den == 0 branch's 1, and every
    # round accepted K - 1 drafts whatever the distributions
    ratio = torch.where(torch.isfinite(ratio), ratio, 0.0)
    w = [torch.ones(B, dtype=p.dtype, device=p.device)]
    for i in range(K):  # K is a handful: a loop over positions, vectorised over the batch
        w.append(torch.clamp(w[-1] * ratio[:, i], max=1.0))
    w = torch.stack(w, 1)
    h = torch.empty(B, K, dtype=p.dtype, device=p.device)
    if K > 1:
        wi = w[:, 1:K]
        r = (wi.unsqueeze(-1) * p[:, 1:K] - q[:, 1:K].to(p.dtype)).clamp(min=0.0).sum(-1)
        den = r + (1.0 - wi)
        # 1 only where den is exactly 0 (w_i = 1 and no residual), 0 where it is NaN
        h[:, : K - 1] = torch.where(den > 0, r / den.clamp(min=torch.finfo(p.dtype).tiny),
                                    (den == 0).to(p.dtype))
    h[:, K - 1] = w[:, K]
    return w, h


def block_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor):
    """Block verification; the same contract as sampling.speculative_accept.

    p [B,K+1,V] target probabilities at the verify positions, q [B,K,V] the draft probabilities the
    drafts [B,K] were sampled from, u [B,K] uniforms in [0, 1). Returns (tau [B] accepted drafts,
    dist [B,V] to sample the next token from: P_K when all K were accepted, else the block residual
    norm(max(w_tau P_tau - Q_tau, 0)); P_tau in the measure-zero case of an empty residual)."""
    B, K = drafts.shape
    V = p.shape[-1]
    w, h = block_thresholds(p, q, drafts)
    steps = torch.arange(1, K + 1, device=drafts.device)
    # the last position that passes, 0 if none
    tau = torch.where(u.to(h.dtype) < h, steps, 0).amax(1)
    p_t = p.gather(1, tau.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    q_t = q.gather(1, tau.clamp(max=K - 1).view(B, 1, 1).expand(B, 1, V)).squeeze(1).to(p.dtype)
    w_t = w.gather(1, tau.view(B, 1))
    resid = (w_t * p_t - q_t).clamp(min=0.0)
    total = resid.sum(-1, keepdim=True)
    use_resid = (tau < K).unsqueeze(-1) & (total > 0)
    dist = torch.where(use_resid, resid / total.clamp(min=torch.finfo(p.dtype).tiny), p_t)
    return tau, dist
