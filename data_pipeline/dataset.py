"""Training and validation datasets: megatron-core `GPTDataset`s built by
`BlendedMegatronDatasetBuilder`, and the checks of their files and tokenizer.

`build_datasets(data_cfg, seq_len, seed, num_train_samples, num_valid_samples)` returns `(train_ds,
valid_ds, tokenizer)`. Sample `i` of a dataset is a fixed window of `seq_len + 1` tokens (Megatron's
document/sample/shuffle indices, seeded by `seed`, cached as .npy files under `cache_path`).
data_pipeline/batches.py turns sample indices into batches (`get_batch`, `batch_indices`,
`DataPosition`).

Under torchrun every rank calls `build_datasets`; megatron-core builds the sample-index cache on
global rank 0 first, then a barrier, then the other ranks load it (so the cache directory must be
shared by all nodes). Without a process group everything runs in-process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch.distributed as dist

from tandem.data_pipeline.chat import LOSS_MASK_SUFFIX
from tandem.data_pipeline.chat_dataset import build_chat_datasets
from tandem.data_pipeline.preprocess import output_paths, read_meta
from tandem.data_pipeline.stdlib_corpus import prepare_stdlib_corpus, stdlib_cache_dir
from tandem.data_pipeline.tokenizer import TandemTokenizer, load_tokenizer, tokenizer_fingerprint

_IDX_MAGIC = b"MMIDIDX\x00\x00"
# megatron-core DType codes of integer token types -> numpy dtype
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


# --------------------------------------------------------------------------------------------------
# Checks that fail fast with one-line messages


def check_vocab(path: str, vocab_size: int, model_vocab_size: int) -> None:
    """Raise ValueError if the ids of the tokenizer at `path` (`vocab_size` of them) do not fit the
    model's embedding table."""
    if vocab_size > int(model_vocab_size):
        raise ValueError(
            f"tokenizer {path} has vocab_size={vocab_size}, larger than "
            f"model.vocab_size={model_vocab_size}; raise model.vocab_size or use a smaller "
            "tokenizer"
        )


def normalize_prefix(path: str) -> str:
    """`~` expanded, absolute, and without a trailing `.bin` / `.idx`."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def check_prefix(prefix: str, vocab_size: Optional[int] = None) -> dict:
    """Validate an indexed dataset without loading it; return {sequences, documents, tokens,
    itemsize, lengths} (`lengths`: each sequence's token count, read from the .idx).

    FileNotFoundError names a missing .bin/.idx; ValueError names a truncated/corrupt .idx or .bin
    (the .bin size must equal what the .idx describes), an .idx of another version or token dtype,
    or a token dtype too narrow for `vocab_size`.
    """
    prefix = normalize_prefix(prefix)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"dataset {prefix}: missing {' and '.join(missing)} (run `tandem "
                                "preprocess` to create "
                                "it)")
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != _IDX_MAGIC:
            raise ValueError(f"{idx_path} is not a Megatron indexed-dataset index (bad or "
                             "truncated header)")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != 1:
            raise ValueError(f"{idx_path} has index version {version}; only version 1 "
                             "(megatron-core MMIDIDX) is "
                             "supported")
        code = head[17]
        if code not in _IDX_DTYPES:
            raise ValueError(f"{idx_path} stores tokens with dtype code {code}, not an integer "
                             "type (1-5, 8)")
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        need = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_size < need:
            raise ValueError(f"{idx_path} is truncated: {idx_size} bytes, its header describes "
                             f"{need}")
        lengths = np.fromfile(f, dtype=np.int32, count=n_seq)
        f.seek(34 + n_seq * 12)
        doc_idx = np.fromfile(f, dtype=np.int64, count=n_doc)
    if n_doc < 1 or doc_idx[0] != 0 or doc_idx[-1] != n_seq:
        raise ValueError(f"{idx_path} is corrupt: its document index does not cover its {n_seq} "
                         "sequences")
    dtype = np.dtype(_IDX_DTYPES[code])
    tokens = int(lengths.sum(dtype=np.int64))
    expect = tokens * dtype.itemsize
    actual = os.path.getsize(bin_path)
    if actual != expect:
        raise ValueError(
            f"{bin_path} is truncated or corrupt: {actual} bytes, but {idx_path} describes "
            f"{tokens} {dtype.name} "
            f"tokens = {expect} bytes; re-run `tandem preprocess`"
        )
    if vocab_size is not None and int(vocab_size) - 1 > np.iinfo(dtype).max:
        raise ValueError(f"{idx_path} stores {dtype.name} tokens, too narrow for a vocabulary of "
                         f"{vocab_size}")
    return {"sequences": int(n_seq), "documents": int(n_doc - 1), "tokens": tokens,
            "itemsize": dtype.itemsize, "lengths": lengths}



def check_loss_mask_channel(prefix: str) -> None:
    """Raise ValueError when `prefix`'s loss-mask channel does not describe its tokens'
    documents."""
    tokens, flags = check_prefix(prefix), check_prefix(prefix + LOSS_MASK_SUFFIX)
    if (tokens["sequences"], tokens["tokens"]) != (flags["sequences"], flags["tokens"]):
        raise ValueError(f"{prefix}{LOSS_MASK_SUFFIX}.idx describes {flags['sequences']} documents "
                         "of "
                         f"{flags['tokens']} tokens, but {prefix}.idx {tokens['sequences']} of "
                         f"{tokens['tokens']}; "
                         "re-run `tandem preprocess --chat`")
    # the same totals over other documents would put each flag on another token
    differ = np.flatnonzero(tokens["lengths"] != flags["lengths"])
    if len(differ):
        d = int(differ[0])
        raise ValueError(f"{prefix}{LOSS_MASK_SUFFIX}.idx gives document {d} "
                         f"{int(flags['lengths'][d])} tokens, but {prefix}.idx "
                         f"{int(tokens['lengths'][d])}; re-run `tandem preprocess --chat`")

def parse_blend(paths: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron blend syntax -> (prefixes, weights or None).

    `["/p/a", "/p/b"]` (weights from dataset sizes) or `["0.7", "/p/a", "0.3", "/p/b"]`; an element
    may also hold several whitespace-separated items (`"0.7 /p/a 0.3 /p/b"`), unless it names a
    dataset whole (`"/data/my corpus/a"` was split into two prefixes).
    """
    items = [tok for p in paths for tok in ([str(p).strip()] if os.path.isfile(
        normalize_prefix(str(p).strip()) + ".idx") else str(p).split())]
    if not items:
        raise ValueError("empty dataset blend: name at least one dataset prefix")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) % 2 == 0 and all(is_number(w) for w in items[0::2]) and not any(is_number(p) for p
                                                                                  in items[1::2]):
        weights = [float(w) for w in items[0::2]]
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive: {' '.join(items)}")
        # one prefix's weight weighs nothing: kept, megatron-core blended the one dataset, which
        # needs a process group a one-process run does not have
        return [normalize_prefix(p) for p in items[1::2]], weights if len(weights) > 1 else None
    if any(is_number(p) for p in items):
        raise ValueError(f"cannot parse dataset blend {' '.join(items)!r}: use prefixes or "
                         "weight/prefix pairs")
    return [normalize_prefix(p) for p in items], None


def tokenizer_for_prefixes(prefixes: List[str], tokenizer_path: str) -> TandemTokenizer:
    meta = read_meta(prefixes[0])
    eod_token = meta.get("eod_token") if meta else None  # the EOD the data was made with
    if tokenizer_path:
        return load_tokenizer(tokenizer_path, eod_token=eod_token)
    beside = output_paths(prefixes[0])["tokenizer"]
    if not os.path.isfile(beside):
        source = meta.get("tokenizer_source") if meta else None
        if source and os.path.exists(source):
            return load_tokenizer(source, eod_token=eod_token)
        raise FileNotFoundError(f"no tokenizer for dataset {prefixes[0]}: {beside} not found; set "
                                "data.tokenizer")
    return load_tokenizer(beside, eod_token=eod_token)


def data_tokenizer(data_cfg) -> Optional[TandemTokenizer]:
    """The tokenizer `build_datasets` will read `data_cfg`'s data with, when it is known before the
    data is built (`tandem launch slurm` checks it against the model before submitting): a
    Megatron blend's (data.tokenizer, else the one beside or recorded by the first prefix, with the
    end-of-document token the data was made with), else data.tokenizer; None for the embedded
    corpus's own BPE, made as the corpus is prepared."""
    if data_cfg.source == "megatron":
        return tokenizer_for_prefixes(parse_blend(data_cfg.paths)[0], data_cfg.tokenizer)
    return load_tokenizer(data_cfg.tokenizer) if data_cfg.tokenizer else None


def _check_made_with(prefix: str, tokenizer: TandemTokenizer, fingerprint: str) -> None:
    """Refuse `prefix` when its data were made with another tokenizer than the run's (`fingerprint`
    is `tokenizer_fingerprint(tokenizer)`): by `<prefix>.tokenizer.json`'s content where it was
    written, else by the vocabulary size and EOD of its meta file. Two BPEs can share both, and a
    blend of them trained one prefix's ids as another's tokens."""
    beside = output_paths(prefix)["tokenizer"]
    if os.path.isfile(beside) and tokenizer_fingerprint(beside) != fingerprint:
        raise ValueError(f"dataset {prefix} was made with another tokenizer than the run's: "
                         f"{beside} differs from {tokenizer.path} (content fingerprint); "
                         "preprocess it again with that tokenizer")
    meta = read_meta(prefix)
    if meta and (meta.get("eod_id") != tokenizer.eod_id
                 or meta.get("vocab_size") != tokenizer.vocab_size):
        raise ValueError(
            f"dataset {prefix} was made with a tokenizer of vocab_size={meta.get('vocab_size')}, "
            f"eod={meta.get('eod_id')}, "
            f"but {tokenizer.path} has vocab_size={tokenizer.vocab_size}, eod={tokenizer.eod_id}"
        )


# --------------------------------------------------------------------------------------------------
# Building


@contextlib.contextmanager
def _single_process_group_if_needed(needed: bool):
    """megatron-core's BlendedDataset calls torch.distributed.get_rank() even in one process; give
    it a throw-away world of one (gloo, in-memory store) when no process group exists."""

    if not needed or not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _index_build_lock(cache_path: str):
    """megatron-core writes its .npy sample indices in place; serialise builders of *different* jobs
    sharing `cache_path` with an fcntl lock. Only global rank 0 (or a lone process) takes it: the
    other ranks of a job wait for rank 0 at megatron's own barrier."""

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        yield
        return
    os.makedirs(cache_path, exist_ok=True)
    with open(os.path.join(cache_path, ".build.lock"), "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            drop_torn_indices(cache_path)
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def drop_torn_indices(cache_path: str) -> List[str]:
    """Remove the cached `.npy` indices under `cache_path` that numpy cannot map (shorter than their
    header describes, or with no whole header), each with a note naming it; return their paths.

    megatron-core writes its indices in place and takes them as built when the files exist, so one
    torn by a full disk or a killed build failed every later run ("mmap length is greater than file
    size", no file named). Without the file megatron-core builds that split's indices again."""
    torn = []
    for name in sorted(os.listdir(cache_path)):
        path = os.path.join(cache_path, name)
        if not name.endswith(".npy") or not os.path.isfile(path):
            continue
        try:
            np.load(path, mmap_mode="r")  # megatron-core's own read, header and length
        except (ValueError, EOFError):
            os.unlink(path)
            torn.append(path)
            print(f"tandem: note: {path} is torn (an interrupted index build); removed, rebuilding",
                  file=sys.stderr)
    return torn


def build_datasets(
    data_cfg,
    seq_len: int,
    seed: int,
    num_train_samples: int,
    num_valid_samples: Optional[int],
    *,
    model_vocab_size: Optional[int] = None,
    cache_path: Optional[str] = None,
):
    """Build `(train_ds, valid_ds, tokenizer)` for `data_cfg` (a `DataConfig`).

    `source=stdlib` prepares/caches the embedded corpus (`prepare_stdlib_corpus`), tokenized with
    its own byte-level BPE, or with `data.tokenizer` when set (a fine-tuned checkpoint's tokenizer).
    `source=megatron` reads the blend `data_cfg.paths`, split by `data_cfg.split`, or uses
    `data_cfg.valid_paths` as a separate validation blend; the tokenizer is `data_cfg.tokenizer` or
    the `<prefix>.tokenizer.json` beside the first prefix.

    The training dataset holds at least the requested number of samples (Megatron repeats epochs as
    needed); the validation dataset never reads a document twice (one epoch of a single prefix or
    an unweighted blend, a weighted blend cut to what its most-asked prefix holds), however many
    samples are asked for, and `valid_ds` is None when the split gives validation no data. Sample
    indices are cached under `cache_path` (default: `<stdlib cache>/indices` or
    `<data_cfg.cache_dir>/indices`). With `model_vocab_size`, a tokenizer that does not fit the
    model raises ValueError before any work.
    Returns megatron-core datasets whose items are dicts of `tokens`, `labels`, `loss_mask`,
    `position_ids` ([seq_len] each); use `get_batch` to collate.
    """
    # records tokenised here, packed or padded (data_pipeline/chat_dataset.py)
    if data_cfg.source == "jsonl":
        train_ds, valid_ds, tokenizer = build_chat_datasets(data_cfg, seq_len, seed)
        if model_vocab_size is not None:
            check_vocab(tokenizer.path, tokenizer.vocab_size, model_vocab_size)
        return train_ds, valid_ds, tokenizer
    if data_cfg.source == "stdlib" and data_cfg.tokenizer and model_vocab_size is not None:
        # a given tokenizer tokenizes the embedded corpus: checked before that is prepared
        given = load_tokenizer(data_cfg.tokenizer)
        check_vocab(given.path, given.vocab_size, model_vocab_size)
    train_blend, valid_blend, tokenizer, default_cache = _blends_and_tokenizer(data_cfg)
    if model_vocab_size is not None:
        check_vocab(tokenizer.path, tokenizer.vocab_size, model_vocab_size)
    all_prefixes = train_blend[0] + (valid_blend[0] if valid_blend else [])
    sequences, tokens = {}, {}
    fingerprint = tokenizer_fingerprint(tokenizer)
    for p in all_prefixes:
        found = check_prefix(p, tokenizer.vocab_size)
        sequences[p], tokens[p] = found["sequences"], found["tokens"]
        _check_made_with(p, tokenizer, fingerprint)
        if os.path.isfile(p + "_loss_mask.idx"):
            check_loss_mask_channel(p)
    # (a separate validation blend without weights stays so: one epoch of each prefix, below)
    train_blend = _weighted_by_size(train_blend, tokens)

    cache_path = os.path.abspath(os.path.expanduser(cache_path or default_cache))
    config = _gpt_dataset_config(data_cfg, train_blend, valid_blend, tokenizer, seq_len, seed,
                                 cache_path, all_prefixes)
    sizes = _split_sizes(train_blend, valid_blend, num_train_samples, num_valid_samples)
    if valid_blend is None:
        _check_split_shares(data_cfg.split, config.split_matrix, sizes, sequences)
    short = [p for p in (valid_blend or ([], None))[0] if tokens[p] < seq_len + 1]
    if sizes[1] and short:  # no window: the run went on without its evaluation, saying little
        raise ValueError(f"data.valid_paths {short[0]} holds {tokens[short[0]]} tokens, fewer than "
                         f"one window of data.seq_len+1={seq_len + 1}")
    if sizes[1] and (valid_blend or train_blend)[1] is None:
        # one epoch of an unweighted validation split (one prefix, or data.valid_paths without
        # weights), in the order a smaller count gives: a count past it started a second epoch,
        # whose windows re-cut the same documents (a small split's prompts and loss batches read
        # its text twice, and the intervals counted the copies as more prompts); a weighted blend
        # needs its count, cut in _build_splits
        sizes[1] = None
    needs_group = len(train_blend[0]) > 1 or (valid_blend is not None and len(valid_blend[0]) > 1)
    # megatron-core's dataset layer costs about a second to import (megatron_import.py): only here,
    # where its datasets are built (`tandem eval` and `tandem generate`, which import this module,
    # skip it)
    from tandem.data_pipeline import megatron_compat as mc

    with _single_process_group_if_needed(needs_group), _index_build_lock(cache_path):
        train_ds, valid_ds = _build_splits(mc, sizes, config)
    if train_ds is None or len(train_ds) == 0:
        raise ValueError(f"the training split of {', '.join(train_blend[0])} is empty "
                         f"(split={data_cfg.split!r})")
    if valid_ds is not None and len(valid_ds) == 0:
        valid_ds = None
    return train_ds, valid_ds, tokenizer


def _build_splits(mc, sizes: List[Optional[int]], config) -> tuple:
    """(train, validation) datasets of `sizes` samples; a weighted validation blend asked for more
    than a prefix's share holds is built again with fewer samples until no part repeats (a second
    epoch re-cuts the same documents)."""
    def build():
        return mc.BlendedMegatronDatasetBuilder(mc.DocumentGPTDataset, sizes, lambda: True,
                                                config).build()[:2]

    train_ds, valid_ds = build()
    for _ in range(3):
        over = mc.epochs_asked(valid_ds) if valid_ds is not None else 1.0
        if over <= 1.0:
            break
        sizes[1] = max(1, int(sizes[1] / over))
        train_ds, valid_ds = build()
    return train_ds, valid_ds


def _weighted_by_size(blend: _Blend, tokens: Dict[str, int]) -> _Blend:
    """A blend of several prefixes without weights, weighted by their tokens: megatron-core builds
    an unweighted blend as one epoch of each prefix whatever the samples asked for (a run then
    read that epoch again in the same order), a weighted one with the samples asked for."""
    prefixes, weights = blend
    if weights is not None or len(prefixes) == 1:
        return blend
    return prefixes, [float(tokens[p]) for p in prefixes]


def _check_split_shares(split: str, split_matrix, sizes, sequences: Dict[str, int]) -> None:
    """Every split that is asked for samples gets some of each prefix's sequences, cut as
    megatron-core cuts them (`round(bookend x sequences)`): an empty one would never fill its
    samples (megatron-core counts epochs of zero tokens forever)."""
    for i, name in enumerate(("training", "validation")):
        bookends = split_matrix[i]
        if bookends is None or not sizes[i]:
            continue
        for prefix, n in sequences.items():
            if round(bookends[1] * n) <= round(bookends[0] * n):
                raise ValueError(f"config key 'data.split'={split!r} gives the {name} split none "
                                 f"of the {n} sequences of {prefix}; use a larger dataset, "
                                 "data.valid_paths, or another split (100,0,0: no validation)")


_Blend = Tuple[List[str], Optional[List[float]]]
"""(prefixes, weights or None), as `parse_blend` returns it."""


def _blends_and_tokenizer(data_cfg) -> Tuple[_Blend, Optional[_Blend], TandemTokenizer, str]:
    """(train blend, separate validation blend or None, tokenizer, default index cache directory) of
    `data_cfg.source`; for `megatron`, missing dataset files fail before any tokenizer is loaded."""
    if data_cfg.source == "stdlib":
        train_prefix, valid_prefix, tok_path = prepare_stdlib_corpus(data_cfg)
        tokenizer = load_tokenizer(data_cfg.tokenizer or tok_path)
        default_cache = os.path.join(stdlib_cache_dir(data_cfg), "indices")
        return ([train_prefix], None), ([valid_prefix], None), tokenizer, default_cache
    if data_cfg.source == "megatron":
        train_blend = parse_blend(data_cfg.paths)
        valid_blend = parse_blend(data_cfg.valid_paths) if data_cfg.valid_paths else None
        for p in train_blend[0] + (valid_blend[0] if valid_blend else []):
            check_prefix(p)  # missing files before loading any tokenizer
        tokenizer = tokenizer_for_prefixes(train_blend[0], data_cfg.tokenizer)
        default_cache = os.path.join(os.path.abspath(os.path.expanduser(data_cfg.cache_dir)),
                                     "indices")
        return train_blend, valid_blend, tokenizer, default_cache
    raise ValueError(f"data.source={data_cfg.source!r} must be stdlib, megatron or jsonl")


def _gpt_dataset_config(data_cfg, train_blend: _Blend, valid_blend: Optional[_Blend],
                        tokenizer: TandemTokenizer, seq_len: int, seed: int, cache_path: str,
                        prefixes: List[str]):
    """megatron-core's GPTDatasetConfig: a blend per split with a validation blend, else
    `data_cfg.split` of the training blend. `prefixes`: every prefix of both blends (their files
    join the sample-index cache key)."""
    from tandem.data_pipeline import megatron_compat as mc  # (lazily: see build_datasets)

    common = dict(
        random_seed=int(seed),
        sequence_length=int(seq_len),
        path_to_cache=cache_path,
        tokenizer=mc.MegatronTokenizerAdapter(tokenizer, prefixes),
        reset_position_ids=False,
        reset_attention_mask=False,
        # (a target whose input is an EOD is never trained anyway: the model masks every target
        # across a document boundary, models/mtp.py depth_target_mask)
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    if valid_blend is not None:
        return mc.GPTDatasetConfig(blend_per_split=[train_blend, valid_blend, None], **common)
    config = mc.GPTDatasetConfig(blend=train_blend, split=data_cfg.split, **common)
    # Tandem has no test stage: never build the test split (its share of documents stays unused).
    config.split_matrix = [m if i < 2 else None for i, m in enumerate(config.split_matrix)]
    return config


def _split_sizes(train_blend: _Blend, valid_blend: Optional[_Blend], num_train_samples: int,
                 num_valid_samples: Optional[int]) -> List[Optional[int]]:
    """The per-split sample counts (train, validation, test) for BlendedMegatronDatasetBuilder."""
    if valid_blend is not None:
        return [num_train_samples, num_valid_samples, None]
    weighted = train_blend[1] is not None
    return [num_train_samples, num_valid_samples, 0 if weighted else None]


def follow_checkpoint_tokenizer(data_cfg, checkpoint: str,
                                checkpoint_tok: Optional[str]) -> Optional[str]:
    """Tokenizer follows the checkpoint being fine-tuned: with no tokenizer of its own
    (`data.tokenizer` empty; for `source=megatron` the one beside the dataset counts) the run takes
    `checkpoint_tok`; one that differs from it (content fingerprint) is refused, naming both, unless
    `data.force_tokenizer`. Returns the tokenizer now in `data.tokenizer` when it was adopted."""

    if not checkpoint_tok:
        return None
    chosen, key = data_cfg.tokenizer, "data.tokenizer"
    if not chosen and data_cfg.source == "megatron" and data_cfg.paths:
        beside = output_paths(parse_blend(data_cfg.paths)[0][0])["tokenizer"]
        chosen, key = (
            (beside, f"the tokenizer of dataset {data_cfg.paths[0]}")
            if os.path.isfile(beside)
            else ("", key)
        )
    if not chosen:
        data_cfg.tokenizer = checkpoint_tok
        return checkpoint_tok
    if data_cfg.force_tokenizer:
        return None
    if not os.path.exists(os.path.expanduser(chosen)):
        raise FileNotFoundError(f"config key 'data.tokenizer'={chosen!r} does not exist")
    if tokenizer_fingerprint(chosen) != tokenizer_fingerprint(checkpoint_tok):
        raise ValueError(f"tokenizer mismatch: {key}={chosen} differs from {checkpoint_tok}, the "
                         "tokenizer of "
                         f"model.init_from={checkpoint}; drop it to use the checkpoint's, or set "
                         "data.force_tokenizer=true")
    return None
