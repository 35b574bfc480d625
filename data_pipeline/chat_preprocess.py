"""`tandem preprocess --chat`: prompt/response, chat and `tandem generate` records
(data_pipeline/chat.py) -> a Megatron indexed dataset plus its loss-mask channel, for corpora too
large to tokenise in the loop.

Writes what plain `tandem preprocess` writes (`PREFIX.bin/.idx`: one document per record,
EOD-terminated; `PREFIX.tokenizer.json`, `PREFIX.meta.json`) and `PREFIX_loss_mask.bin/.idx`: a
second megatron-core indexed dataset of uint8 flags with the same document lengths (1 = a response
token, whose prediction counts). `data.source=megatron` reads the channel over the same sample
indices (megatron_compat.DocumentGPTDataset) and takes record boundaries from the stored documents,
so no MTP depth's target crosses into the next record even when a chat template holds the EOD token.

Every record is read and checked (form, chat template) before the first is tokenised; a bad one is a
one-line error naming its file and line. The channel is renamed into place before the meta file, the
marker of a complete dataset.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterator, List, Sequence, Union

import numpy as np

from tandem.data_pipeline.chat import (
    LOSS_MASK_SUFFIX,
    ChatEncoder,
    chat_encoder,
    check_files,
    iter_encoded,
    iter_records,
    record_form,
)
from tandem.data_pipeline.preprocess import (
    checked_prefix,
    indexed_dataset_builder,
    output_paths,
    refuse_existing,
    resolve_tokenizer,
    staged_paths,
    token_dtype,
    train_bpe_on_sample,
)
from tandem.data_pipeline.staging import commit, staging_dir
from tandem.data_pipeline.tokenizer import TandemTokenizer


def loss_mask_paths(prefix: str) -> dict:
    """The loss-mask channel's files of `prefix`: keys bin, idx."""
    return {"bin": prefix + LOSS_MASK_SUFFIX + ".bin", "idx": prefix + LOSS_MASK_SUFFIX + ".idx"}


def _texts_for_bpe(paths: Sequence[str]) -> Iterator[str]:
    """The text of every record, for training a byte-level BPE when no tokenizer is given; records
    that need a tokenizer (messages: its chat template; generate ids: the tokenizer that wrote them)
    fail."""
    for where, rec in iter_records(paths):
        form = record_form(where, rec)
        if form in ("messages", "ids"):
            need = "messages need a chat template" if form == "messages" else ("token ids need "
                                                                               "their tokenizer")
            raise ValueError(f"{where}: {need}: pass --tokenizer (a Hugging Face tokenizer "
                             "directory)")
        yield rec["text"] if form == "text" else rec["prompt"] + rec["response"]


def preprocess_chat(
    inputs: Union[str, Sequence[str]],
    output_prefix: str,
    tokenizer: Union[None, str, TandemTokenizer] = None,
    vocab_size: int = 4096,
    *,
    overwrite: bool = False,
    tokenizer_sample_bytes: int = 100_000_000,
    log=None,
) -> dict:
    """Tokenise the records of `inputs` into `output_prefix` with a loss-mask channel; returns the
    summary also written to `<output_prefix>.meta.json`. `tokenizer` as in `preprocess` (None trains
    a BPE on the records' text, for prompt/response and text records only)."""
    t0 = time.time()
    output_prefix = checked_prefix(output_prefix)
    paths: List[str] = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not overwrite:
        refuse_existing(output_prefix)
    tokenizer, tok_source = resolve_tokenizer(tokenizer)
    t_tok = 0.0
    if tokenizer is None:
        list(_texts_for_bpe(paths))  # every record's form before training on any of them
        tokenizer, _, t_tok = train_bpe_on_sample(_texts_for_bpe(paths), paths, vocab_size,
                                                   tokenizer_sample_bytes, log)
    encoder = chat_encoder(tokenizer, tok_source if os.path.exists(tok_source) else None)
    n_records = check_files(paths, encoder)
    with staging_dir(output_prefix) as staging:
        staged = staged_paths(staging, output_prefix)
        staged_mask = loss_mask_paths(os.path.join(staging, "data"))
        n_tokens, n_response = _write(staged, staged_mask, encoder, paths)
        tok_json = tokenizer.to_json_str()
        if tok_json is not None:
            with open(staged["tokenizer"], "w", encoding="utf-8") as f:
                f.write(tok_json)
        meta = _meta(output_prefix, tokenizer, tok_source, tok_json is not None, encoder, paths,
                     n_records, n_tokens, n_response, t_tok, t0)
        with open(staged["meta"], "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        _commit_with_channel(staged, staged_mask, staging, output_prefix, overwrite)
    return meta


def _commit_with_channel(staged: dict, staged_mask: dict, staging: str, prefix: str,
                         overwrite: bool) -> None:
    """Move the staged files into place, the meta file (the marker of a complete dataset) last,
    replacing any older files of the prefix (data_pipeline/staging.py `commit`)."""
    final, final_mask = output_paths(prefix), loss_mask_paths(prefix)
    if not overwrite:
        refuse_existing(prefix)  # another process may have finished meanwhile
    old = [final[k] for k in ("meta", "idx", "bin", "tokenizer")] + list(final_mask.values())
    moves = [(staged[k], final[k]) for k in ("tokenizer", "bin", "idx")]
    moves += [(staged_mask[k], final_mask[k]) for k in ("bin", "idx")]
    commit(moves + [(staged["meta"], final["meta"])], old, staging, prefix)


def _write(staged: dict, staged_mask: dict, encoder: ChatEncoder, paths: Sequence[str]):
    """Each record as one document of the token dataset and of the flag dataset; (tokens, response
    tokens)."""
    dtype = token_dtype(encoder.tokenizer.vocab_size)
    builder_cls = indexed_dataset_builder()
    tokens, flags = builder_cls(staged["bin"], dtype=dtype), builder_cls(staged_mask["bin"],
                                                                         dtype=np.uint8)
    n_tokens = n_response = 0
    for _, ids, resp in iter_encoded(paths, encoder):
        tokens.add_document(ids.astype(dtype), [ids.size])
        flags.add_document(resp, [resp.size])
        n_tokens += ids.size
        n_response += int(resp.sum())
    tokens.finalize(staged["idx"])
    flags.finalize(staged_mask["idx"])
    return n_tokens, n_response


def _meta(output_prefix: str, tokenizer: TandemTokenizer, tok_source: str, tok_file_written: bool,
          encoder: ChatEncoder, paths: Sequence[str], n_records: int, n_tokens: int,
          n_response: int, t_tok: float, t0: float) -> dict:
    """`<output_prefix>.meta.json`: plain preprocess's fields plus the channel's."""
    return {
        "format": "tandem-indexed-v1",
        "prefix": output_prefix,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "eod_token": tokenizer.eod_token,
        "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
        "documents": n_records,
        "tokens": n_tokens,
        "loss_mask": os.path.basename(output_prefix) + LOSS_MASK_SUFFIX,
        "response_tokens": n_response,
        "chat_template": encoder.template is not None,
        "tokenizer": os.path.basename(output_paths(output_prefix)["tokenizer"]) if tok_file_written
        else None, "tokenizer_source": tok_source,
        "inputs": [os.path.abspath(os.path.expanduser(str(p))) for p in paths[:32]],
        "tokenizer_seconds": round(t_tok, 3),
        "seconds": round(time.time() - t0, 3),
    }


def summary_line(meta: dict) -> str:
    """The one line `tandem preprocess --chat` prints."""
    return (f"preprocessed {meta['documents']} records, {meta['tokens']} tokens "
            f"({meta['response_tokens']} in "
            f"responses; vocab {meta['vocab_size']}, eod {meta['eod_id']}, {meta['dtype']}) -> "
            f"{meta['prefix']}.bin/"
            f".idx with loss mask {meta['prefix']}{LOSS_MASK_SUFFIX}.bin/.idx in "
            f"{meta['seconds']:.1f}s")

