"""Speculative decoding with the model's own MTP module: draft K tokens, verify in one trunk
forward.

A round (per row b, vectorised over the batch): the drafter (eval/drafting.py: the `Drafter`
protocol, conventions `serving` and `tandem`) yields each depth's draft logits after the committed
tokens x_0..x_m, and the decoder chooses d_1..d_K from them; verify runs the trunk over
[x_m, d_1..d_K] at positions m..m+K; the longest draft prefix the trunk agrees with is accepted,
plus the trunk's bonus token. Rolling back is only lowering m: KV rows beyond it are rewritten
before any query reads them (attention masks keys by position, and every forward covers a
contiguous range that starts right after the valid prefix). What the decoder and its drafter share
-- the committed tokens, the trunk's hidden states and the host-side length bounds that size every
forward without reading the device back -- is eval/decode_batch.py's `DecodeBatch`; `generate`
makes the bounds exact with the loop's one host read per round (`read_lengths`, together with its
"any row still active" flag).

With temperature > 0 drafts are sampled from q (the MTP distribution) and verified with the standard
speculative-sampling rule (accept with min(1, p/q), on rejection resample from norm(max(p - q, 0)),
bonus from p), temperature and top-p applied identically to p and q (eval/sampling.py), so the
output is distributed exactly as sampling from the trunk alone. `verify="block"` verifies the K
drafts as one block instead (eval/block_verify.py: Sun et al. 2024's block verification, also exact
and accepting at least as many drafts on average); at temperature 0 both rules are greedy
exact-match acceptance. The acceptance figures of a decode are eval/acceptance.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from tandem.models.attention import KVCache

from .block_verify import VERIFY_RULES, block_accept
from .decode_batch import DecodeBatch
from .drafting import make_drafter, resolve_convention
from .sampling import TokenChooser, greedy_tokens, speculative_accept


def unwrap(model: nn.Module) -> nn.Module:
    """The TandemModel behind a wrapper (DDP-style `.module`), or the model itself."""
    while not hasattr(model, "mtp_step") and hasattr(model, "module"):
        model = model.module
    return model


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing); a no-op on CPU."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


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
    """[B] every draft the trunk accepted, also past max_new_tokens or EOS in a row's last round:
    what vLLM's scheduler counts (`accepted` is budget-exact)."""
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


def non_finite_weights(model: nn.Module) -> Optional[str]:
    """The first parameter or buffer holding a NaN or an infinity, as "NAME (N of M values)", None
    when every one is finite. A decode cannot tell such a model from a good one: the argmax of an
    all-NaN row is token 0 for the drafts and the trunk alike, so it reports a high acceptance."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return f"{name} ({bad} of {t.numel()} values)"
    return None


def draft_steps_problem(num_steps: int, mtp_cfg) -> Optional[str]:
    """Why a model with MTP config `mtp_cfg` cannot draft `num_steps` tokens a round (None when it
    can): known from the config, so a caller can refuse before the weights load."""
    if num_steps <= 0:
        return None
    if not mtp_cfg.num_steps:
        return "speculative decoding needs an MTP module (mtp.num_steps > 0)"
    if mtp_cfg.style != "looped" and num_steps > mtp_cfg.num_layers:
        return (f"num_steps={num_steps} exceeds the {mtp_cfg.num_layers} independent heads of the "
                "parallel-style MTP module (only the looped style can run longer than it was "
                "trained)")
    return None


def _check_model(model: nn.Module, num_steps: int) -> None:
    problem = draft_steps_problem(num_steps, model.mtp_cfg)
    if problem:
        raise ValueError(problem)


def prompt_limit(max_seq_len: int, max_new_tokens: int, num_steps: int) -> int:
    """Most prompt tokens that fit: SpecDecoder's caches need prompt + max_new_tokens + 4K + 5
    positions (its margin below, plus the K tokens a last round may draft past the budget)."""
    return max_seq_len - max_new_tokens - 4 * num_steps - 5


class SpecDecoder:
    """Caches and per-row state for decoding one batch (num_steps=0 is plain autoregressive): the
    trunk's KV cache, the shared `batch` and the drafter of `draft_convention` (`serving`: as vLLM's
    proposer; `tandem`: as trained; eval/drafting.py)."""

    def __init__(self, model: nn.Module, num_steps: int, batch: int, max_positions: int, *,
                 temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None,
                 verify: str = "token", draft_convention: str = "serving", top_k: int = 0):
        self.model = m = unwrap(model)
        self.K = num_steps
        _check_model(m, num_steps)
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify={verify!r}: must be one of {', '.join(VERIFY_RULES)}")
        # sampled drafts: `token` (speculative_accept) or `block` (block_accept)
        self.verify_rule = verify
        self.chooser = TokenChooser(temperature, top_p, generator, top_k)
        # `tandem` where serving is undefined
        self.convention = resolve_convention(m, draft_convention, num_steps)
        # Margin: pad positions of a batched range may run up to ~2K past a row's end.
        cap = int(max_positions) + 3 * num_steps + 4
        if cap > m.cfg.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens + draft margin = {cap} positions exceeds "
                             f"model.max_seq_len={m.cfg.max_seq_len}")
        self.batch = b = DecodeBatch(m, num_steps, batch, cap)
        self.device = b.device
        self.trunk_cache = KVCache(m.cfg.num_layers, batch, cap, b.dtype, b.device, ring=b.ring)
        self.drafter = make_drafter(b, self.convention)

    @property
    def m(self) -> torch.Tensor:
        """[B] index of each row's newest committed token."""
        return self.batch.m

    @property
    def seq(self) -> torch.Tensor:
        """[B, positions] committed tokens (and the current round's drafts after them)."""
        return self.batch.seq

    def read_lengths(self, *flags: torch.Tensor) -> List[int]:
        """DecodeBatch.read_lengths: the loop's one host read per round."""
        return self.batch.read_lengths(*flags)

    def choose(self, logits: torch.Tensor):
        """(token [B], probs [B,V] or None) from logits [B,V]: the trunk's first token and every
        draft."""
        return self.chooser.choose(logits)

    # --- phases -----------------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]],
                first_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the trunk over the prompts; commit the first generated token (or `first_tokens`)."""
        b = self.batch
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        # from the host's list: lens.max() would read the device back
        n = max(len(p) for p in prompts)
        tokens = torch.zeros(b.B, n, dtype=torch.long, device=self.device)
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        pos = b.arange[:n].unsqueeze(0).expand(b.B, n)
        # shorter prompts are padded: their state ends at their last token
        self.trunk_cache.row_end = lens - 1
        self.trunk_cache.span = n
        h = self.model.trunk(tokens, pos, self.trunk_cache)
        self.trunk_cache.row_end = None
        b.hidden[:, :n] = h
        last = h.gather(1, (lens - 1).view(-1, 1, 1).expand(-1, 1, b.H))
        nxt, _ = self.choose(self.model.logits(0, last)[:, 0])
        if first_tokens is not None:
            nxt = first_tokens.to(self.device)
        b.seq[:, :n] = tokens
        b.seq.scatter_(1, lens.unsqueeze(1), nxt.unsqueeze(1))
        b.prefilled(lens, n)
        return nxt

    def draft(self, force: Optional[torch.Tensor] = None, keep_logits: bool = False):
        """Draft d_1..d_K after the committed tokens with the convention's drafter.

        `force` [B,K] replaces the drafted tokens (teacher forcing in tests). Returns (drafts [B,K],
        q [B,K,V] or None, list of per-depth logits [B,V] when keep_logits)."""
        b = self.batch
        m = b.m
        drafts, qs, all_logits = [], [], []
        for k, logits in enumerate(self.drafter.depth_logits(), 1):
            d, q = self.choose(logits)
            if force is not None:
                d = force[:, k - 1]
            b.seq.scatter_(1, (m + k).unsqueeze(1), d.unsqueeze(1))  # depth k + 1 reads it
            drafts.append(d)
            qs.append(q)
            if keep_logits:
                all_logits.append(logits)
        b.mark_drafted()
        q = None if self.chooser.greedy else torch.stack(qs, 1)
        return torch.stack(drafts, 1), q, all_logits

    def verify(self, drafts: torch.Tensor, q: Optional[torch.Tensor]):
        """One trunk forward over [x_m, d_1..d_K]; returns (accepted n [B], next token [B]). Greedy:
        the exact-match prefix; sampling: `self.verify_rule`'s acceptance (token-wise or block)."""
        b, K, chooser = self.batch, self.K, self.chooser
        pos = b.m.unsqueeze(1) + b.arange[: K + 1].unsqueeze(0)
        self.trunk_cache.span = b.span_to(b.m_hi + K)
        h = self.model.trunk(b.seq.gather(1, pos), pos, self.trunk_cache)
        b.hidden.scatter_(1, pos.unsqueeze(-1).expand_as(h), h.to(b.hidden.dtype))
        logits = self.model.logits(0, h)
        if chooser.greedy:
            a = greedy_tokens(logits)
            if K == 0:
                return torch.zeros_like(b.m), a[:, 0]
            n = (drafts == a[:, :K]).long().cumprod(1).sum(1)
            return n, a.gather(1, n.unsqueeze(1)).squeeze(1)
        p = chooser.probs(logits)
        if K == 0:
            return torch.zeros_like(b.m), chooser.sample(p[:, 0])
        u = torch.rand(drafts.shape, generator=chooser.generator, device=self.device)
        accept = block_accept if self.verify_rule == "block" else speculative_accept
        n, dist = accept(p, q, drafts, u)
        return n, chooser.sample(dist)

    def commit(self, n: torch.Tensor, nxt: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Commit n accepted drafts and the next token for active rows; returns the new m."""
        b = self.batch
        new_m = b.m + torch.where(active, n + 1, 0)
        keep = b.seq.gather(1, new_m.unsqueeze(1)).squeeze(1)
        b.seq.scatter_(1, new_m.unsqueeze(1), torch.where(active, nxt, keep).unsqueeze(1))
        b.committed(new_m)
        return new_m


StopIds = Union[int, Sequence[int], None]
"""The token ids that end a row: one EOS, several (a chat model's end-of-turn ids beside it, as
generation_config.json lists them), or None."""


def stop_tensor(eos_id: StopIds, device: torch.device) -> Optional[torch.Tensor]:
    """`eos_id` as a 1-d long tensor on `device` (None: no stop id)."""
    if eos_id is None:
        return None
    ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def emitted_tokens(old_m: torch.Tensor, new_m: torch.Tensor, limit: torch.Tensor,
                   new_tok: Optional[torch.Tensor] = None,
                   eos_id: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B] tokens a round adds to the outputs: of the new_m - old_m it committed (accepted drafts
    and the bonus), those up to the row's budget (m index `limit`) and up to its first EOS
    (`new_tok` [B,K+1] holds seq[old_m + 1 ..]; `eos_id` the `stop_tensor`). Drafts past either end
    are never seen by a user, so they are not counted as accepted."""
    out = torch.minimum(new_m - old_m, (limit - old_m).clamp(min=0))
    if eos_id is not None and new_tok is not None:
        window = torch.arange(1, new_tok.shape[1] + 1, device=new_tok.device)
        first_eos = torch.where(torch.isin(new_tok, eos_id), window,
                                new_tok.shape[1] + 1).min(1).values
        out = torch.minimum(out, first_eos)
    return out


class _Counts:
    """The decode loop's per-row acceptance counters, on the device until `stats`."""

    def __init__(self, batch: int, num_steps: int, device: torch.device):
        K = self.K = num_steps
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        self.rounds, self.accepted, self.accepted_all = zeros(batch), zeros(batch), zeros(batch)
        self.accepted_at, self.accepted_all_at = zeros(batch, max(K, 1)), zeros(batch, max(K, 1))
        self.pos_ids = torch.arange(1, K + 1, device=device)

    def add(self, active: torch.Tensor, n: torch.Tensor, emitted: torch.Tensor) -> None:
        """A round: `n` [B] drafts the trunk accepted, `emitted` [B] tokens it added to the
        outputs."""
        self.rounds += active
        if self.K == 0:
            return
        # budget-exact: a round counts the tokens it adds to the output, one of them closing it
        # (the bonus, or the last draft where the budget or an EOS cut the round), so acceptance
        # length = decoded tokens / rounds
        n_act = torch.where(active, (emitted - 1).clamp(min=0), 0)
        self.accepted += n_act
        self.accepted_at += (self.pos_ids.unsqueeze(0) <= n_act.unsqueeze(1))
        n_all = torch.where(active, n, 0)  # vLLM's count: every accepted draft of the round
        self.accepted_all += n_all
        self.accepted_all_at += (self.pos_ids.unsqueeze(0) <= n_all.unsqueeze(1))

    def stats(self) -> DecodeStats:
        K = self.K
        return DecodeStats(self.rounds.cpu(), self.accepted.cpu(), self.accepted_at[:, :K].cpu(), K,
                           accepted_all=self.accepted_all.cpu(),
                           accepted_all_at=self.accepted_all_at[:, :K].cpu())


def _finished(old_m, new_m, limit, new_tok, eos_id, window) -> torch.Tensor:
    """[B] rows that reached their budget or committed an EOS this round."""
    done = new_m >= limit
    if eos_id is not None:
        fresh = window.unsqueeze(0) <= (new_m - old_m).unsqueeze(1)
        done |= (torch.isin(new_tok, eos_id) & fresh).any(1)
    return done


def _decode_rounds(dec: SpecDecoder, active: torch.Tensor, limit: torch.Tensor,
                   eos_id: Optional[torch.Tensor],
                   counts: _Counts, any_active: Callable[[bool], bool]) -> dict:
    """Draft, verify and commit until no row (of any process in lockstep) is active; returns the
    phase times (`draft_s`, `verify_s`, `overhead_s`) and `num_rounds`."""
    K, dev = dec.K, dec.device
    window = torch.arange(1, K + 2, device=dev)
    times = {"draft_s": 0.0, "verify_s": 0.0, "overhead_s": 0.0, "num_rounds": 0}
    # the round's one host read: whether a row is still active, with the lengths that size its
    # forwards
    while any_active(bool(dec.read_lengths(active.any())[0])):
        ta = time.perf_counter()
        drafts, q, _ = dec.draft() if K > 0 else (None, None, None)
        synchronize(dev)
        tb = time.perf_counter()
        n, nxt = dec.verify(drafts, q)
        synchronize(dev)
        tc = time.perf_counter()
        old_m = dec.m
        new_m = dec.commit(n, nxt, active)
        new_tok = dec.seq.gather(1, old_m.unsqueeze(1) + window) if eos_id is not None else None
        counts.add(active, n, emitted_tokens(old_m, new_m, limit, new_tok, eos_id))
        active = active & ~_finished(old_m, new_m, limit, new_tok, eos_id, window)
        synchronize(dev)
        td = time.perf_counter()
        times["draft_s"] += tb - ta
        times["verify_s"] += tc - tb
        times["overhead_s"] += td - tc
        times["num_rounds"] += 1
    return times


def _outputs(dec: SpecDecoder, lens: List[int], max_new_tokens: int,
             eos_id: Optional[torch.Tensor]) -> List[List[int]]:
    """Each row's continuation: at most max_new_tokens, up to and including its first stop id."""
    seq, m = dec.seq.cpu(), dec.m.cpu()
    stops = set(eos_id.tolist()) if eos_id is not None else set()
    outputs = []
    for b in range(len(lens)):
        out = seq[b, lens[b] : int(m[b]) + 1].tolist()[:max_new_tokens]
        ends = [i for i, t in enumerate(out) if t in stops]
        outputs.append(out[: ends[0] + 1] if ends else out)
    return outputs


@torch.inference_mode()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             num_steps: int, *,
             eos_id: StopIds = None, temperature: float = 0.0, top_p: float = 1.0,
             generator: Optional[torch.Generator] = None, padding: bool = False,
             verify: str = "token",
             any_active: Optional[Callable[[bool], bool]] = None,
             draft_convention: str = "serving", top_k: int = 0) -> DecodeResult:
    """Decode a batch of prompts: speculative with K=num_steps MTP drafts, or plain AR when 0.
    `verify` is the rule for sampled drafts (`token` or `block`; greedy decoding is the same under
    both); `draft_convention` how depths 2..K draft (`serving`: as vLLM's proposer; `tandem`: as
    trained); `top_k` > 0 samples from each head's k largest logits (`TokenChooser`); `eos_id`
    the id or ids that end a row.

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
    dec = SpecDecoder(model, K, B, max(lens) + max_new_tokens + K + 1, temperature=temperature,
                      top_p=top_p, top_k=top_k, generator=generator, verify=verify,
                      draft_convention=draft_convention)
    dev = dec.device
    eos_id = stop_tensor(eos_id, dev)
    # m at max_new_tokens
    limit = torch.tensor(lens, dtype=torch.long, device=dev) + max_new_tokens - 1
    synchronize(dev)
    t0 = time.perf_counter()
    first = dec.prefill(prompts)
    active = dec.m < limit
    if eos_id is not None:
        active &= ~torch.isin(first, eos_id)
    if padding:
        active &= False
    counts = _Counts(B, K, dev)
    synchronize(dev)
    t1 = time.perf_counter()
    times = _decode_rounds(dec, active, limit, eos_id, counts, any_active or (lambda local: local))
    t2 = time.perf_counter()
    stats = counts.stats()
    stats.prefill_s, stats.decode_s = t1 - t0, t2 - t1
    for name, value in times.items():
        setattr(stats, name, value)
    outputs = _outputs(dec, lens, max_new_tokens, eos_id)
    return DecodeResult(outputs, stats, sum(max(len(o) - 1, 0) for o in outputs))
