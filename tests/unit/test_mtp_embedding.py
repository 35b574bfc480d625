"""The MTP steps read the trunk's embedding lookup shifted (TandemModel.shifted_embeddings) instead
of looking tokens t+k up again: one lookup per forward (per pipeline stage holding steps), same
losses and gradients as a lookup per step (the previous path, forced here by `shared_lookup` =
False)."""

import pytest
import torch

from tandem.models import ModelConfig, MTPConfig, TandemModel
from tandem.models.model import SequenceLayout, shifted_tokens


def _model(hc_count: int = 1, seed: int = 0) -> TandemModel:
    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=48,
              moe_intermediate_size=16, num_experts=4, top_k=2, first_k_dense=1, max_seq_len=64)
    # Qwen4-Exp's streams: the trunk repeats the embedding, the qwen4_exp combine reads it
    if hc_count > 1:
        kw.update(hc_count=hc_count, zero_centered_norm=True)
    return TandemModel(ModelConfig(**kw), MTPConfig(num_steps=3, num_layers=2, loss_chunk_tokens=7))


def _count_lookups(model: TandemModel) -> list:
    calls = []
    model.embed_tokens.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape)))
    return calls


def _per_step_lookups(model: TandemModel) -> None:
    model.shared_lookup = lambda: False  # the previous path: every MTP step looks its tokens up


def test_mtp_steps_do_no_lookups_of_their_own():
    model = _model()
    calls = _count_lookups(model)
    tokens = torch.randint(0, 97, (2, 13))
    model(tokens)
    # one lookup of S+K rows: the S+1 tokens and K-1 beyond (was K+1 of S)
    assert calls == [(2, 12 + 3)]
    # a pipeline stage after the trunk's, holding steps 2..3 (chain from depth 1): one lookup for
    # both
    calls.clear()
    pos = torch.arange(12).expand(2, 12)
    h = torch.randn(2, 12, 32)
    model.losses_from_hidden(h, tokens, torch.ones(2, 12), None, pos, depths=[2, 3], h_chain=h,
                             chain_depth=1)
    assert calls == [(2, 12 + 1)]
    _per_step_lookups(model)
    calls.clear()
    model(tokens)
    # the reference path does look up per step, so the counts above mean something
    assert len(calls) == 4


@pytest.mark.parametrize("hc_count", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_lookup_losses_and_gradients_equal_per_step_lookups(dtype, hc_count):
    tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(5))
    doc_ids = torch.cat([torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 7, dtype=torch.long)],
                        dim=1)
    results = []
    for shared in (True, False):
        model = _model(hc_count)
        if not shared:
            _per_step_lookups(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model(tokens, doc_ids_bs1=doc_ids)
        out.loss_sums.sum().backward()
        results.append((out.loss_sums.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l_new, g_new), (l_old, g_old) = results
    # the same values in the same ops; only the embedding's gradient sums its rows in another order
    torch.testing.assert_close(l_new, l_old, rtol=0, atol=0)
    for name, g in g_old.items():
        if g is None:
            assert g_new[name] is None, name
            continue
        torch.testing.assert_close(g_new[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert g_old["embed_tokens.weight"].abs().sum() > 0


class _FakeShards(SequenceLayout):
    """What trainer/parallel/tensor.py `SequenceShards` does for rank `rank` of `size`, in one
    process: the whole lookup is the plain one (what the all-reduce of the vocabulary shards'
    lookups gives)."""

    def __init__(self, rank: int, size: int):
        super().__init__()
        self.rank, self.size, self.lookups = rank, size, 0

    def embed_window(self, embed_tokens, ids):
        self.lookups += 1
        return embed_tokens(ids)

    def rows(self, x, first, rows):
        per = rows // self.size
        return x[:, first + self.rank * per : first + (self.rank + 1) * per]


@pytest.mark.parametrize("rank", [0, 1])
def test_sequence_parallel_steps_read_their_shards_of_one_whole_lookup(rank):
    """Under sequence parallelism the trunk and each MTP step read this rank's rows of one
    whole-window lookup: exactly the shard the per-step lookups' reduce-scatter hands it (token t+k
    at t's place, and the next rank's first k tokens at the end of this rank's shard)."""
    model = _model()
    tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    s, k = 12, model.mtp_cfg.num_steps
    model.sequence = shards = _FakeShards(rank, 2)  # what sequence parallelism builds
    assert model.shared_lookup()
    window = (model.shifted_embeddings(tokens, 0, k), 0)
    assert shards.lookups == 1 and window[0].shape[:2] == (2, s + k)
    with torch.no_grad():
        for shift in range(k + 1):
            want = model.embed_tokens(shifted_tokens(tokens, shift, s))[:,
                                                                        rank * 6 : (rank + 1) * 6]
            torch.testing.assert_close(model.window_rows(window, shift, s), want, rtol=0, atol=0)
