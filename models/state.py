"""Decoder state: one object per batch of sequences, indexed by absolute position.

Every piece of decoder state is stored by the absolute position of the token that produced it, so
the one rollback contract of the speculative decoder holds for every layer kind: *a forward always
covers a contiguous range of positions starting right after the row's committed prefix, and rolling
back to an accepted prefix is only lowering that prefix's length*. Rows beyond it are rewritten
before any later forward reads them.

* Attention keys/values (and QSA's raw indexer keys) live in full-length buffers [B, max_len, ...]
  written at their positions (`LayerCache.update`, `LayerCache.buffer(..., length=max_len)`).
* Recurrent pieces (Gated DeltaNet's recurrent and conv states, PLE's conv inputs and n-gram token
  context) live in rings (`LayerCache.ring_buffer`). A piece whose forward starting at position m
  reads the `lookback` positions m - lookback .. m - 1 (Gated DeltaNet: its state 1 and its conv
  inputs conv_kernel - 1; PLE: its n-gram context ngram_size - 1 and its dilated conv inputs
  (ple_conv_kernel - 1) * ngram_size) gets a ring of ring + lookback slots, the entry of position p
  in slot p % (ring + lookback). One rule for every layer (`LayerCache.keeps_every_position`): a
  forward over R <= `ring` tokens writes every position's entry, and its writes (positions up to
  start + ring - 1) only reuse slots of positions before start - lookback, so every prefix of it,
  the empty one included, can be resumed from; a longer forward (a prompt prefill) keeps only what a
  resume right after each row's last real token (`row_end`) reads.
* `row_end` [B] (set by the caller for a forward, None when every token is real) is the last real
  position of each row: batched forwards pad short rows with positions continuing past their end.
  Padded tokens never change the state at or before `row_end`.
* A row whose first position in a forward is 0 starts from the zero state.
* `span` (set by the caller for a forward, a host integer) bounds the positions it writes, so the
  attention layers slice their key/value prefix without reading positions back from the device (a
  host sync in every layer of every forward); unset, they attend over the whole buffer. Keys past a
  query's position are masked either way, so any bound gives the same outputs.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch


class DecodeCache:
    """Per-layer decoder state for a batch of sequences (attention KV buffers plus module-owned
    position-indexed buffers). Buffers are allocated at a layer's first write, shaped like what the
    layer holds: under tensor parallelism a rank keeps only its own heads."""

    def __init__(self, num_layers: int, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device,
                 ring: int = 32, shared: Optional[Dict[str, torch.Tensor]] = None):
        self.keys: List[Optional[torch.Tensor]] = [None] * num_layers
        self.values: List[Optional[torch.Tensor]] = [None] * num_layers
        self.buffers: List[Dict[str, torch.Tensor]] = [dict() for _ in range(num_layers)]
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device
        if int(ring) < 1:
            raise ValueError(f"DecodeCache ring must be positive, got {ring}")
        self.ring = int(ring)
        """The longest forward that keeps every position's recurrent state (see the module
        docstring)."""
        self.row_end: Optional[torch.Tensor] = None
        """[B] last real position of each row in the current forward (None: all real)."""
        self.span: Optional[int] = None
        """One past the largest position the current forward writes, as its caller knows it on the
        host (an upper bound is enough); None: the whole buffer (max_len), which is never wrong."""
        self.shared: Dict[str, torch.Tensor] = {} if shared is None else shared
        """Buffers several caches of one decoder share (the MTP depths' caches: QSA index reuse)."""

    def allocate(self, index: int, heads: int, key_dim: int, value_dim: int,
                  dtype: torch.dtype) -> None:
        shape = (self.batch, heads, self.max_len)
        self.keys[index] = torch.zeros(*shape, key_dim, dtype=dtype, device=self.device)
        self.values[index] = torch.zeros(*shape, value_dim, dtype=dtype, device=self.device)

    def layer(self, index: int) -> "LayerCache":
        return LayerCache(self, index)


class LayerCache:
    """A view of one layer's slot in a DecodeCache."""

    def __init__(self, cache: DecodeCache, index: int):
        self.cache, self.index = cache, index

    @property
    def ring(self) -> int:
        return self.cache.ring

    @property
    def row_end(self) -> Optional[torch.Tensor]:
        return self.cache.row_end

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def buffer(self, name: str, tail: Sequence[int], dtype: Optional[torch.dtype] = None,
               length: Optional[int] = None) -> torch.Tensor:
        """This layer's buffer `name` [B, length, *tail] (length defaults to the ring size), zeros
        at its first use. Modules index it by position (full-length buffers) or by position % length
        (rings)."""
        store = self.cache.buffers[self.index]
        if name not in store:
            n = self.cache.ring if length is None else int(length)
            store[name] = torch.zeros((self.cache.batch, n, *tail), dtype=dtype or self.cache.dtype,
                                      device=self.cache.device)
        return store[name]

    def keeps_every_position(self, tokens: int) -> bool:
        """Whether a forward over `tokens` positions must keep every position's recurrent state (so
        any prefix of it can be resumed from) or only the state after each row's `row_end` (a
        prefill)."""
        return tokens <= self.cache.ring

    def ring_buffer(self, name: str, tail: Sequence[int], dtype: Optional[torch.dtype] = None,
                    lookback: int = 1) -> torch.Tensor:
        """This layer's ring `name` [B, ring + lookback, *tail] (zeros at first use), the entry of
        position p in slot p % (ring + lookback); `lookback`: how many positions before its first
        one a forward reads."""
        return self.buffer(name, tail, dtype, length=self.cache.ring + int(lookback))

    def shared_buffer(self, name: str, tail: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A full-length buffer [B, max_len, *tail] in the store shared with the decoder's other
        caches (zeros at first use), indexed by position like every other piece of state."""
        store = self.cache.shared
        if name not in store:
            store[name] = torch.zeros((self.cache.batch, self.cache.max_len, *tail), dtype=dtype,
                                      device=self.cache.device)
        return store[name]

    def update(self, k_bnsd: torch.Tensor, v_bnsd: torch.Tensor, positions_bs: torch.Tensor):
        """Write new keys/values at their positions; return the cache prefix covering them.

        The buffers hold the dtype of the first keys written, which is the dtype attention computes
        in (the queries'): under bf16 autocast they are bf16, as the attention reads them, rather
        than the parameters' fp32, which would double their memory and cast the whole prefix back
        at every layer of every forward for the same values."""
        if self.cache.keys[self.index] is None:
            self.cache.allocate(self.index, k_bnsd.shape[1], k_bnsd.shape[-1], v_bnsd.shape[-1],
                                 k_bnsd.dtype)
        keys, values = self.cache.keys[self.index], self.cache.values[self.index]
        # the prefix length comes from the host (`span`): int(positions.max()) here would stall
        # every layer
        span = self.cache.max_len if self.cache.span is None else self.cache.span
        if span > self.cache.max_len:
            raise RuntimeError(f"KV cache overflow: span {span} > max_len {self.cache.max_len}")
        # indexed assignment over (row, position) pairs: on CPU several times faster than scatter_
        # with an index expanded over heads and channels
        rows = torch.arange(positions_bs.shape[0], device=positions_bs.device)[:, None]
        keys.transpose(1, 2)[rows, positions_bs] = k_bnsd.transpose(1, 2).to(keys.dtype)
        values.transpose(1, 2)[rows, positions_bs] = v_bnsd.transpose(1, 2).to(values.dtype)
        return keys[:, :, :span], values[:, :, :span]


# The names the rest of the code base has used since the cache held only keys and values.
KVCache = DecodeCache
LayerKV = LayerCache
