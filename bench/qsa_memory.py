"""Peak host memory of one QSA layer's training step, streamed (models/qsa_stream.py) against the
path before it (the whole [B, S, S / r] score matrix, one top-k over it, the KL over [B, S, S / r]).

    python bench/qsa_memory.py [--seqs 1024,2048,4096] [--quick]

Each (S, path) runs in a fresh subprocess: a tiny IndexedAttention (gather form, sparse stage, the
indexer KL on, fp32, one thread) does one forward and backward; the peak RSS over the RSS just
before it (ru_maxrss) is that step's peak. Printed side by side per S: the two peaks, their ratio,
and the streamed peak over models/qsa.py's per-rank formula (`formula_bytes`, cp = 1) and over the
old path's S * S / r terms. The streamed peak grows linearly in S (the formula's ratio stays flat);
the old one quadratically. Last line: `old_over_streamed=<largest S>`.

`MaterialisedIndexedAttention` (the old path, kept as the reference) is what
tests/unit/test_qsa_streaming.py compares the streamed form to.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMS = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, idx_heads=4, idx_dim=16, budget=64,
            ratio=4)
BATCH, CHUNK_ELEMS = 1, 1 << 18


def _reference_class():
    import torch

    from tandem.models.qsa import IndexedAttention, map_query_chunks
    from tandem.models.qsa_loss import attention_block_mass, indexer_kl

    class MaterialisedIndexedAttention(IndexedAttention):
        """The training path before streaming: scores [B, S, N] (kept for the KL's autograd), one
        top-k over them, the mass [B, S, N] and the KL over every block with the unselected ones
        masked."""

        def _training_selection(self, q_idx_bsid, k_bnd, reused, docs, query_at_bs, select,
                                visible):
            self._scores = None
            if reused is not None or k_bnd is None:
                return super()._training_selection(q_idx_bsid, k_bnd, reused, docs, query_at_bs,
                                                   select, visible)
            b, _, i, _ = q_idx_bsid.shape
            chunk = max(1, self.chunk_elems // (b * i * max(1, k_bnd.shape[1])))
            with torch.set_grad_enabled(k_bnd.requires_grad):
                self._scores = map_query_chunks(self.indexer.block_scores, chunk, (q_idx_bsid,),
                                                (k_bnd,))
            if not select:
                return None, None
            return self.select_blocks(self._scores, query_at_bs,
                                None if docs is None else docs.visible(self.compress_ratio))

        def _indexer_target(self, q_bhsd, k_bksd, q_idx_bsid, k_bnd, blocks_bsk, count_bs,
                            query_at_bs, docs, selected, want_loss, visible, rows_s, window, dense,
                            measure_recall, counted=None):
            assert window is None, "the reference runs in one process"
            r, n = self.compress_ratio, k_bnd.shape[1]
            mass_bsn, recall_bs = attention_block_mass(
                q_bhsd.detach(), k_bksd.detach(), r, n, self.chunk_elems, selected,
                sparse_target=not dense,
                query_first_bs=None if docs is None else docs.first_bs,
                block_tokens_bm=None if docs is None else docs.tokens_bm)
            if measure_recall:
                self.last_recall = self.reduce_heads(recall_bs).mean() / self.num_heads
            if not want_loss:
                return None
            if dense:
                allowed_bsn = visible(0, query_at_bs.shape[1], 0, n)
            else:
                real = torch.arange(blocks_bsk.shape[-1], device=blocks_bsk.device) < count_bs[...,
                                                                                               None]
                allowed_bsn = torch.zeros_like(self._scores,
                                               dtype=torch.bool).scatter_(-1, blocks_bsk, real)
            if counted is not None:  # padding queries learn nothing
                allowed_bsn = allowed_bsn & counted[..., None]
            loss = indexer_kl(self._scores, self.reduce_heads(mass_bsn), allowed_bsn)
            self.last_indexer_loss = loss.detach()
            return loss

    return MaterialisedIndexedAttention


# `from qsa_memory import MaterialisedIndexedAttention` builds it on first use
def __getattr__(name):
    if name == "MaterialisedIndexedAttention":
        return _reference_class()
    raise AttributeError(name)


def make_layer(cls, seq: int, form: str = "gather"):
    """The layer measured: the indexer's KL on (coefficient 1)."""
    d = DIMS
    return cls(d["hidden"], d["heads"], d["kv_heads"], d["head_dim"], 0.5, 10000.0, seq, 1e-6,
               d["idx_heads"], d["idx_dim"], d["budget"], d["ratio"], form=form,
               indexer_loss_coef=1.0)


def formula_bytes(seq: int, cp: int = 1, batch: int = BATCH,
                  chunk_elems: int = CHUNK_ELEMS) -> float:
    """models/qsa.py's per-rank peak (streamed, gather form), in bytes, for these dims."""
    d = DIMS
    k, span = d["budget"] // d["ratio"], d["budget"] + d["ratio"] - 1
    rows = 4 * (d["hidden"] + 4 * d["heads"] * d["head_dim"] + (d["idx_heads"] + 1) * d["idx_dim"])
    local = batch * seq / cp * (8 * k + 33 * span + rows)
    window = batch * seq * 4 * (4 * d["kv_heads"] * d["head_dim"] + 2 * d["idx_dim"])
    return local + window + 4 * 4 * chunk_elems


def old_quadratic_bytes(seq: int, batch: int = BATCH) -> float:
    """The old path's S * S / r terms: fp32 scores and their gradient, the int64 top-k keys, the
    mass, target and log-probabilities of the KL (about 36 bytes per score)."""
    return batch * seq * (seq // DIMS["ratio"]) * 36.0


def one(seq: int, path: str) -> int:
    """Peak RSS bytes of one forward + backward over the RSS before it."""
    import torch

    from tandem.models.qsa import IndexedAttention

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cls = IndexedAttention if path == "streamed" else _reference_class()
    layer = make_layer(cls, seq).train()
    layer.chunk_elems = CHUNK_ELEMS
    x = torch.randn(BATCH, seq, DIMS["hidden"], requires_grad=True)
    pos = torch.arange(seq).expand(BATCH, seq)
    layer(x[:, :64], pos[:, :64]).sum().backward()  # allocator and autograd warm-up at a small size
    layer.zero_grad(set_to_none=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layer(x, pos).sum().backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096")
    ap.add_argument("--quick", action="store_true", help="S = 512, 1024 only")
    ap.add_argument("--one", nargs=2, metavar=("S", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps({"peak": one(int(args.one[0]), args.one[1])}))
        return
    seqs = [512, 1024] if args.quick else [int(s) for s in args.seqs.split(",")]
    # a small fixed mmap threshold: every buffer of a page or more is mapped and unmapped on its
    # own, so the RSS follows what the step holds, not where freed chunk buffers left glibc's heap
    # fragmented
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="4096",
               MALLOC_TRIM_THRESHOLD_="4096")
    print(f"{'S':>6} {'streamed MB':>12} {'old MB':>9} {'old/streamed':>13} "
          f"{'streamed/formula':>17} "
          f"{'old/quadratic':>14}")
    ratio = None
    for seq in seqs:
        peak = {}
        for path in ("streamed", "old"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(seq),
                                  path], env=env,
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            peak[path] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
        ratio = peak["old"] / max(1, peak["streamed"])
        print(f"{seq:>6} {peak['streamed'] / 2**20:>12.1f} {peak['old'] / 2**20:>9.1f} "
              f"{ratio:>13.2f} "
              f"{peak['streamed'] / formula_bytes(seq):>17.2f} "
              f"{peak['old'] / old_quadratic_bytes(seq):>14.2f}")
    print(f"old_over_streamed={ratio:.2f}")


if __name__ == "__main__":
    main()
