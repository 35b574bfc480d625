"""What `tandem export` writes beside the weights for the stacks that serve the model (transformers,
vLLM): the tokenizer, checked to fit the model; the special token ids and context length of the
Hugging Face checkpoint it was fine-tuned from, with its generation_config.json; and, where nothing
copied names one, the tokenizer's end of document as the model's EOS.
"""

from __future__ import annotations

import json
import os
import shutil

from tandem.data_pipeline.dataset import check_vocab
from tandem.data_pipeline.tokenizer import copy_tokenizer, load_tokenizer, tokenizer_file

from .importer import tokenizer_file_size
from .init_from import is_hf_dir

SERVING_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def source_serving_fields(init_from: str, max_seq_len: int, out_dir: str,
                          frozen_trunk: bool = False) -> dict:
    """What a model fine-tuned from a Hugging Face checkpoint (`model.init_from`) keeps of how its
    source is served: the source's context length (`max_position_embeddings`, which vLLM serves up
    to) when longer than the run's `model.max_seq_len`, and always for a frozen trunk, which is the
    source's (the run's default 4096 claimed positions a 512-position source never had), its
    special token ids, and its generation_config.json (copied into `out_dir`; transformers'
    `generate` reads its EOS there)."""
    if not init_from or not is_hf_dir(init_from):
        return {}
    with open(os.path.join(init_from, "config.json"), encoding="utf-8") as f:
        source = json.load(f)
    fields = {k: source[k] for k in SERVING_FIELDS if source.get(k) is not None}
    if (frozen_trunk and source.get("max_position_embeddings")
            or int(source.get("max_position_embeddings", 0)) > max_seq_len):
        fields["max_position_embeddings"] = int(source["max_position_embeddings"])
    generation = os.path.join(init_from, "generation_config.json")
    if os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(out_dir, "generation_config.json"))
    return fields


def check_tokenizer_file(tokenizer: str, vocab_size: int) -> str:
    """The tokenizer.json of `tokenizer` (a file or an HF tokenizer directory), checked to load and
    to fit the model's embedding table: an export must not ship a tokenizer it cannot serve."""
    src = tokenizer_file(tokenizer)
    if src is None:
        where = "holds no tokenizer.json" if os.path.isdir(tokenizer) else "does not exist"
        raise FileNotFoundError(f"--tokenizer {tokenizer} {where}")
    # the file's size, not load_tokenizer's: a tokenizer without an end-of-document token (which
    # training requires) still exports
    check_vocab(src, tokenizer_file_size(src), vocab_size)
    return src


def write_tokenizer(tokenizer: str, out_dir: str) -> None:
    """The tokenizer beside the weights and config.json in `out_dir`, and its end of document as
    the model's EOS where nothing copied names one (a run trained from scratch): transformers and
    vLLM took the family's class default (Llama's 2, DeepSeek-V3's 1), an ordinary token, as the
    stop id, and never stopped at the end of a document."""
    copy_tokenizer(tokenizer, out_dir)
    try:
        eod = load_tokenizer(out_dir)
    except ValueError:  # no end-of-document token: nothing to name (it still exports)
        eod = None
    settings = os.path.join(out_dir, "tokenizer_config.json")
    if not os.path.isfile(settings):
        with open(settings, "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                       **({"eos_token": eod.eod_token} if eod is not None else {})}, f)
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if eod is not None and config.get("eos_token_id") is None:
        config["eos_token_id"] = eod.eod_id
        config.setdefault("bos_token_id", eod.start_ids[0] if eod.start_ids else None)
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
