"""The megatron-core classes of the data layer, kept in one module so importing it is a deliberate,
lazy step (megatron_import.py imports them).

`MegatronTokenizerAdapter` presents a `TandemTokenizer` as the `MegatronTokenizerBase` that
`GPTDatasetConfig(tokenizer=...)` expects: `vocab_size`, `eod`, `unique_identifiers` (hashed into
the sample-index cache key, with the data files' `data_fingerprint`), `tokenize`/`detokenize`. It
has no `pad`, so GPTDataset pads with -1 (never a real id) and masks padding out of the loss.
`DocumentGPTDataset` is the GPTDataset whose samples carry `doc_ids` from the stored documents, and
that reads a prefix's loss-mask channel (`tandem preprocess --chat`) where it has one.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import List, Sequence

import numpy as np
import torch
import torch.distributed as dist

from tandem.data_pipeline.chat import LOSS_MASK_SUFFIX
from tandem.data_pipeline.megatron_import import (
    BlendedDataset,
    BlendedMegatronDatasetBuilder,
    DType,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    MegatronTokenizerBase,
)
from tandem.data_pipeline.tokenizer import TandemTokenizer

__all__ = [
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "DType",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "LOSS_MASK_SUFFIX",
    "DocumentGPTDataset",
    "MegatronTokenizerAdapter",
]


def local_fingerprint(prefixes: Sequence[str]) -> List[list]:
    """[prefix, .idx size, .idx mtime in ns] of each prefix, as this process sees the files."""
    return [[p, (st := os.stat(p + ".idx")).st_size, st.st_mtime_ns] for p in prefixes]


def data_fingerprint(prefixes: Sequence[str]) -> List[list]:
    """[prefix, .idx size, .idx mtime in ns] of each prefix. megatron-core keys its sample-index
    cache on a dataset's path and settings, not on its files: after `tandem preprocess --overwrite`
    rewrote a prefix, a run reused the old document, sample and shuffle indices (windows cut at the
    old documents' lengths, or most of an appended corpus never read). The indices depend only on
    the .idx file (the documents' lengths), so its size and modification time join the key; a copy
    that does not keep modification times rebuilds the indices once.

    Under a process group every rank takes rank 0's (collective; megatron-core's build is
    collective already): rank 0 builds the indices under its key and the other ranks load them, and
    node-local copies of the data (`cp` without -p, or an rsync keeping seconds) have other
    modification times, so the other nodes looked under another key for indices that were never
    built (a FileNotFoundError naming a .npy)."""
    out = local_fingerprint(prefixes)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    return out


class MegatronTokenizerAdapter(MegatronTokenizerBase):
    """A `TandemTokenizer` in the shape megatron-core's GPT dataset config accepts."""

    def __init__(self, tokenizer: TandemTokenizer, prefixes: Sequence[str] = ()) -> None:
        """`prefixes`: the datasets built with this config, whose files join the cache key."""
        super().__init__(tokenizer.path, {})
        self.tokenizer = tokenizer
        self.unique_identifiers = OrderedDict(
            [
                ("class", "tandem.MegatronTokenizerAdapter"),
                ("tokenizer_path", str(tokenizer.path)),
                ("vocab_size", tokenizer.vocab_size),
                ("eod", tokenizer.eod_id),
                ("data_files", data_fingerprint(prefixes)),
            ]
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eod(self) -> int:
        return self.tokenizer.eod_id

    @property
    def eos(self) -> int:
        return self.tokenizer.eod_id

    @property
    def vocab(self):
        return self.tokenizer._get_vocab()

    def tokenize(self, text: str):
        return self.tokenizer.encode(text)

    def detokenize(self, ids):
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("Tandem pretraining tokenizers have no chat template")


def has_loss_mask_channel(prefix: str) -> bool:
    """Whether `prefix` has a loss-mask channel (`<prefix>_loss_mask.bin` and `.idx`)."""
    return all(os.path.isfile(prefix + LOSS_MASK_SUFFIX + ext) for ext in (".bin", ".idx"))


class DocumentGPTDataset(GPTDataset):
    """A `GPTDataset` whose samples carry the document each token belongs to, and read the
    loss-mask channel where the prefix has one: a second indexed dataset of uint8 flags with the
    tokens' document lengths, read over the same document/sample/shuffle indices.

    Each sample gains `doc_ids` ([seq_len+1]: the ordinal of the stored document each token belongs
    to, from megatron's own boundaries, not from EOD counting: a chat template may hold the EOD
    token inside a record, and a prefix written by megatron's `preprocess_data.py` without
    `--append-eod`, its default, has no EOD between documents at all) and its `loss_mask` is
    multiplied by the flag of each target. A prefix without a channel counts every target (its
    flags are ones)."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                 config) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                         config)
        self.mask_dataset = None
        if dataset_path and has_loss_mask_channel(dataset_path):
            self.mask_dataset = IndexedDataset(dataset_path + LOSS_MASK_SUFFIX,
                                               mmap=config.mmap_bin_files)

    def __getitem__(self, idx):
        sample = super().__getitem__(idx)  # also memory-maps the indices _flags_and_documents reads
        flags, doc_ids = self._flags_and_documents(0 if idx is None else idx)
        sample["loss_mask"] = sample["loss_mask"] * torch.from_numpy(flags[1:]).float()
        sample["doc_ids"] = torch.from_numpy(doc_ids)
        return sample

    def _flags_and_documents(self, idx: int):
        """(flags uint8, doc ordinals int64) of sample `idx`'s seq_len+1 tokens: the walk of
        `GPTDataset._query_document_sample_shuffle_indices` over the channel; padding gets flag 0
        and an ordinal of its own."""
        idx = self.shuffle_index[idx]
        beg, beg_offset = self.sample_index[idx]
        end, end_offset = self.sample_index[idx + 1]
        extra = self.config.add_extra_token_to_sequence
        flags, docs = [], []
        for ordinal, i in enumerate(range(beg, end + 1)):
            doc = self.document_index[i]
            offset = int(beg_offset) if i == beg else 0
            length = None if i < end else int(end_offset) + extra - offset
            if self.mask_dataset is not None:
                part = self.mask_dataset.get(doc, offset=offset, length=length)
            else:
                part = np.ones(self.dataset.sequence_lengths[doc] - offset if length is None
                               else length, np.uint8)
            flags.append(np.asarray(part, dtype=np.uint8))
            docs.append(np.full(len(part), ordinal, dtype=np.int64))
        want = self.config.sequence_length + extra
        have = sum(map(len, flags))
        if have < want:
            flags.append(np.zeros(want - have, np.uint8))
            docs.append(np.full(want - have, len(docs), dtype=np.int64))
        return np.concatenate(flags), np.concatenate(docs)


def epochs_asked(dataset) -> float:
    """How many epochs of its documents the most-asked part of `dataset` (a GPTDataset, or each
    GPTDataset of a BlendedDataset) was asked to hold: its samples asked for over one epoch's
    windows. Above 1, megatron-core built another epoch, whose windows re-cut the same documents."""
    parts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    asked = 1.0
    for part in parts:
        if part.num_samples is None:
            continue
        tokens = part._get_num_tokens_per_epoch() - part.config.add_extra_token_to_sequence
        asked = max(asked, part.num_samples / max(tokens // part.config.sequence_length, 1))
    return asked
