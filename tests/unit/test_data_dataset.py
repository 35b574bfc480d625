"""Datasets: GPTDataset windows, doc_ids, the batch-index formula, blends, and fail-fast errors."""

import json
import os
import random
import struct

import numpy as np
import pytest
import torch

from tandem.data_pipeline.batches import DataPosition, batch_indices, get_batch
from tandem.data_pipeline.dataset import build_datasets, check_prefix, check_vocab, parse_blend
from tandem.data_pipeline.preprocess import preprocess, read_meta
from tandem.data_pipeline.tokenizer import load_tokenizer, train_bpe
from tandem.trainer.config import DataConfig

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _docs(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tok_path = str(root / "tok.json")
    train_bpe(iter(_docs(50, 0)), 300, tok_path)
    prefixes = {}
    for name, seed, n in (("a", 1, 80), ("b", 2, 40), ("v", 3, 20)):
        src = root / f"{name}.jsonl"
        import json

        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(n, seed)),
                       encoding="utf-8")
        prefixes[name] = str(root / name)
        preprocess([str(src)], prefixes[name], tokenizer=tok_path)
    return root, tok_path, prefixes


def _cfg(root, **kw):
    return DataConfig(source="megatron", cache_dir=str(root / "cache"), **kw)


def _concat_in_document_order(ds):
    """The corpus as GPTDataset walks it: documents in its (shuffled, epoch-repeated) document
    index."""
    docs = [ds.dataset[int(d)] for d in ds.document_index]
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    return np.concatenate(docs).astype(np.int64), starts


def test_samples_are_contiguous_windows_of_the_corpus(corpus):
    root, _, prefixes = corpus
    seq_len = 16
    train, valid, tok = build_datasets(_cfg(root, paths=[prefixes["a"]], split="90,10,0"), seq_len,
                                       7, 200, 10)
    assert len(train) >= 200 and len(valid) >= 10
    flat, starts = _concat_in_document_order(train)
    for i in range(0, len(train), 7):
        row = train.shuffle_index[i]
        doc_pos, offset = train.sample_index[row]
        start = starts[doc_pos] + offset
        batch = get_batch(train, [i])
        assert batch["tokens"].shape == (1, seq_len + 1)
        assert batch["tokens"][0].tolist() == flat[start:start + seq_len + 1].tolist()
    # the train and valid splits hold disjoint documents
    assert not set(train.indices.tolist()) & set(valid.indices.tolist())


@pytest.mark.parametrize("where", ["split", "valid_paths"])
def test_a_small_validation_split_is_read_once(corpus, where):
    """Asked for more validation windows than the split holds, the split gives each of its
    documents' tokens once, in the order a smaller count gives, and the evaluator says it has fewer.
    megatron-core started a second epoch: its windows re-cut the same documents, so the prompts and
    loss batches read the text twice and the intervals counted the copies as more prompts."""
    from tandem.eval.metrics import validation_inputs

    root, _, prefixes = corpus
    data = (dict(paths=[prefixes["a"]], split="90,10,0") if where == "split"
            else dict(paths=[prefixes["a"]], valid_paths=[prefixes["v"]]))
    _, few, _ = build_datasets(_cfg(root, **data), 16, 7, 20, 2)
    _, many, _ = build_datasets(_cfg(root, **data), 16, 7, 20, 10_000)
    tokens = int(sum(many.dataset.sequence_lengths[many.indices]))
    assert len(many) == len(few) == (tokens - 1) // 16 < 10_000  # one epoch: every window once
    assert sorted(many.document_index.tolist()) == sorted(many.indices.tolist())
    assert torch.equal(get_batch(many, range(len(few)))["tokens"],
                       get_batch(few, range(len(few)))["tokens"])
    prompts, batches, note = validation_inputs(many, 10_000, 8, 1_000, 4, False)
    assert len(prompts) == len(many) and f"holds {len(many)} windows" in note


def test_a_validation_prefix_shorter_than_a_window_is_refused(corpus):
    """data.valid_paths holding fewer tokens than one window gave no validation split: the run went
    on without its evaluation, saying only 'no validation split'. (The split's case was already
    refused, naming data.split.)"""
    root, _, prefixes = corpus
    tokens = read_meta(prefixes["v"])["tokens"]
    cfg = _cfg(root, paths=[prefixes["a"]], valid_paths=[prefixes["v"]])
    with pytest.raises(ValueError, match=f"^data.valid_paths {prefixes['v']} holds {tokens} "
                                         f"tokens, fewer than one window of "
                                         f"data.seq_len\\+1={tokens + 1}$"):
        build_datasets(cfg, tokens, 7, 1, 1)
    assert build_datasets(cfg, tokens, 7, 1, 0)[1] is None  # no evaluation asked: no refusal


@pytest.mark.parametrize("where", ["weighted split", "unweighted valid_paths",
                                   "weighted valid_paths"])
def test_a_small_validation_blend_reads_each_document_once(corpus, where):
    """A validation blend of several prefixes, asked for more windows than it holds: none of its
    prefixes' documents is read twice (a weighted blend gets fewer samples, an unweighted one is
    one epoch of each prefix), and the training split keeps the samples asked for."""
    root, _, prefixes = corpus
    a, b, v = prefixes["a"], prefixes["b"], prefixes["v"]
    data = {"weighted split": dict(paths=["0.5", a, "0.5", b], split="90,10,0"),
            "unweighted valid_paths": dict(paths=[a], valid_paths=[v, b]),
            "weighted valid_paths": dict(paths=[a], valid_paths=["0.3", v, "0.7", b])}[where]
    train, valid, _ = build_datasets(_cfg(root, **data), 16, 7, 200, 10_000)
    assert len(train) >= 200 and 0 < len(valid) < 10_000
    assert type(valid).__name__ == "BlendedDataset" and len(valid.datasets) == 2
    for part in valid.datasets:  # one epoch: each of the part's documents once
        assert sorted(part.document_index.tolist()) == sorted(part.indices.tolist()), where
    rows = get_batch(valid, range(len(valid)))["tokens"]
    assert len({tuple(r.tolist()) for r in rows}) == len(valid)


def test_get_batch_shapes_masks_and_doc_ids(corpus):
    root, _, prefixes = corpus
    train, _, tok = build_datasets(_cfg(root, paths=[prefixes["a"]]), 32, 1, 64, 4)
    b = get_batch(train, range(4, 8))
    assert b["tokens"].dtype == torch.long and b["tokens"].shape == (4, 33)
    assert b["loss_mask"].dtype == torch.float32 and b["loss_mask"].shape == (4, 32)
    assert b["doc_ids"].dtype == torch.long and b["doc_ids"].shape == (4, 33)
    inputs = b["tokens"][:, :-1]
    assert torch.equal(b["loss_mask"], torch.ones(4, 32)) and (inputs == tok.eod_id).any()
    # no target whose input is the EOD counts, at any depth (what Megatron's eod_mask_loss did):
    # it is the next document's
    from tandem.models.mtp import depth_target_mask

    for depth in range(3):
        kept = depth_target_mask(b["loss_mask"], b["doc_ids"], depth)
        assert not kept[inputs == tok.eod_id].any() and kept.sum() > 100


def _doc_ids_by_offset(ds, idx):
    """The stored document of each token of sample `idx`, found by its offset into the corpus as
    the dataset walks it (independent of the sample's own doc_ids), numbered from 0."""
    _, starts = _concat_in_document_order(ds)
    i = int(ds.shuffle_index[idx])
    (beg, beg_offset) = ds.sample_index[i]
    first = starts[beg] + beg_offset
    docs = np.searchsorted(starts, first + np.arange(ds.config.sequence_length + 1), "right")
    return torch.from_numpy(docs - docs[0])


def test_documents_written_without_eod_stay_apart(corpus, tmp_path):
    """A prefix as Megatron-LM's preprocess_data.py writes it without --append-eod (its default):
    no EOD between documents, no meta file. The windows' doc_ids are the stored documents, so no
    depth's target crosses into the next document; with the EOD (`tandem preprocess`), they equal
    the EOD count they were before."""
    from tandem.data_pipeline.megatron_compat import IndexedDataset
    from tandem.data_pipeline.megatron_import import IndexedDatasetBuilder
    from tandem.models.mtp import depth_target_mask

    root, tok_path, prefixes = corpus
    eod = load_tokenizer(tok_path).eod_id
    src, dst = IndexedDataset(prefixes["a"]), str(tmp_path / "no_eod")
    builder = IndexedDatasetBuilder(dst + ".bin", dtype=src.index.dtype)
    for i in range(len(src)):
        doc = src[i]
        kept = doc[doc != eod].astype(np.int64)
        builder.add_document(torch.from_numpy(kept), [len(kept)])
    builder.finalize(dst + ".idx")
    for prefix in (dst, prefixes["a"]):
        train, _, _ = build_datasets(_cfg(tmp_path, paths=[prefix], tokenizer=tok_path), 32, 1, 64,
                                     4)
        b = get_batch(train, range(16))
        expected = torch.stack([_doc_ids_by_offset(train, i) for i in range(16)])
        assert torch.equal(b["doc_ids"], expected) and expected[:, -1].sum() > 8
        if prefix == dst:
            assert not (b["tokens"] == eod).any()
            for depth in range(3):  # the last tokens of each document predict none of the next's
                kept = depth_target_mask(b["loss_mask"], b["doc_ids"], depth)
                crosses = b["doc_ids"][:, depth + 1:] != b["doc_ids"][:, :-depth - 1]
                assert crosses.any() and not kept[:, :32 - depth][crosses].any()
        else:
            is_eod = (b["tokens"] == eod).long()
            assert torch.equal(b["doc_ids"], torch.cumsum(is_eod, 1) - is_eod)


class _Fixed:
    """A dataset of given windows, shaped like GPTDataset items."""

    def __init__(self, windows):
        self.windows = [torch.tensor(w) for w in windows]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        w = self.windows[i]
        return {"tokens": w[:-1], "labels": w[1:], "loss_mask": torch.ones(len(w) - 1)}


def test_doc_ids_hand_case():
    eod = 0
    ds = _Fixed([[5, 0, 7, 8, 0, 0, 9], [1, 2, 3, 4, 5, 6, 0]])
    b = get_batch(ds, [0, 1, 2], eod_id=eod)  # index 2 wraps to 0
    assert b["tokens"].tolist() == [[5, 0, 7, 8, 0, 0, 9], [1, 2, 3, 4, 5, 6, 0],
                                    [5, 0, 7, 8, 0, 0, 9]]
    assert b["doc_ids"].tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0],
                                     [0, 0, 1, 1, 1, 2, 3]]
    assert b["loss_mask"].shape == (3, 6)


@pytest.mark.parametrize("dp,ga,mbs", [(1, 1, 4), (2, 3, 2), (4, 1, 3), (3, 2, 1)])
def test_batch_indices_union_equals_single_rank_run(dp, ga, mbs):
    G = mbs * ga * dp
    for first in (0, G, 5 * G, 7):
        step = list(range(first, first + G))
        union = []
        for micro in range(ga):
            for rank in range(dp):
                union += batch_indices(step, micro, ga, rank, dp, mbs)
        assert union == step  # micro-major, then rank, then sample
        single = [i for m in range(dp * ga) for i in batch_indices(step, m, dp * ga, 0, 1, mbs)]
        assert sorted(union) == single
    with pytest.raises(ValueError):
        batch_indices(list(range(G)), ga, ga, 0, dp, mbs)
    with pytest.raises(ValueError):
        batch_indices(list(range(G + 1)), 0, ga, 0, dp, mbs)


def test_data_position_continues_the_stream_under_another_global_batch():
    """Steps of 8 samples, a rewind's skipped batch, then steps of 12 and 4: each step starts at the
    next sample no step has read; the LR schedule position counts consumed samples in steps of 8."""
    pos = DataPosition(8, seq_len=32)
    reads = []
    for _ in range(2):
        reads.append(pos.step_ranges())
        pos.advance()
    pos.skip(pos.step_ranges())  # rewind: samples 16..23 passed over
    reads.append(pos.step_ranges())
    pos.advance()
    saved = json.loads(json.dumps(pos.state()))  # through trainer_state.json
    assert saved == {"consumed_samples": 24, "consumed_tokens": 24 * 32, "global_batch": 8,
                     "schedule_global_batch": 8, "skipped_samples": [[16, 24]],
                     "stream_builds": []}
    for batch, schedule_step in ((12, 3.0), (4, 4.5)):
        pos = DataPosition(batch, seq_len=32)
        pos.load_state(saved)
        assert pos.schedule_step() == schedule_step  # 24 then 36 samples in steps of 8
        reads.append(pos.step_ranges())
        pos.advance()
        saved = pos.state()
    assert reads == [[(0, 8)], [(8, 16)], [(24, 32)], [(32, 44)], [(44, 48)]]
    assert saved["consumed_samples"] == 24 + 12 + 4 and saved["consumed_tokens"] == 40 * 32
    assert saved["schedule_global_batch"] == 8 and saved["global_batch"] == 4


def test_a_step_reaching_across_a_skipped_range_reads_around_it():
    """A checkpoint saved while a rewind replays the steps before its bad batch (a preemption, a
    halt) lies before the skipped range; resumed under a global batch of 12, a step reaches across
    it. The stream leaves the range out and reads every other sample once, in order: 72..95 and
    104..127 for 4 steps of 12 (hand-counted), not the bad 88..95, not one good sample lost."""
    pos = DataPosition(8, seq_len=4)
    pos.consumed_samples = 72
    pos.skip([(88, 96)])
    resumed = DataPosition(12, seq_len=4)
    resumed.load_state(json.loads(json.dumps(pos.state())))
    read = []
    for _ in range(4):
        read += resumed.step_samples()
        resumed.advance()
    assert read == list(range(72, 88)) + list(range(96, 128))
    assert resumed.step_ranges() == [(128, 140)]
    resumed.consumed_samples = 84  # the step across the range: two pieces, a rewind skips both
    assert resumed.step_ranges() == [(84, 88), (96, 104)]
    resumed.skip(resumed.step_ranges())
    assert resumed.skipped == [(84, 104)]  # merged with the range it touches
    assert resumed.sample_at(84) == 104 and resumed.end_sample(2) == 128
    # one past the last sample read, not past a skipped range that starts right after it (what
    # the run's dataset build is sized by)
    resumed.skip([(128, 136)])
    assert resumed.end_sample(2) == 128


def test_a_resume_asks_for_the_samples_its_run_was_built_with():
    """megatron-core orders a dataset's samples by how many are asked for, so a resume must ask for
    the number its run was built with. 78 steps of 2 samples with up to 5 rewinds: 156 + 10. After
    a rewind over step 3's batch and a checkpoint at step 5, the rest of the run still ends by
    sample 166 (it asked for 170 when the skipped batch was added on top: another order once that
    crossed an epoch). A global batch of 6 from there needs more: 10 + 73 x 6 + 2 skipped, + 4
    rewinds of 6."""
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import _samples_needed

    t = load_config(None, ["train.max_steps=78", "train.max_skips=5",
                           "train.skip_window=100"]).train
    pos = DataPosition(2, seq_len=4)
    assert _samples_needed(pos, 78, t, bad_steps=0) == 166
    for _ in range(2):
        pos.advance()
    pos.skip(pos.step_ranges())
    for _ in range(3):
        pos.advance()
    assert _samples_needed(pos, 78 - 5, t, bad_steps=1) == 166
    wider = DataPosition(6, seq_len=4)
    wider.load_state(pos.state())
    assert _samples_needed(wider, 73, t, bad_steps=1) == 10 + 73 * 6 + 2 + 4 * 6


def test_data_position_reads_a_checkpoint_from_before_consumed_samples():
    """trainer_state.json of step 5 at 6 samples per step (tokens_seen = 5 x 6 x 32) with batch 2
    skipped by a rewind: its steps read batches 0, 1, 3, 4 and 5, so it continues at batch 6, sample
    36."""
    pos = DataPosition(4, seq_len=32)
    pos.load_state({"step": 5, "tokens_seen": 5 * 6 * 32, "skipped_batches": [2],
                    "bad_steps_total": 1})
    assert (pos.consumed_samples, pos.schedule_batch, pos.skipped) == (30, 6, [(12, 18)])
    assert pos.next_sample() == 36 and pos.schedule_step() == 5.0


def test_weighted_blend_and_separate_valid_paths(corpus):
    import torch.distributed as dist

    root, _, prefixes = corpus
    cfg = _cfg(root, paths=["0.7", prefixes["a"], "0.3", prefixes["b"]],
               valid_paths=[prefixes["v"]])
    train, valid, _ = build_datasets(cfg, 16, 3, 100, 8)
    assert type(train).__name__ == "BlendedDataset" and len(train) == 100
    assert type(valid).__name__ == "DocumentGPTDataset"
    assert valid.dataset.path_prefix == prefixes["v"]
    share_a = np.mean(np.asarray(train.dataset_index) == 0)
    assert 0.6 < share_a < 0.8
    assert not dist.is_initialized()  # the throw-away single-process group is gone
    again, _, _ = build_datasets(cfg, 16, 3, 100, 8)  # cached indices: identical samples
    assert torch.equal(get_batch(train, range(10))["tokens"], get_batch(again, range(10))["tokens"])


def test_one_weighted_prefix_builds_in_one_process(corpus):
    """`data.paths=["1.0", PREFIX]` in a one-process run: the same samples as the bare prefix.
    megatron-core blended the one dataset, which needs a process group, and the run failed with
    "Default process group has not been initialized"."""
    root, _, prefixes = corpus
    weighted, _, _ = build_datasets(_cfg(root, paths=["1.0", prefixes["a"]], split="90,10,0"),
                                    16, 7, 50, 5)
    bare, _, _ = build_datasets(_cfg(root, paths=[prefixes["a"]], split="90,10,0"), 16, 7, 50, 5)
    assert torch.equal(get_batch(weighted, range(50))["tokens"],
                       get_batch(bare, range(50))["tokens"])


def test_an_unweighted_blend_holds_the_samples_asked_for(corpus):
    """Two prefixes without weights are weighted by their tokens and hold the samples asked for
    (megatron-core built one epoch of each, 20 here, and a run then read it again in the same
    order)."""
    root, _, prefixes = corpus
    a, b = (check_prefix(prefixes[k])["tokens"] for k in ("a", "b"))
    train, _, _ = build_datasets(_cfg(root, paths=[prefixes["a"], prefixes["b"]],
                                      split="90,10,0"), 16, 3, 500, 8)
    assert len(train) >= 500
    share_a = np.mean(np.asarray(train.dataset_index) == 0)
    assert abs(share_a - a / (a + b)) < 0.01, (share_a, a / (a + b))


def test_a_preprocessed_again_prefix_rebuilds_its_cached_indices(corpus, tmp_path):
    """`tandem preprocess --overwrite` of a prefix with more documents, then a run with the same
    cache directory: its samples come from every new document, as with a fresh cache (megatron-core
    keyed its cached indices on the path alone, and the run kept reading the first 20)."""
    root, tok_path, _ = corpus
    src, prefix = tmp_path / "grow.jsonl", str(tmp_path / "grow")
    first, more = _docs(20, 5), _docs(180, 6)
    for docs in (first, first + more):
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        preprocess([str(src)], prefix, tokenizer=tok_path, overwrite=True)
        train, _, _ = build_datasets(_cfg(tmp_path, paths=[prefix], split="100,0,0",
                                          tokenizer=tok_path), 16, 1, 100, None)
        assert sorted(set(int(d) for d in train.document_index)) == list(range(len(docs)))
        stream, starts = _concat_in_document_order(train)
        for i in (0, len(train) - 1):
            doc, offset = train.sample_index[train.shuffle_index[i]]
            want = stream[starts[doc] + offset: starts[doc] + offset + 17]
            assert get_batch(train, [i])["tokens"][0].tolist() == want.tolist()


def _build_on_a_node_with_another_copy(rank, prefix, tok_path, cache, store, out):
    """A rank of a gloo world of 2 sharing `cache`; rank 1 sees the .idx with another modification
    time, as a node-local copy made without -p does."""
    import torch.distributed as dist

    from tandem.data_pipeline import megatron_compat as mc

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        if rank == 1:
            real = mc.local_fingerprint
            mc.local_fingerprint = lambda ps: [[p, n, t + 10**9] for p, n, t in real(ps)]
        cfg = DataConfig(source="megatron", cache_dir=cache, paths=[prefix], split="100,0,0",
                         tokenizer=tok_path)
        train, _, _ = build_datasets(cfg, 16, 1, 100, None)
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(get_batch(train, [0, 5])["tokens"].tolist()))
    finally:
        dist.destroy_process_group()


def test_node_local_copies_of_the_data_share_rank_0s_cached_indices(corpus, tmp_path):
    """Each rank keyed megatron-core's index cache on its own copy's modification time: the other
    node's ranks looked for indices rank 0 had built under another key (FileNotFoundError)."""
    import torch.multiprocessing as mp

    root, tok_path, prefixes = corpus
    out = str(tmp_path / "batch")
    mp.spawn(_build_on_a_node_with_another_copy, nprocs=2,
             args=(prefixes["b"], tok_path, str(tmp_path / "cache"), str(tmp_path / "store"),
                   out))
    assert open(f"{out}.0").read() == open(f"{out}.1").read()


def test_a_torn_cached_index_is_rebuilt(corpus, tmp_path, capsys):
    """A cached shuffle index cut short (a full disk during megatron-core's in-place write) is
    named, removed and built again: the run reads what a whole cache gives (it had failed every
    later run with "mmap length is greater than file size")."""
    root, tok_path, prefixes = corpus
    cfg = DataConfig(source="megatron", cache_dir=str(tmp_path), paths=[prefixes["a"]],
                     split="90,10,0", tokenizer=tok_path)
    whole, _, _ = build_datasets(cfg, 16, 2, 100, 8)
    want = get_batch(whole, range(len(whole)))["tokens"]
    [shuffle] = [str(p) for p in (tmp_path / "indices").glob("*-train-shuffle_index.npy")]
    intact = open(shuffle, "rb").read()
    with open(shuffle, "r+b") as f:
        f.truncate(len(intact) - 200)
    capsys.readouterr()
    again, _, _ = build_datasets(cfg, 16, 2, 100, 8)
    assert f"{shuffle} is torn" in capsys.readouterr().err
    assert open(shuffle, "rb").read() == intact
    assert torch.equal(get_batch(again, range(len(again)))["tokens"], want)


def test_a_blend_of_prefixes_made_with_other_tokenizers_is_refused(corpus, tmp_path):
    """Prefix b made with a tokenizer of the same vocabulary size and EOD as a's but other ids (two
    tokens swapped) is refused, naming both tokenizer files: the blend had trained b's ids as a's
    tokens. The same tokenizer as a Hugging Face directory (an indented tokenizer.json, whose
    post-processor transformers rewrites as it loads) still trains."""
    root, tok_path, prefixes = corpus
    spec = json.load(open(tok_path, encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    x, y = sorted(vocab)[100:102]
    vocab[x], vocab[y] = vocab[y], vocab[x]
    other, same = tmp_path / "other.json", tmp_path / "hf"
    other.write_text(json.dumps(spec), encoding="utf-8")
    same.mkdir()
    (same / "tokenizer.json").write_text(json.dumps(json.load(open(tok_path, encoding="utf-8")),
                                                    indent=2), encoding="utf-8")
    (same / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    swapped, ours = load_tokenizer(str(other)), load_tokenizer(tok_path)
    assert (swapped.vocab_size, swapped.eod_id) == (ours.vocab_size, ours.eod_id)
    assert swapped.encode(x) != ours.encode(x)
    src = tmp_path / "b.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(40, 2)),
                   encoding="utf-8")
    b = str(tmp_path / "b")
    preprocess([str(src)], b, tokenizer=str(other))
    with pytest.raises(ValueError, match=rf"dataset {b} .*{b}\.tokenizer\.json differs from "
                                         rf"{prefixes['a']}\.tokenizer\.json"):
        build_datasets(_cfg(tmp_path, paths=[prefixes["a"], b]), 16, 0, 10, 2)
    assert json.loads(load_tokenizer(str(same)).to_json_str())["post_processor"] is not None
    c = str(tmp_path / "c")
    preprocess([str(src)], c, tokenizer=str(same))
    for paths in ([prefixes["a"]], [prefixes["a"], c]):
        train, _, _ = build_datasets(_cfg(tmp_path, paths=paths, tokenizer=str(same),
                                          split="90,10,0"), 16, 0, 10, 2)
        assert len(train) >= 10


def test_parse_blend(tmp_path):
    # a dataset whose path holds a space is one prefix (it was split into two)
    spaced = tmp_path / "my corpus" / "a"
    spaced.parent.mkdir()
    (tmp_path / "my corpus" / "a.idx").write_bytes(b"")
    assert parse_blend([str(spaced)]) == ([str(spaced)], None)
    assert parse_blend(["/p/a"]) == (["/p/a"], None)
    assert parse_blend(["/p/a.bin", "/p/b"]) == (["/p/a", "/p/b"], None)
    assert parse_blend(["0.7", "/p/a", "0.3", "/p/b"]) == (["/p/a", "/p/b"], [0.7, 0.3])
    assert parse_blend(["0.7 /p/a 0.3 /p/b"]) == (["/p/a", "/p/b"], [0.7, 0.3])
    assert parse_blend(["2", "/p/a"]) == (["/p/a"], None)  # one prefix: its weight weighs nothing
    with pytest.raises(ValueError):
        parse_blend(["0.7", "/p/a", "/p/b"])


# --------------------------------------------------------------------------------------------------
# Errors, before any expensive work


def _copy_prefix(src, dst):
    for ext in (".bin", ".idx"):
        with open(src + ext, "rb") as f, open(dst + ext, "wb") as g:
            g.write(f.read())


def test_missing_prefix_names_the_file(corpus, tmp_path):
    root, _, prefixes = corpus
    with pytest.raises(FileNotFoundError, match=r"nothere\.bin and .*nothere\.idx"):
        build_datasets(_cfg(root, paths=[str(tmp_path / "nothere")]), 16, 0, 10, 2)
    p = str(tmp_path / "half")
    _copy_prefix(prefixes["a"], p)
    os.unlink(p + ".idx")
    with pytest.raises(FileNotFoundError, match=r"half\.idx"):
        check_prefix(p)


def test_truncated_bin_is_detected(corpus, tmp_path):
    root, tok_path, prefixes = corpus
    p = str(tmp_path / "trunc")
    _copy_prefix(prefixes["a"], p)
    check_prefix(p)
    size = os.path.getsize(p + ".bin")
    with open(p + ".bin", "r+b") as f:
        f.truncate(size - 6)
    with pytest.raises(ValueError, match=r"trunc\.bin is truncated or corrupt"):
        build_datasets(_cfg(root, paths=[p], tokenizer=tok_path), 16, 0, 10, 2)


def test_idx_with_other_version_or_dtype_is_rejected(corpus, tmp_path):
    _, _, prefixes = corpus
    p = str(tmp_path / "ver")
    _copy_prefix(prefixes["a"], p)
    raw = bytearray(open(p + ".idx", "rb").read())
    bad_version = raw[:9] + struct.pack("<Q", 2) + raw[17:]
    open(p + ".idx", "wb").write(bad_version)
    with pytest.raises(ValueError, match="version 2"):
        check_prefix(p)
    bad_dtype = raw[:17] + bytes([7]) + raw[18:]  # float32 tokens
    open(p + ".idx", "wb").write(bad_dtype)
    with pytest.raises(ValueError, match="dtype code 7"):
        check_prefix(p)
    open(p + ".idx", "wb").write(raw)
    with pytest.raises(ValueError, match="too narrow"):
        check_prefix(p, vocab_size=100_000)  # uint16 tokens cannot hold this vocabulary


def test_vocab_larger_than_model_is_rejected(corpus):
    root, tok_path, prefixes = corpus
    tok = load_tokenizer(tok_path)
    check_vocab(tok.path, tok.vocab_size, tok.vocab_size)
    with pytest.raises(ValueError, match=rf"tok\.json has vocab_size={tok.vocab_size}, larger than "
                                         r"model.vocab_size=256"):
        check_vocab(tok.path, tok.vocab_size, 256)
    with pytest.raises(ValueError, match="256"):
        build_datasets(_cfg(root, paths=[prefixes["a"]]), 16, 0, 10, 2, model_vocab_size=256)


def test_missing_tokenizer_is_clear(corpus, tmp_path):
    root, _, prefixes = corpus
    p = str(tmp_path / "notok")
    _copy_prefix(prefixes["a"], p)  # no .tokenizer.json / .meta.json beside it
    with pytest.raises(FileNotFoundError, match=r"notok\.tokenizer\.json.*data\.tokenizer"):
        build_datasets(_cfg(root, paths=[p]), 16, 0, 10, 2)


def test_a_split_that_rounds_to_no_sequence_of_a_prefix_is_refused():
    from tandem.data_pipeline.dataset import _check_split_shares
    matrix = [(0.0, 0.99), (0.99, 1.0), None]  # split 99,1,0
    # 10 sequences: megatron-core cuts round(9.9) = 10 for training, round(10) - 10 = 0 for
    # validation
    with pytest.raises(ValueError, match="validation split none"):
        _check_split_shares("99,1,0", matrix, [100, 10, None], {"/d/p": 10})
    _check_split_shares("99,1,0", matrix, [100, 10, None], {"/d/p": 200})  # 2 sequences: fine
    _check_split_shares("99,1,0", matrix, [100, None, None], {"/d/p": 10})  # none asked for
