"""Host syncs in decoding: drafting and verifying read nothing back from the device, and the decode
loop reads it once per round (the lengths that size the next forwards travel with its "still active"
flag), so `eval/speedup` on a GPU times the model, not one device-to-host round trip per layer.

The counter sees every device-to-host read on any device, CPU included: tensor -> Python conversions
(`.item()`, `int()`, `bool()`, `.tolist()`, slicing with a tensor bound) and the ops that size their
output from data (`nonzero`, boolean indexing, `masked_select`, `unique`, `bincount`, ...)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.eval.spec_decode import SpecDecoder, generate
from tests.eval_helpers import make_agreeing, tiny_model, tiny_qwen4_model

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 3]]

# aten ops that wait for the device: scalar reads, and outputs sized by the data
_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select",
             "bincount", "_unique", "_unique2", "unique_dim", "unique_consecutive", "histc"}


class _OpSyncs(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts, self.muted = counts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not self.muted:
            if name in _SYNC_OPS:
                self.counts[name] += 1
            elif name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
                self.counts[f"{name}[bool]"] += 1
            elif name == "repeat_interleave" and isinstance(args[0],
                                                            torch.Tensor) and args[0].dim() == 1 \
                    and kwargs.get("output_size") is None and func.__name__.endswith("Tensor"):
                self.counts["repeat_interleave[tensor]"] += 1
            elif name in ("_to_copy", "copy_") and self._to_host(args, kwargs, name):
                self.counts["device_to_host_copy"] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(args, kwargs, name) -> bool:
        src = args[1] if name == "copy_" else args[0]
        dst = args[0].device if name == "copy_" else kwargs.get("device")
        return dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu"


class HostSyncs(TorchFunctionMode):
    """Counts device-to-host reads while active: `counts` by name, `total` in all. `.tolist()` and
    `.numpy()` read CPU memory without an aten op, so they are counted here (and the copy they make
    from a device is not counted twice)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self._ops = _OpSyncs(self.counts)

    def __enter__(self):
        self._ops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._ops.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.counts[func.__name__] += 1
            self._ops.muted += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self._ops.muted -= 1
        return func(*args, **(kwargs or {}))


def test_counter_sees_every_kind_of_host_read():
    """The counter the tests below rely on: each of these reads the device back once."""
    t = torch.arange(6)
    reads = [lambda: int(t.max()), lambda: t.sum().item(), lambda: bool(t.any()),
             lambda: t.tolist(),
             lambda: t[: t.max()], lambda: t[t.argmax()], lambda: t[t > 2], lambda: t.nonzero(),
             lambda: torch.bincount(t), lambda: t.repeat_interleave(t)]
    for read in reads:
        with HostSyncs() as syncs:
            read()
        assert syncs.total == 1, syncs.counts
    with HostSyncs() as syncs:  # device-side work only
        (t.max() + t.cumsum(0).gather(0, t.argmax().view(1))).repeat_interleave(2).clamp(max=3)
    assert syncs.total == 0, syncs.counts


MODELS = {
    "moe_bf16": lambda K: make_agreeing(tiny_model(K, 1, seed=3), 0.05, seed=3).to(torch.bfloat16),
    # Gated DeltaNet, QSA (+ index reuse), PLE, hyper-connections
    "qwen4_exp": lambda K: tiny_qwen4_model(K),
}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("convention", ["serving", "tandem"])
def test_draft_and_verify_read_nothing_back(family, convention):
    """Every drafting forward and the verify forward of several rounds (rows of different lengths,
    so the batched ranges are padded) run without a host read; today's code read the positions back
    in every attention layer's cache update and the draft range's length at every depth."""
    K = 3
    model = MODELS[family](K)
    dec = SpecDecoder(model, K, len(PROMPTS), 48, draft_convention=convention)
    with torch.inference_mode():
        dec.prefill(PROMPTS)
        active = torch.ones(len(PROMPTS), dtype=torch.bool)
        for round_ in range(4):
            if round_ == 2:
                dec.read_lengths()  # exact host lengths for some rounds, bounds for the others
            with HostSyncs() as syncs:
                drafts, q, _ = dec.draft()
                n, nxt = dec.verify(drafts, q)
            assert syncs.total == 0, (round_, dict(syncs.counts))
            dec.commit(n, nxt, active)


@pytest.mark.parametrize("K", [0, 3])
def test_generate_reads_the_device_once_per_round(K):
    """A whole decode: one host read per round of the loop (its `active` flag with the lengths),
    plus one to stop, plus the outputs' read-back at the end (a copy per row of the tokens and
    m)."""
    model = tiny_qwen4_model(3)
    with HostSyncs() as syncs:
        result = generate(model, PROMPTS, 12, K)
    rounds = result.stats.num_rounds
    assert rounds >= (3 if K else 11)
    assert syncs.total <= rounds + 1 + 2 * len(PROMPTS), (rounds, dict(syncs.counts))
