"""PLE: hashed n-gram memory injected into the hyper-connection streams (Qwen4-Exp).

Each token's preceding context is hashed into a huge embedding table: for every n-gram order n =
2..ngram_size and each of `heads_per_ngram` heads, the last n tokens are multiplied by fixed odd
per-layer constants, XOR-ed together, and reduced modulo that head's own prime table size. All heads
of a layer share one concatenated table (each head at its offset, the total padded to a multiple),
and the looked-up rows are concatenated into a `embed_dim` vector per token.

N-grams never reach across a document boundary: a context token at or before the last EOS strictly
before the current position reads as EOS, and the sequence start is padded with EOS. So the ids at a
position depend only on the ngram_size - 1 tokens before it, which is all decoding has to keep.

The n-gram vector gives one value (H wide) and one key per stream; each stream's normalised
activation queries its key, a signed-square-root sigmoid gate scales the value for that stream, and
a causal dilated depthwise conv (dilation ngram_size, zero-initialised) over the normalised gated
values adds local context. The result is added to the streams by the caller, before the block's
hyper-connection.

The hashing is a pure function (`ngram_ids`) separate from the table, so a sharded table can be put
around it and the ids can be checked for the real 20M base without allocating the table. (The real
tables are tens of GiB per layer; transformers shards `ngram_embedding` along its embedding dim,
Tandem splits its rows over every rank of the pipeline stage: trainer/parallel/tensor_hybrid.py.)

Decoding keeps two rings in the layer's DecodeCache slot (models/state.py): `ple_tokens` (the token
id at position p: the n-gram context; ngram_size - 1 slots beyond the cache's `ring`) and `ple_conv`
(the conv's normalised input at p; (conv_kernel - 1) * ngram_size slots beyond it), each entry in
slot p % (its ring's length).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .context import WholeWindow
from .documents import Documents, causal_conv_taps
from .layers import InitRule, InitScales, RMSNorm, draw_init

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64 bits)
_LAYER_STRIDE = 10007  # a prime separating the seeds of successive PLE layers


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int,
                      seed: int) -> List[int]:
    """One odd multiplier per n-gram slot, small enough that token * multiplier fits in int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base_seed = seed + _LAYER_STRIDE * ple_layer_index
    return [2 * (_splitmix64((base_seed + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
            for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (these bases are exact for n < 3.3e24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


_PRIMES_FROM: Dict[int, List[int]] = {}


def _primes_from(start: int, count: int) -> List[int]:
    """The first `count` primes >= start (cached: every PLE layer asks for a prefix of the same
    list)."""
    found = _PRIMES_FROM.setdefault(start, [])
    n = found[-1] + 1 if found else start
    while len(found) < count:
        while not _is_prime(n):
            n += 1
        found.append(n)
        n += 1
    return found[:count]


def ngram_tables(vocab_size: int, ngram_size: int, heads_per_ngram: int, ngram_vocab_base: int,
                 ngram_vocab_multiple: int, seed: int, ple_layer_index: int):
    """(multipliers, head vocab sizes, head offsets, padded table rows) of one PLE layer. Every head
    of every layer has its own prime size: the primes >= ngram_vocab_base, taken in order, layer by
    layer."""
    heads = (ngram_size - 1) * heads_per_ngram
    sizes = _primes_from(ngram_vocab_base, (ple_layer_index + 1) * heads)[-heads:]
    offsets = [sum(sizes[:i]) for i in range(heads)]
    padded = math.ceil(sum(sizes) / ngram_vocab_multiple) * ngram_vocab_multiple
    return layer_multipliers(vocab_size, ngram_size, ple_layer_index, seed), sizes, offsets, padded


def ngram_ids(token_history_bt: torch.Tensor, multipliers: torch.Tensor,
              head_vocab_sizes: torch.Tensor,
              head_offsets: torch.Tensor, heads_per_ngram: int, eos_token_id: int,
              doc_pos_bt: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Table rows [B, T, (ngram_size - 1) * heads_per_ngram] of every position of a token history.

    ngram_size = len(multipliers). Positions before the history's start, and context at or before
    the last EOS strictly before a position, read as EOS, so a history prefixed with the ngram_size
    - 1 tokens before it gives, at its later positions, exactly the ids of the whole sequence.
    `doc_pos_bt` (packed documents): each position's place in its document; context before the
    document's start reads as EOS too, where a record boundary carries no EOS (a Megatron prefix
    preprocessed without --append-eod)."""
    tokens_bt = token_history_bt.long()
    B, T = tokens_bt.shape
    pos_t = torch.arange(T, device=tokens_bt.device)
    eos_pos_bt = torch.where(tokens_bt == eos_token_id, pos_t, -1)
    # Last EOS position strictly before each position (-1: none).
    last_eos_bt = F.pad(torch.cummax(eos_pos_bt, dim=1).values[:, :-1], (1, 0), value=-1)
    eos_bt = torch.full_like(tokens_bt, eos_token_id)
    hashed, ids = None, []
    for shift in range(len(multipliers)):
        src_t = pos_t - shift
        shifted_bt = tokens_bt.gather(1, src_t.clamp_min(0).expand(B, T))
        keep_bt = (src_t >= 0) & (src_t > last_eos_bt)
        if doc_pos_bt is not None:
            keep_bt &= doc_pos_bt >= shift
        term_bt = torch.where(keep_bt, shifted_bt, eos_bt) * multipliers[shift]
        hashed = term_bt if hashed is None else torch.bitwise_xor(hashed, term_bt)
        if shift == 0:
            continue  # orders start at bigrams
        block = slice((shift - 1) * heads_per_ngram, shift * heads_per_ngram)
        ids.append(torch.remainder(hashed[..., None],
                                   head_vocab_sizes[block]) + head_offsets[block])
    return torch.cat(ids, dim=-1)


class NGramEmbedding(nn.Module):
    """The hashed n-gram table of one PLE layer: tokens (+ the tokens before them) -> [B, S,
    embed_dim]."""

    def __init__(self, vocab_size: int, embed_dim: int, ngram_size: int, heads_per_ngram: int,
                 ngram_vocab_base: int,
                 ngram_vocab_multiple: int, seed: int, ple_layer_index: int, eos_token_id: int):
        super().__init__()
        self.ngram_heads = (ngram_size - 1) * heads_per_ngram
        if ngram_size < 2 or embed_dim % self.ngram_heads:
            raise ValueError(f"PLE embed_dim {embed_dim} must be a multiple of its "
                             f"{self.ngram_heads} n-gram heads")
        self.vocab_size, self.ngram_size, self.heads_per_ngram = (
            vocab_size,
            ngram_size,
            heads_per_ngram,
        )
        self.ngram_vocab_base, self.ngram_vocab_multiple = ngram_vocab_base, ngram_vocab_multiple
        self.seed, self.ple_layer_index, self.eos_token_id = (
            seed,
            ple_layer_index,
            int(eos_token_id),
        )
        rows = self._tables()[3]
        self.ngram_embedding = nn.Embedding(rows, embed_dim // self.ngram_heads)
        # Persistent (as in transformers, so checkpoints match by name), recomputed by
        # reset_buffers.
        self.register_buffer("layer_multipliers", torch.zeros(ngram_size, dtype=torch.long))
        self.register_buffer("ngram_heads_vocab_sizes",
                             torch.zeros(self.ngram_heads, dtype=torch.long))
        self.register_buffer("ngram_heads_offsets", torch.zeros(self.ngram_heads, dtype=torch.long))
        self.reset_buffers()

    def _tables(self):
        return ngram_tables(self.vocab_size, self.ngram_size, self.heads_per_ngram,
                            self.ngram_vocab_base,
                            self.ngram_vocab_multiple, self.seed, self.ple_layer_index)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Fill the hash constants (again after meta-device construction and `to_empty`)."""
        if self.layer_multipliers.is_meta:
            return
        multipliers, sizes, offsets, _ = self._tables()
        for buf, values in ((self.layer_multipliers, multipliers),
                            (self.ngram_heads_vocab_sizes, sizes),
                            (self.ngram_heads_offsets, offsets)):
            buf.copy_(torch.tensor(values, dtype=torch.long))

    def ids(self, input_ids_bs: torch.Tensor, context_bc: Optional[torch.Tensor] = None,
            doc_pos_bs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Table rows [B, S, ngram_heads]; context_bc: the ngram_size - 1 tokens before (None:
        EOS); doc_pos_bs: each token's place in its packed document (`ngram_ids`)."""
        if context_bc is None:
            context_bc = input_ids_bs.new_full((input_ids_bs.shape[0], self.ngram_size - 1),
                                               self.eos_token_id)
        history_bt = torch.cat([context_bc.long(), input_ids_bs.long()], dim=1)
        if doc_pos_bs is not None:  # the context's own ids are dropped below
            doc_pos_bs = F.pad(doc_pos_bs.long(), (context_bc.shape[1], 0),
                               value=self.ngram_size)
        ids_btn = ngram_ids(history_bt, self.layer_multipliers, self.ngram_heads_vocab_sizes,
                            self.ngram_heads_offsets, self.heads_per_ngram, self.eos_token_id,
                            doc_pos_bs)
        return ids_btn[:, context_bc.shape[1]:]

    def forward(self, input_ids_bs: torch.Tensor, context_bc: Optional[torch.Tensor] = None,
                doc_pos_bs: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.ngram_embedding(self.ids(input_ids_bs, context_bc, doc_pos_bs)).flatten(-2)


def _read_ring(ring: torch.Tensor, first_pos_b: torch.Tensor, n: int, fill) -> torch.Tensor:
    """The entries [B, n, ...] of the n positions before each row's first position (`fill` before
    0); the ring has room for them (`LayerCache.ring_buffer` with lookback n)."""
    pos_bn = first_pos_b[:, None] - n + torch.arange(n, device=ring.device)
    idx = torch.remainder(pos_bn, ring.shape[1]).view(*pos_bn.shape, *([1] * (ring.dim() - 2)))
    got = ring.gather(1, idx.expand(-1, -1, *ring.shape[2:]))
    valid = (pos_bn >= 0).view_as(idx)
    return torch.where(valid, got, torch.as_tensor(fill, dtype=ring.dtype, device=ring.device))


def _write_ring(ring: torch.Tensor, values_bs: torch.Tensor, first_pos_b: torch.Tensor,
                row_end_b: torch.Tensor):
    """Store values at position p in slot p % slots, for each row's last min(S, slots) real
    positions (p <= row_end); every other slot keeps its content (a rewrite with its own value). A
    forward of at most the cache's `ring` tokens so writes all of them without reusing a slot a
    resume inside it reads."""
    R, S = ring.shape[1], values_bs.shape[1]
    n = min(S, R)
    pos_bn = row_end_b[:, None] - n + 1 + torch.arange(n, device=ring.device)
    j_bn = pos_bn - first_pos_b[:, None]  # index within this forward (< 0: not written by it)
    tail = [1] * (ring.dim() - 2)
    slot = torch.remainder(pos_bn, R).view(*pos_bn.shape, *tail).expand(-1, -1, *ring.shape[2:])
    src = j_bn.clamp(0, S - 1).view(*pos_bn.shape, *tail).expand(-1, -1, *ring.shape[2:])
    fresh = (j_bn >= 0).view(*pos_bn.shape, *tail)
    ring.scatter_(1, slot, torch.where(fresh, values_bs.detach().to(ring.dtype).gather(1, src),
                                       ring.gather(1, slot)))


class PLELayer(nn.Module):
    """Per-layer n-gram memory: forward(x_bsX, input_ids_bs, positions_bs, cache) -> addition [B, S,
    X]."""

    def __init__(self, hidden_size: int, hc_count: int, embed_dim: int, conv_kernel: int,
                 ngram_size: int,
                 heads_per_ngram: int, vocab_size: int, ngram_vocab_base: int,
                 ngram_vocab_multiple: int, seed: int,
                 ple_layer_index: int, eos_token_id: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size, self.hc_count, self.ngram_size = hidden_size, hc_count, ngram_size
        width = hc_count * hidden_size
        self.ple_embedding = NGramEmbedding(vocab_size, embed_dim, ngram_size, heads_per_ngram,
                                            ngram_vocab_base,
                                            ngram_vocab_multiple, seed, ple_layer_index,
                                            eos_token_id)
        self.key_proj = nn.Linear(embed_dim, width, bias=False)
        self.value_proj = nn.Linear(embed_dim, hidden_size, bias=False)
        self.norm_key = RMSNorm(width, eps, zero_centered=True, group_size=hidden_size)
        self.norm_query = RMSNorm(width, eps, zero_centered=True, group_size=hidden_size)
        self.norm_conv = RMSNorm(width, eps, zero_centered=True, group_size=hidden_size)
        # Dilation ngram_size: the conv sees the same slot of the previous n-gram windows.
        self.conv1d = nn.Conv1d(width, width, conv_kernel, groups=width, dilation=ngram_size,
                                bias=False)
        self.conv_window = (conv_kernel - 1) * ngram_size  # previous positions the conv reads
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The conv starts at zero (`param_init`)."""
        draw_init(self.conv1d.weight, self.param_init("conv1d.weight", None))

    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        """The conv starts at zero (as in Qwen4-Exp), so a fresh PLE adds only its gated values."""
        return ("zeros", 0.0) if name == "conv1d.weight" else None

    def forward(self, x_bsX: torch.Tensor, input_ids_bs: torch.Tensor,
                positions_bs: Optional[torch.Tensor] = None,
                cache=None, documents: Optional[Documents] = None,
                context: Optional[WholeWindow] = None) -> torch.Tensor:
        """Without a cache every row starts at position 0 (positions unused, as in transformers);
        with one, each row continues its state from position positions_bs[:, 0] (see
        models/state.py). With `documents` (packed training rows) the conv restarts at each
        document: its taps stop at the document's start, which `positions_bs` (counted from it)
        tells. `context` (training under context parallelism): the rows are this rank's chunks of
        the window (`_over_chunks`)."""
        if cache is None and context is not None and context.sharded:
            return self._over_chunks(x_bsX, input_ids_bs, positions_bs, documents, context)
        B, S, _ = x_bsX.shape
        hc, h, context = self.hc_count, self.hidden_size, self.ngram_size - 1
        tokens_bc = conv_in_bwX = None
        if cache is not None:
            first_b = positions_bs[:, 0].long()
            # A resume reads the n-gram context (ngram_size - 1 tokens) and the dilated conv's
            # window.
            ring_tokens = cache.ring_buffer("ple_tokens", (), torch.long, lookback=context)
            ring_conv = cache.ring_buffer("ple_conv", (hc * h,), lookback=self.conv_window)
            tokens_bc = _read_ring(ring_tokens, first_b, context, self.ple_embedding.eos_token_id)
            conv_in_bwX = _read_ring(ring_conv, first_b, self.conv_window, 0.0)

        # packed documents: n-grams restart at each document's start, as the conv does
        doc_pos = positions_bs if documents is not None and cache is None else None
        gated_bsX, conv_x_bsX = self._gated(x_bsX, self.ple_embedding(input_ids_bs, tokens_bc,
                                                                      doc_pos))

        if conv_in_bwX is None:  # zeros before position 0
            conv_in_bwX = conv_x_bsX.new_zeros(B, self.conv_window, hc * h)
        if documents is not None and cache is None:
            conv_bsX = causal_conv_taps(conv_x_bsX, self.conv1d.weight[:, 0], positions_bs,
                                        self.ngram_size)
            out_bsX = gated_bsX + F.silu(conv_bsX)
        else:
            conv_in = torch.cat([conv_in_bwX.to(conv_x_bsX.dtype), conv_x_bsX], dim=1).transpose(1,
                                                                                                 2)
            out_bsX = gated_bsX + F.silu(self.conv1d(conv_in)).transpose(1, 2)

        if cache is not None:
            row_end_b = cache.row_end if cache.row_end is not None else first_b + S - 1
            _write_ring(ring_tokens, input_ids_bs.long(), first_b, row_end_b.long())
            _write_ring(ring_conv, conv_x_bsX, first_b, row_end_b.long())
        return out_bsX

    def _gated(self, x_bsX: torch.Tensor, emb_bse: torch.Tensor):
        """(the gated n-gram values [B, S, hc * H], the conv's normalised input): per token."""
        hc, h = self.hc_count, self.hidden_size
        key_bsch = self.norm_key(self.key_proj(emb_bse)).unflatten(-1, (hc, h))
        value_bsh = self.value_proj(emb_bse)
        query_bsch = self.norm_query(x_bsX).unflatten(-1, (hc, h))
        # One scalar gate per stream; the signed square root softens large dot products.
        gate_bsc1 = (key_bsch * query_bsch).sum(dim=-1, keepdim=True) / math.sqrt(h)
        gate_bsc1 = gate_bsc1.abs().clamp_min(1e-6).sqrt() * gate_bsc1.sign()
        gated_bsX = (torch.sigmoid(gate_bsc1) * value_bsh.unsqueeze(-2)).flatten(-2)
        return gated_bsX, self.norm_conv(gated_bsX)

    def _over_chunks(self, x_bsX, input_ids_bs, positions_bs, documents,
                     context: WholeWindow) -> torch.Tensor:
        """PLE on this rank's chunks of the window (context parallelism), each a batch row: a
        chunk's n-grams read the ngram_size - 1 tokens before it and its conv the conv window before
        it (`context.halo`; EOS and zeros before the window), exactly what one process reads
        there."""
        ids = context.split(input_ids_bs)
        before = context.halo(ids, self.ngram_size - 1, fill=self.ple_embedding.eos_token_id)
        doc_pos = context.split(positions_bs) if documents is not None else None
        gated_bsX, conv_x_bsX = self._gated(x_bsX, context.join(self.ple_embedding(ids, before,
                                                                                   doc_pos)))
        conv_x = context.split(conv_x_bsX)
        n = self.conv_window
        extended = torch.cat([context.halo(conv_x, n), conv_x], 1)
        if documents is not None:
            pos = context.split(positions_bs)
            ext_pos = torch.cat([pos.new_zeros(pos.shape[0], n), pos], 1)
            conv = causal_conv_taps(extended, self.conv1d.weight[:, 0], ext_pos,
                                    self.ngram_size)[:, n:]
        else:
            conv = self.conv1d(extended.transpose(1, 2)).transpose(1, 2)
        return gated_bsX + F.silu(context.join(conv))
