"""Data layer: tokenizers, preprocessing to Megatron indexed datasets, the embedded stdlib corpus,
and megatron-core GPT datasets with a batch sampler indexed by consumed samples.

Modules (import what you need; megatron-core is only imported by `preprocess` writing and
`dataset`, through `megatron_import`):
  tokenizer      `load_tokenizer`, `train_bpe`, `TandemTokenizer`
  preprocess     `preprocess` (text corpora -> indexed datasets)
  preprocess_cli `preprocess_main` (`tandem preprocess`, with `--chat`)
  stdlib_corpus  `prepare_stdlib_corpus`
  dataset        `build_datasets`, `check_vocab`, `check_prefix`
  batches        `get_batch`, `batch_indices`, `DataPosition`
  chat           prompt/response and chat records -> ids and response flags
                 (`ChatEncoder`, `iter_records`)
  chat_dataset   `data.source=jsonl`: `ChatWindows` (pack or pad), `build_chat_datasets`
  chat_preprocess `tandem preprocess --chat`: tokens plus the loss-mask channel `PREFIX_loss_mask`
  megatron_import megatron-core's dataset classes, without its package `__init__` (seconds)
  megatron_compat the tokenizer adapter and the loss-mask GPT dataset over them
"""
