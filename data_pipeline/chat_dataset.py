"""`data.source=jsonl`: prompt/response and chat records tokenised in the loop, packed or padded
into windows of `data.seq_len + 1` tokens with the loss on responses only (data_pipeline/chat.py).

* `data.packing=pack`: records (each ending in EOD) back to back; window i is tokens [i*seq_len,
  i*seq_len + seq_len + 1) of the stream (Megatron's one-token overlap), the last one padded.
* `data.packing=pad`: one record per window, padded; a record longer than the window is refused,
  naming its file and line, before any window is built.
Every sample carries `doc_ids` (the record ordinal of each token, counted from the window's first
record, padding one more), so `get_batch` passes record boundaries to the model as they are, and no
target of any MTP depth crosses from one record into the next; padding is EOD with loss mask 0, and
`padding` marks it, so that MoE layers leave it out of their loads and auxiliary losses.

Records are shuffled once with `train.seed` (train and validation are drawn from the shuffled
records when `data.valid_paths` is empty, by `data.split`); sample i of a run past the end wraps
around (`get_batch` takes indices modulo the length). For corpora too large to tokenise at start-up,
write a Megatron dataset with `tandem preprocess --chat` and train with `data.source=megatron`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tandem.data_pipeline.chat import chat_encoder, check_files, iter_encoded
from tandem.data_pipeline.tokenizer import TandemTokenizer, load_tokenizer

Encoded = Tuple[str, np.ndarray, np.ndarray]
"""(where, ids, response flags) of one record, as `chat.iter_encoded` yields it."""


def check_fit(records: Sequence[Encoded], seq_len: int) -> None:
    """Padding: raise ValueError naming the first record (in file order) longer than a window."""
    for where, ids, _ in records:
        if len(ids) > seq_len + 1:
            raise ValueError(f"{where}: a record of {len(ids)} tokens (with its EOD) is longer "
                             "than "
                             f"data.seq_len={seq_len} + 1; use data.packing=pack or a larger "
                             "data.seq_len")


class ChatWindows:
    """Windows of seq_len+1 tokens over encoded records; item i is a dict of `tokens`, `labels`,
    `loss_mask`, `position_ids`, `padding` ([seq_len]) and `doc_ids` ([seq_len+1])."""

    def __init__(self, records: Sequence[Encoded], seq_len: int, packing: str, eod_id: int) -> None:
        if packing not in ("pack", "pad"):
            raise ValueError(f"data.packing={packing!r} must be pack or pad")
        self.seq_len, self.eod_id = int(seq_len), int(eod_id)
        width = self.seq_len + 1
        if packing == "pad":
            check_fit(records, self.seq_len)
            self.tokens, self.flags, self.docs, self.padding = self._padded(records, width)
        else:
            self.tokens, self.flags, self.docs, self.padding = self._packed(records, width)
        self.record_prompts = [self._prompt(ids, resp) for _, ids, resp in records]
        """Each record's prompt (eval/metrics.py validation_inputs): what the evaluator decodes
        from, as a server is asked. A window's first tokens start mid-record, and hold the response
        the run learns."""

    @staticmethod
    def _prompt(ids: np.ndarray, resp: np.ndarray) -> Tuple[np.ndarray, bool]:
        """(tokens, whether they end where a response starts): the tokens before the first
        response token; a record learnt from its first token (plain text) gives its text, and one
        without a response all but its EOD."""
        first = int(np.argmax(resp)) if resp.any() else len(ids) - 1
        if first == 0:
            return ids[:-1], False
        return ids[:first], True

    def _padded(self, records: Sequence[Encoded], width: int):
        n = len(records)
        tokens = np.full((n, width), self.eod_id, dtype=np.int64)
        flags = np.zeros((n, width), dtype=np.uint8)
        # padding: a document of its own after the record
        docs = np.ones((n, width), dtype=np.int64)
        for row, (_, ids, resp) in enumerate(records):
            tokens[row, : len(ids)], flags[row, : len(ids)], docs[row, : len(ids)] = ids, resp, 0
        return tokens, flags, docs, docs == 1

    def _packed(self, records: Sequence[Encoded], width: int):
        ids = np.concatenate([r[1] for r in records])
        resp = np.concatenate([r[2] for r in records])
        ordinals = np.repeat(np.arange(len(records), dtype=np.int64), [len(r[1]) for r in records])
        n = max(1, -(-(len(ids) - 1) // self.seq_len))  # ceil: the last window is padded
        total = n * self.seq_len + 1
        pad = total - len(ids)
        ids = np.concatenate([ids, np.full(pad, self.eod_id, dtype=np.int64)])
        resp = np.concatenate([resp, np.zeros(pad, dtype=np.uint8)])
        ordinals = np.concatenate([ordinals, np.full(pad, len(records), dtype=np.int64)])
        starts = np.arange(n)[:, None] * self.seq_len + np.arange(width)[None, :]
        docs = ordinals[starts]
        return ids[starts], resp[starts], docs - docs[:, :1], docs == len(records)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        window = torch.from_numpy(self.tokens[i])
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            # the flag of each target (token t+1): prompts, padding and other records' text never
            # count
            "loss_mask": torch.from_numpy(self.flags[i][1:].astype(np.float32)),
            "position_ids": torch.arange(self.seq_len),
            "doc_ids": torch.from_numpy(self.docs[i]),
            # the inputs (tokens 0..seq_len-1) that are padding
            "padding": torch.from_numpy(self.padding[i][:-1]),
        }


def split_records(records: List[Encoded], split: str, seed: int) -> Tuple[List[Encoded],
                                                                          List[Encoded]]:
    """(train, validation) records: shuffled with `seed`, validation the `split` share (Megatron's
    "train,valid,test" weights; the test share is left unused). Records with the same prompt (its
    tokens outside the response: `tandem generate --samples-per-prompt` writes several, and so do
    conversations that share their turns) go to one split together, at the place of the first of
    them in the shuffle: split apart, the validation figures were on prompts the run trained on.
    Records that share no prompt split exactly as each one alone."""
    weights = ([float(w) for w in str(split).replace("/", ",").split(",")] + [0.0, 0.0])[:3]
    order = np.random.default_rng(int(seed)).permutation(len(records))
    groups: dict = {}
    for i in order:
        # every record ends with the EOD, a target only where the response ended there: without
        # it, a cut-off sample and a finished one of the same prompt keyed two groups
        ids, flags = records[i][1][:-1], records[i][2][:-1]
        prompt = ids[flags == 0]
        groups.setdefault(prompt.tobytes() if len(prompt) else int(i), []).append(records[i])
    n_valid, n_test = (int(round(len(records) * w / max(sum(weights), 1e-9))) for w in weights[1:])
    n_train = max(len(records) - n_valid - n_test, 0)
    train, valid = [], []
    for members in groups.values():
        if len(train) < n_train:
            train += members
        elif len(valid) < n_valid:
            valid += members
    return train, valid


def build_chat_datasets(data_cfg, seq_len: int, seed: int) -> Tuple[ChatWindows,
                                                                    Optional[ChatWindows],
                                                                      TandemTokenizer]:
    """`(train_ds, valid_ds or None, tokenizer)` of `data.source=jsonl`: `data_cfg.paths` (and
    `valid_paths`) read, every record checked, then tokenised (see the module docstring)."""
    if not data_cfg.tokenizer:
        raise ValueError("data.source=jsonl needs data.tokenizer (or model.init_from with a "
                         "tokenizer)")
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    encoder = chat_encoder(tokenizer, data_cfg.tokenizer)
    for paths in (data_cfg.paths, data_cfg.valid_paths):
        if paths:
            check_files(paths, encoder)  # every line's form before any tokenising
    records = list(iter_encoded(data_cfg.paths, encoder))
    valid = list(iter_encoded(data_cfg.valid_paths, encoder)) if data_cfg.valid_paths else []
    if data_cfg.packing == "pad":
        # before shuffling: the first too-long line of the files
        check_fit(records + valid, seq_len)
    if data_cfg.valid_paths:
        order = np.random.default_rng(int(seed)).permutation(len(records))
        train = [records[i] for i in order]
    else:
        train, valid = split_records(records, data_cfg.split, seed)
    if not train:
        raise ValueError(f"the training split of {', '.join(data_cfg.paths)} is empty "
                         f"(split={data_cfg.split!r})")
    if not any(flags.any() for _, _, flags in train):
        # every loss would be 0 / 0: the run trained nothing and reported loss 0
        raise ValueError(f"the training split of {', '.join(data_cfg.paths)} holds no response "
                         "token (every record's response is empty): nothing to train on")
    make = lambda recs: ChatWindows(recs, seq_len, data_cfg.packing, tokenizer.eod_id)  # noqa: E731
    return make(train), (make(valid) if valid else None), tokenizer
