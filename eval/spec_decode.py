"""Speculative decoding with the model's own MTP module: draft K tokens, verify in one trunk forward.

State of a batch of sequences (per row b; all index arithmetic is per row, vectorised over the batch):

* committed tokens x_0..x_m live in `seq[b, :m+1]`; x_m is the newest (the bonus of the last verify);
* the trunk KV cache holds positions 0..m-1 and `h[0][b, t]` (trunk pre-norm hidden) is valid for t <= m-1;
* MTP depth k has its own one-layer KV cache (physical layer weights are shared when L < K, caches are
  not) and its own hidden store `h[k]`, valid (computed from committed inputs only) up to `valid[k]`.

A round: for k = 1..K, run `mtp_step(k)` over the contiguous positions [valid[k]+1, m-1] with inputs
h_{k-1} (h_0 for the parallel style) and tokens seq[t + k] (committed tokens, then this round's
drafts), draft d_k from the last of them, then set valid[k] = m - k. Verify runs the trunk over
[x_m, d_1..d_K] at positions m..m+K; the longest draft prefix the trunk agrees with is accepted, plus
the trunk's bonus token. Rolling back is only lowering m: KV rows beyond it are rewritten before any
query reads them (attention masks keys by position, and every forward covers a contiguous range that
starts right after the valid prefix). Rows of a batched range are padded to the longest row with
positions continuing past the row's end; their outputs are ignored and rewritten later.

Host syncs: the lengths that size a forward (how many positions a draft range covers, how far the
caches' key prefix reaches: `DecodeCache.span`) are host integers, upper bounds the decoder keeps
from what it launched (`m_hi`, `advance_hi`), so drafting and verifying never read the device back.
`generate` makes them exact with the loop's one host read per round (`read_lengths`, together with
its "any row still active" flag); a looser bound only pads a range or a key prefix with positions
whose outputs are ignored or masked.

With temperature > 0 drafts are sampled from q (the MTP distribution) and verified with the standard
speculative-sampling rule (accept with min(1, p/q), on rejection resample from norm(max(p - q, 0)),
bonus from p), temperature and top-p applied identically to p and q, so the output is distributed
exactly as sampling from the trunk alone. `verify="block"` verifies the K drafts as one block instead
(eval/block_verify.py: Sun et al. 2024's block verification, also exact and accepting at least as
many drafts on average); at temperature 0 both rules are greedy exact-match acceptance.

Drafting conventions (`draft_convention`, `eval.draft_convention`): `serving` (the default) drafts
depths 2..K as vLLM's MTP proposer does -- one MTP cache shared by the depths, depth k one token at
position m + k - 2 (eval/draft_serving.py) -- so the acceptance is the served figure; `tandem` is the
per-depth scheme above, each depth drafting exactly as it was trained. Both are exact (the trunk
verifies): only the drafts, and so the acceptance, differ.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from tandem.models.attention import KVCache

from .block_verify import VERIFY_RULES, block_accept
from .draft_serving import ServingDrafter, resolve_convention


def unwrap(model: nn.Module) -> nn.Module:
    """The TandemModel behind a wrapper (DDP-style `.module`), or the model itself."""
    while not hasattr(model, "mtp_step") and hasattr(model, "module"):
        model = model.module
    return model


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing); a no-op on CPU."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Softmax(logits / T) restricted to the top-p nucleus and renormalised (fp32)."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = p.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor):
    """The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023).

    p [B,K+1,V] target probabilities at the verify positions, q [B,K,V] the draft probabilities the
    drafts [B,K] were sampled from, u [B,K] uniforms. Draft i is accepted with min(1, p/q) while all
    before it were. Returns (n [B] accepted drafts, dist [B,V] to sample the next token from: the
    residual norm(max(p_n - q_n, 0)) after a rejection, p_K after all K were accepted).
    """
    k = drafts.shape[1]
    pd = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qd = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accept = u * qd < pd
    n = accept.long().cumprod(1).sum(1)
    p_n = p.gather(1, n.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)
    q_n = q.gather(1, n.clamp(max=k - 1).view(-1, 1, 1).expand(-1, 1, q.shape[-1])).squeeze(1)
    resid = (p_n - q_n).clamp(min=0.0)
    total = resid.sum(-1, keepdim=True)
    use_resid = (n < k).unsqueeze(-1) & (total > 0)
    dist = torch.where(use_resid, resid / total.clamp(min=1e-30), p_n)
    return n, dist


@dataclass
class DecodeStats:
    """Per-row acceptance counts and the measured phase times of one decode call."""

    rounds: torch.Tensor
    """[B] verify rounds (forwards after prefill) each row took part in."""
    accepted: torch.Tensor
    """[B] accepted drafts per row."""
    accepted_at: torch.Tensor
    """[B,K] how often draft position i (0-based) was accepted."""
    num_steps: int
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    """Wall time of the decode loop after prefill."""
    num_rounds: int = 0
    """Batched rounds (one verify forward each)."""
    accepted_all: Optional[torch.Tensor] = None
    """[B] every draft the trunk accepted, also past max_new_tokens or EOS in a row's last round: what
    vLLM's scheduler counts (`accepted` is budget-exact)."""
    accepted_all_at: Optional[torch.Tensor] = None
    """[B,K] the same per draft position."""


@dataclass
class DecodeResult:
    outputs: List[List[int]]
    """Generated continuation of each prompt (first EOS kept, at most max_new_tokens)."""
    stats: DecodeStats
    decoded_tokens: int = 0
    """Tokens produced by the decode loop (outputs minus the one prefill token per row)."""

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / max(self.stats.decode_s, 1e-12)


class SpecDecoder:
    """Caches and per-row state for decoding one batch (num_steps=0 is plain autoregressive)."""

    def __init__(self, model: nn.Module, num_steps: int, batch: int, max_positions: int, *,
                 temperature: float = 0.0, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
                 verify: str = "token", draft_convention: str = "serving"):
        self.model = m = unwrap(model)
        self.K = num_steps
        if num_steps > 0 and m.mtp is None:
            raise ValueError("speculative decoding needs an MTP module (mtp.num_steps > 0)")
        if num_steps > 0 and not m.mtp.chained and num_steps > len(m.mtp.layers):
            raise ValueError(f"num_steps={num_steps} exceeds the {len(m.mtp.layers)} independent heads of the "
                             "parallel-style MTP module (only the looped style can run longer than it was trained)")
        self.temperature, self.top_p = float(temperature), float(top_p)
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify={verify!r}: must be one of {', '.join(VERIFY_RULES)}")
        self.verify_rule = verify  # sampled drafts: `token` (speculative_accept) or `block` (block_accept)
        self.convention = resolve_convention(m, draft_convention, num_steps)  # `tandem` where serving is undefined
        self.generator = generator
        p0 = m.embed_tokens.weight
        self.device, self.dtype = p0.device, p0.dtype
        cfg = m.cfg
        # Margin: pad positions of a batched range may run up to ~2K past a row's end.
        self.cap = int(max_positions) + 3 * num_steps + 4
        if self.cap > cfg.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens + draft margin = {self.cap} positions exceeds "
                             f"model.max_seq_len={cfg.max_seq_len}")
        B, H = batch, cfg.hidden_size * cfg.hc_count  # the hidden state handed on: every residual stream
        self.B, self.H = B, H
        # Recurrent layers (Gated DeltaNet, PLE) keep their state in rings indexed by position: a ring must
        # outlast a verify forward (K+1 tokens), a batched range's padding (~2K) and the widest
        # convolution window (PLE's dilated one), so any accepted prefix can be resumed from.
        self.ring = 4 * num_steps + 32
        self.trunk_cache = KVCache(cfg.num_layers, B, self.cap, self.dtype, self.device, ring=self.ring)
        self.mtp_shared = {}
        per_depth = num_steps > 0 and self.convention == "tandem"
        n_hidden = (num_steps if m.mtp is not None and m.mtp.chained else 1) if per_depth else 1
        self.h = [torch.zeros(B, self.cap, H, dtype=self.dtype, device=self.device) for _ in range(max(n_hidden, 1))]
        self.mtp_caches = []
        for _ in range(num_steps if per_depth else 0):  # one cache per depth: depths share layer weights, not states
            # ... but they share the store of QSA index reuse (depth 1's selection, read by depths 2..K)
            self.mtp_caches.append(KVCache(1, B, self.cap, self.dtype, self.device, shared=self.mtp_shared).layer(0))
        self.seq = torch.zeros(B, self.cap + num_steps + 2, dtype=torch.long, device=self.device)
        self.m = torch.zeros(B, dtype=torch.long, device=self.device)
        self.valid = torch.full((num_steps + 1, B), -1, dtype=torch.long, device=self.device)
        self.arange = torch.arange(self.cap, device=self.device)
        self.ar_k1 = self.arange[: num_steps + 1].unsqueeze(0)
        self.chained = m.mtp.chained if m.mtp is not None else True
        self.serving = ServingDrafter(self) if num_steps > 0 and self.convention == "serving" else None
        self.m_hi = 0
        """Host-side upper bound of max(m) over the rows (exact after prefill and `read_lengths`)."""
        self.advance_hi = 0
        """Host-side upper bound of how far any row's m moved since the last draft (exact after `read_lengths`)."""
        self.drafted = False
        """Whether a draft ran since prefill (before it every depth starts at position 0)."""
        self.m_drafted = self.m
        """[B] m at the last draft."""

    # --- host-side lengths ---------------------------------------------------------------------------
    def read_lengths(self, *flags: torch.Tensor) -> List[int]:
        """The decode loop's one host read per round: exact `m_hi` and `advance_hi` for the next forwards,
        with the caller's scalar `flags` (returned as ints) in the same transfer."""
        vals = torch.stack([self.m.max(), (self.m - self.m_drafted).max(), *(f.long() for f in flags)]).tolist()
        self.m_hi, self.advance_hi = vals[0], vals[1]
        return vals[2:]

    def draft_length(self, k: int) -> int:
        """Positions depth k's draft forward covers (host int): the longest row's range
        [valid[k]+1, m-1], bounded from `m_hi` / `advance_hi` (the `tandem` convention's depth k is k-1
        positions behind depth 1; the serving convention runs depth 1 only over a range)."""
        if not self.drafted:
            return self.m_hi  # every depth starts at position 0
        behind = k - 1 if self.serving is None else 0
        return max(min(self.advance_hi + behind, self.m_hi), 1)

    def span_to(self, last: int) -> int:
        """`DecodeCache.span` for a forward whose largest position is at most `last` (host int)."""
        return min(last + 1, self.cap)

    def draft_span(self, length: int) -> int:
        """The span of a draft range of `length` positions starting at min(valid+1, m-1) (0 before the
        first draft)."""
        return self.span_to((self.m_hi - 1 if self.drafted else 0) + length - 1)

    def mark_drafted(self) -> None:
        """After a draft (either convention): every depth has caught up to the rows' m."""
        self.drafted, self.advance_hi, self.m_drafted = True, 0, self.m

    # --- token choice ------------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor):
        """(token [B], probs [B,V] or None) from logits [B,V]."""
        if self.temperature <= 0:
            return logits.argmax(-1), None
        probs = probs_from_logits(logits, self.temperature, self.top_p)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1), probs

    # --- phases ------------------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]], first_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the trunk over the prompts; commit the first generated token (or `first_tokens`)."""
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        n = max(len(p) for p in prompts)  # from the host's list: lens.max() would read the device back
        tokens = torch.zeros(self.B, n, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        pos = self.arange[:n].unsqueeze(0).expand(self.B, n)
        self.trunk_cache.row_end = lens - 1  # shorter prompts are padded: their state ends at their last token
        self.trunk_cache.span = n
        h = self.model.trunk(tokens, pos, self.trunk_cache)
        self.trunk_cache.row_end = None
        self.h[0][:, :n] = h
        last = h.gather(1, (lens - 1).view(-1, 1, 1).expand(-1, 1, self.H))
        nxt, _ = self._choose(self.model.logits(0, last)[:, 0])
        if first_tokens is not None:
            nxt = first_tokens.to(self.device)
        self.seq[:, :n] = tokens
        self.seq.scatter_(1, lens.unsqueeze(1), nxt.unsqueeze(1))
        self.m = lens.clone()
        self.m_hi, self.advance_hi, self.drafted, self.m_drafted = n, 0, False, self.m
        return nxt

    def draft(self, force: Optional[torch.Tensor] = None, keep_logits: bool = False):
        """Catch every depth up on committed tokens and draft d_1..d_K at position m-1 (the serving
        convention: eval/draft_serving.py).

        `force` [B,K] replaces the drafted tokens (teacher forcing in tests). Returns (drafts [B,K],
        q [B,K,V] or None, list of per-depth logits [B,V] when keep_logits)."""
        if self.serving is not None:
            return self.serving.draft(force, keep_logits)
        model, B, H, m = self.model, self.B, self.H, self.m
        drafts, qs, all_logits = [], [], []
        for k in range(1, self.K + 1):
            start = torch.minimum(self.valid[k] + 1, m - 1)
            r = m - start
            R = self.draft_length(k)  # a host bound: int(r.max()) would stall every depth
            pos = (start.unsqueeze(1) + self.arange[:R]).clamp_(max=self.cap - 1)
            idx = pos.unsqueeze(-1).expand(B, R, H)
            src = self.h[k - 1] if self.chained else self.h[0]
            self.mtp_caches[k - 1].cache.span = self.draft_span(R)
            out = model.mtp_step(k, src.gather(1, idx), self.seq.gather(1, pos + k), pos, self.mtp_caches[k - 1])
            if self.chained and k < self.K:
                self.h[k].scatter_(1, idx, out.to(self.h[k].dtype))  # bf16 under autocast
            last = out.gather(1, (r - 1).view(B, 1, 1).expand(B, 1, H))
            logits = model.logits(k, last)[:, 0]
            d, q = self._choose(logits)
            if force is not None:
                d = force[:, k - 1]
            self.seq.scatter_(1, (m + k).unsqueeze(1), d.unsqueeze(1))
            drafts.append(d)
            qs.append(q)
            if keep_logits:
                all_logits.append(logits)
        self.valid[1:] = (m.unsqueeze(0) - self.arange[1 : self.K + 1].unsqueeze(1)).clamp_(min=-1)
        self.mark_drafted()
        q = torch.stack(qs, 1) if self.temperature > 0 else None
        return torch.stack(drafts, 1), q, all_logits

    def verify(self, drafts: torch.Tensor, q: Optional[torch.Tensor]):
        """One trunk forward over [x_m, d_1..d_K]; returns (accepted n [B], next token [B]). Greedy: the
        exact-match prefix; sampling: `self.verify_rule`'s acceptance (token-wise or block)."""
        pos = self.m.unsqueeze(1) + self.ar_k1
        self.trunk_cache.span = self.span_to(self.m_hi + self.K)
        h = self.model.trunk(self.seq.gather(1, pos), pos, self.trunk_cache)
        self.h[0].scatter_(1, pos.unsqueeze(-1).expand_as(h), h.to(self.h[0].dtype))
        logits = self.model.logits(0, h)
        K = self.K
        if self.temperature <= 0:
            a = logits.argmax(-1)
            if K == 0:
                return torch.zeros_like(self.m), a[:, 0]
            n = (drafts == a[:, :K]).long().cumprod(1).sum(1)
            return n, a.gather(1, n.unsqueeze(1)).squeeze(1)
        p = probs_from_logits(logits, self.temperature, self.top_p)
        if K == 0:
            return torch.zeros_like(self.m), torch.multinomial(p[:, 0], 1, generator=self.generator).squeeze(-1)
        u = torch.rand(drafts.shape, generator=self.generator, device=self.device)
        accept = block_accept if self.verify_rule == "block" else speculative_accept
        n, dist = accept(p, q, drafts, u)
        return n, torch.multinomial(dist, 1, generator=self.generator).squeeze(-1)

    def commit(self, n: torch.Tensor, nxt: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Commit n accepted drafts and the next token for active rows; returns the new m."""
        step = torch.where(active, n + 1, 0)
        new_m = self.m + step
        keep = self.seq.gather(1, new_m.unsqueeze(1)).squeeze(1)
        self.seq.scatter_(1, new_m.unsqueeze(1), torch.where(active, nxt, keep).unsqueeze(1))
        self.m = new_m
        self.m_hi = min(self.m_hi + self.K + 1, self.cap)  # bounds until the next read_lengths
        self.advance_hi += self.K + 1
        return new_m


def emitted_tokens(old_m: torch.Tensor, new_m: torch.Tensor, limit: torch.Tensor,
                   new_tok: Optional[torch.Tensor] = None, eos_id: Optional[int] = None) -> torch.Tensor:
    """[B] tokens a round adds to the outputs: of the new_m - old_m it committed (accepted drafts and
    the bonus), those up to the row's budget (m index `limit`) and up to its first EOS (`new_tok`
    [B,K+1] holds seq[old_m + 1 ..]). Drafts past either end are never seen by a user, so they are
    not counted as accepted."""
    out = torch.minimum(new_m - old_m, (limit - old_m).clamp(min=0))
    if eos_id is not None and new_tok is not None:
        window = torch.arange(1, new_tok.shape[1] + 1, device=new_tok.device)
        first_eos = torch.where(new_tok == eos_id, window, new_tok.shape[1] + 1).min(1).values
        out = torch.minimum(out, first_eos)
    return out


@torch.inference_mode()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, num_steps: int, *,
             eos_id: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
             generator: Optional[torch.Generator] = None, padding: bool = False, verify: str = "token",
             any_active: Optional[Callable[[bool], bool]] = None, draft_convention: str = "serving") -> DecodeResult:
    """Decode a batch of prompts: speculative with K=num_steps MTP drafts, or plain AR when 0.
    `verify` is the rule for sampled drafts (`token` or `block`; greedy decoding is the same under both);
    `draft_convention` how depths 2..K draft (`serving`: as vLLM's proposer; `tandem`: as trained).

    Lockstep with other processes (expert-parallel all-to-alls, FSDP gathers): `any_active(local)`
    returns whether any process still has an active row, and the loop runs until none has (rows
    that finished only ride along); `padding=True` marks a batch whose rows are all inactive (a
    process with no prompts left keeps the others company)."""
    B, K = len(prompts), num_steps
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    dec = SpecDecoder(model, K, B, max(lens) + max_new_tokens + K + 1, temperature=temperature, top_p=top_p,
                      generator=generator, verify=verify, draft_convention=draft_convention)
    dev = dec.device
    stats = DecodeStats(torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                        torch.zeros(B, max(K, 1), dtype=torch.long), K)
    n0 = torch.tensor(lens, dtype=torch.long, device=dev)
    limit = n0 + max_new_tokens - 1  # m at which a row has produced max_new_tokens
    synchronize(dev)
    t0 = time.perf_counter()
    first = dec.prefill(prompts)
    active = dec.m < limit
    if eos_id is not None:
        active &= first != eos_id
    if padding:
        active &= False
    any_active = any_active or (lambda local: local)
    rounds = torch.zeros(B, dtype=torch.long, device=dev)
    accepted = torch.zeros(B, dtype=torch.long, device=dev)
    accepted_at = torch.zeros(B, max(K, 1), dtype=torch.long, device=dev)
    accepted_all = torch.zeros(B, dtype=torch.long, device=dev)
    accepted_all_at = torch.zeros(B, max(K, 1), dtype=torch.long, device=dev)
    pos_ids = torch.arange(1, K + 1, device=dev)
    window = torch.arange(1, K + 2, device=dev)
    synchronize(dev)
    t1 = time.perf_counter()
    stats.prefill_s = t1 - t0
    draft_s = verify_s = over_s = 0.0
    num_rounds = 0
    # the round's one host read: whether a row is still active, with the lengths that size its forwards
    while any_active(bool(dec.read_lengths(active.any())[0])):
        ta = time.perf_counter()
        if K > 0:
            drafts, q, _ = dec.draft()
        else:
            drafts, q = None, None
        synchronize(dev)
        tb = time.perf_counter()
        n, nxt = dec.verify(drafts, q)
        synchronize(dev)
        tc = time.perf_counter()
        old_m = dec.m
        new_m = dec.commit(n, nxt, active)
        rounds += active
        new_tok = dec.seq.gather(1, old_m.unsqueeze(1) + window) if eos_id is not None else None
        emitted = emitted_tokens(old_m, new_m, limit, new_tok, eos_id)
        if K > 0:
            # budget-exact: only drafts that reach the output count (1 + accepted = tokens emitted)
            n_act = torch.where(active, (emitted - 1).clamp(min=0), 0)
            accepted += n_act
            accepted_at += (pos_ids.unsqueeze(0) <= n_act.unsqueeze(1))
            n_all = torch.where(active, n, 0)  # vLLM's count: every accepted draft of the round
            accepted_all += n_all
            accepted_all_at += (pos_ids.unsqueeze(0) <= n_all.unsqueeze(1))
        done = new_m >= limit
        if eos_id is not None:
            fresh = window.unsqueeze(0) <= (new_m - old_m).unsqueeze(1)
            done |= ((new_tok == eos_id) & fresh).any(1)
        active = active & ~done
        synchronize(dev)
        td = time.perf_counter()
        draft_s += tb - ta
        verify_s += tc - tb
        over_s += td - tc
        num_rounds += 1
    t2 = time.perf_counter()
    stats.draft_s, stats.verify_s, stats.overhead_s = draft_s, verify_s, over_s
    stats.decode_s, stats.num_rounds = t2 - t1, num_rounds
    stats.rounds, stats.accepted, stats.accepted_at = rounds.cpu(), accepted.cpu(), accepted_at[:, :K].cpu()
    stats.accepted_all, stats.accepted_all_at = accepted_all.cpu(), accepted_all_at[:, :K].cpu()
    seq, m = dec.seq.cpu(), dec.m.cpu()
    outputs = []
    for b in range(B):
        out = seq[b, lens[b] : int(m[b]) + 1].tolist()[:max_new_tokens]
        if eos_id is not None and eos_id in out:
            out = out[: out.index(eos_id) + 1]
        outputs.append(out)
    decoded = sum(max(len(o) - 1, 0) for o in outputs)
    return DecodeResult(outputs, stats, decoded)


INTERVAL_RESAMPLES = 2000
"""Bootstrap resamples behind each 95% interval (`acceptance_intervals`)."""
INTERVAL_SEED = 0
"""Seed of the resampling generator: the same rows give the same interval in every run and layout."""


def _row_counts(stats: DecodeStats) -> torch.Tensor:
    """[B, 2+K] float64 per-row counts: rounds, accepted, accepted at positions 1..K."""
    K = stats.num_steps
    cols = [stats.rounds.view(-1, 1), stats.accepted.view(-1, 1), stats.accepted_at[:, :K]]
    return torch.cat([c.to("cpu", torch.float64) for c in cols], 1)


def _ratio_figures(sums: torch.Tensor, K: int) -> dict:
    """The acceptance figures from summed counts `sums` [..., 2+K] (as `_row_counts` orders them),
    each a tensor of the leading shape: one formula for the point estimate and every resample."""
    drafts, acc = sums[..., 0], sums[..., 1]
    out = {"acceptance_length": 1.0 + acc / drafts.clamp(min=1),
           "draft_acceptance_rate": acc / (drafts * K).clamp(min=1)}
    for i in range(K):
        out[f"accept_rate/pos_{i + 1}"] = sums[..., 2 + i] / drafts.clamp(min=1)
    return out


def _expanded_levels(n: int, level: float = 0.95) -> tuple:
    """The quantiles (lo, hi) of the bootstrap distribution that give a `level` interval from n rows.

    A plain percentile interval is too narrow for few prompts: the bootstrap spread divides by n where
    the unbiased variance divides by n - 1, and it uses normal quantiles where Student's t applies.
    Hesterberg's expanded percentile interval reads the percentiles at the normal tail whose quantile
    is sqrt(n / (n - 1)) * t_{n-1}; it tends to the plain percentiles as n grows. t_{n-1} comes from
    the Cornish-Fisher series (Abramowitz & Stegun 26.7.5), close to exact from 3 degrees of freedom
    on; below that the tail is near 0 either way and the interval spans the resamples' range."""
    if n < 2:
        return 0.0, 1.0
    normal = NormalDist()
    z, v = normal.inv_cdf(0.5 + level / 2), n - 1
    t = (z + (z ** 3 + z) / 4 / v + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96 / v ** 2
         + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384 / v ** 3
         + (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160 / v ** 4)
    tail = normal.cdf(-math.sqrt(n / v) * t)
    return tail, 1.0 - tail


def acceptance_intervals(stats: DecodeStats, resamples: int = INTERVAL_RESAMPLES,
                         seed: int = INTERVAL_SEED) -> dict:
    """95% percentile-bootstrap interval of each `acceptance_metrics` figure, as `<key>_lo95` and
    `<key>_hi95`, its percentiles read at the expanded levels of `_expanded_levels`.

    The unit resampled is the row (one prompt): rows are drawn with replacement and each figure is
    recomputed as the ratio of the resample's summed counts, as the point estimate is. Rounds within a
    prompt share its text and are correlated, so resampling rounds would understate the width. Under
    data parallelism `stats` must hold every replica's rows (evaluate_decoding gathers them in batch
    order), so the interval equals one process's. The generator is private and fixed-seed: the global
    RNG is untouched and a rerun reproduces the interval."""
    counts = _row_counts(stats)
    n, K = counts.shape[0], stats.num_steps
    if n == 0:
        return {}
    g = torch.Generator().manual_seed(seed)
    chunk = max(1, (1 << 22) // n)  # bounds the [chunk, n] weight matrix when there are many prompts
    parts = []
    for start in range(0, resamples, chunk):
        r = min(chunk, resamples - start)
        idx = torch.randint(n, (r, n), generator=g)
        # how often each row is drawn in each resample; the resample's sums are then one matmul
        weights = torch.zeros(r, n, dtype=torch.float64).scatter_add_(1, idx, torch.ones(r, n, dtype=torch.float64))
        parts.append(weights @ counts)
    figures = _ratio_figures(torch.cat(parts), K)
    q = torch.tensor(_expanded_levels(n), dtype=torch.float64)
    out = {}
    for key, values in figures.items():
        lo, hi = torch.quantile(values, q).tolist()
        out[f"{key}_lo95"], out[f"{key}_hi95"] = lo, hi
    return out


def acceptance_metrics(stats: DecodeStats) -> dict:
    """vLLM definitions: mean acceptance length = 1 + accepted / drafts (draft = one K-token round of
    one sequence; includes the bonus token), per-position rate = accepted at position i / drafts,
    draft acceptance rate = accepted / drafted tokens. Accepted counts are budget-exact (drafts past
    max_new_tokens or EOS do not count), so acceptance length = decoded tokens / rounds. Each figure
    is followed by its 95% interval over prompts (`acceptance_intervals`: `<key>_lo95`, `<key>_hi95`)."""
    point = _ratio_figures(_row_counts(stats).sum(0), stats.num_steps)
    intervals = acceptance_intervals(stats)
    out = {}
    for key, value in point.items():
        out[key] = float(value)
        if intervals:
            out[f"{key}_lo95"], out[f"{key}_hi95"] = intervals[f"{key}_lo95"], intervals[f"{key}_hi95"]
    return out


def row_metrics(stats: DecodeStats, b: int) -> dict:
    """One row's acceptance (budget-exact), plus `accepted_all` / `accepted_all_at` (every accepted
    draft, also past the budget: vLLM's counters) when the decode recorded them. No interval: one
    prompt is the bootstrap's unit, not something it can resample."""
    drafts, acc, K = int(stats.rounds[b]), int(stats.accepted[b]), stats.num_steps
    out = {"acceptance_length": 1.0 + acc / max(drafts, 1), "drafts": drafts, "accepted": acc,
           "draft_acceptance_rate": acc / max(drafts * K, 1)}
    for i in range(K):
        out[f"accept_rate/pos_{i + 1}"] = int(stats.accepted_at[b, i]) / max(drafts, 1)
    if stats.accepted_all is not None:
        out["accepted_all"] = int(stats.accepted_all[b])
        out["accepted_all_at"] = [int(x) for x in stats.accepted_all_at[b]]
    return out
