"""The megatron-core imports of the data layer, kept in one module so importing it is a deliberate,
lazy step (megatron-core takes seconds to import and warns about Transformer Engine/Apex).

`MegatronTokenizerAdapter` presents a `TandemTokenizer` as the `MegatronTokenizerBase` that
`GPTDatasetConfig(tokenizer=...)` expects: `vocab_size`, `eod`, `unique_identifiers` (hashed into the
sample-index cache key), `tokenize`/`detokenize`. It has no `pad`, so GPTDataset pads with -1 (never a
real id) and masks padding out of the loss.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizerBase

from tandem.data_pipeline.tokenizer import TandemTokenizer

__all__ = [
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "DType",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "MegatronTokenizerAdapter",
]


class MegatronTokenizerAdapter(MegatronTokenizerBase):
    """A `TandemTokenizer` in the shape megatron-core's GPT dataset config accepts."""

    def __init__(self, tokenizer: TandemTokenizer) -> None:
        super().__init__(tokenizer.path, {})
        self.tokenizer = tokenizer
        self.unique_identifiers = OrderedDict(
            [
                ("class", "tandem.MegatronTokenizerAdapter"),
                ("tokenizer_path", str(tokenizer.path)),
                ("vocab_size", tokenizer.vocab_size),
                ("eod", tokenizer.eod_id),
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
