"""`tandem preprocess`: the command line over `preprocess.preprocess` (text corpora) and
`chat_preprocess.preprocess_chat` (`--chat`: records with a loss-mask channel). Its own module so
the two writers stay below it (neither imports the other's command)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional, Sequence, Union

from tandem.data_pipeline.chat_preprocess import preprocess_chat, summary_line
from tandem.data_pipeline.preprocess import preprocess
from tandem.data_pipeline.tokenizer import TandemTokenizer, load_tokenizer


def preprocess_main(argv: Optional[Sequence[str]] = None) -> int:
    """`tandem preprocess ...`: parse `argv`, run `preprocess`, print a one-line summary; returns 0.
    Errors exit with status 2 and a one-line message. SIGTERM (a Slurm time limit, `scancel`,
    `timeout`) exits through the staging directory's cleanup: it left the partial dataset and
    `datasets`' copy of the input in a hidden directory that nothing removed."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _preprocess_main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _preprocess_main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.tokenizer_sample_bytes < 0:
        parser.exit(2, f"tandem preprocess: error: --tokenizer-sample-bytes "
                       f"{args.tokenizer_sample_bytes} must be >= 0 (0: all)\n")
    exts = [e.strip() for e in args.extensions.split(",") if e.strip()] if args.extensions else None
    try:
        tokenizer = _tokenizer(args)
    except (OSError, ValueError) as exc:
        parser.exit(2, f"tandem preprocess: error: {exc}\n")
    if args.chat:
        return _preprocess_chat_main(parser, args, tokenizer)
    try:
        meta = preprocess(
            args.input,
            args.output_prefix,
            tokenizer=tokenizer,
            vocab_size=args.vocab_size,
            text_key=args.text_key,
            overwrite=args.overwrite,
            tokenizer_sample_bytes=args.tokenizer_sample_bytes,
            txt_sample_by=args.txt_sample_by,
            extensions=exts,
            log=lambda msg: print(msg, file=sys.stderr),
        )
    except (OSError, ValueError) as exc:
        parser.exit(2, f"tandem preprocess: error: {exc}\n")
    print(
        f"preprocessed {meta['documents']} documents, {meta['tokens']} tokens "
        f"(vocab {meta['vocab_size']}, eod {meta['eod_id']}, {meta['dtype']}) -> "
        f"{meta['prefix']}.bin/.idx "
        f"in {meta['seconds']:.1f}s"
    )
    return 0


def _tokenizer(args) -> Union[None, str, TandemTokenizer]:
    """What `--tokenizer` names, loaded with `--eod-token` when given (a tokenizer that names no EOS
    of its own); None trains a BPE."""
    if args.eod_token is None:
        return args.tokenizer
    if args.tokenizer is None:
        raise ValueError("--eod-token needs --tokenizer (the trained BPE ends documents with "
                         "<|endoftext|>)")
    # absolute: meta.json records where the tokenizer came from
    return load_tokenizer(os.path.abspath(os.path.expanduser(args.tokenizer)),
                          eod_token=args.eod_token)


def _preprocess_chat_main(parser: argparse.ArgumentParser, args, tokenizer) -> int:
    """`tandem preprocess --chat ...` (data_pipeline/chat_preprocess.py)."""
    try:
        meta = preprocess_chat(args.input, args.output_prefix, tokenizer=tokenizer,
                               vocab_size=args.vocab_size,
                               overwrite=args.overwrite,
                               tokenizer_sample_bytes=args.tokenizer_sample_bytes,
                               log=lambda msg: print(msg, file=sys.stderr))
    except (OSError, ValueError) as exc:
        parser.exit(2, f"tandem preprocess: error: {exc}\n")
    print(summary_line(meta))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `tandem preprocess` argument parser."""
    p = argparse.ArgumentParser(
        prog="tandem preprocess",
        description="Tokenize local text into a Megatron indexed dataset (PREFIX.bin/.idx, "
        "PREFIX.tokenizer.json, PREFIX.meta.json).",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help=".jsonl/.json/.parquet or a `datasets` save_to_disk directory (one "
                        "document per record), .txt, a directory (each file one document), or "
                        "globs")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="output path prefix (PREFIX.bin, PREFIX.idx)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="local tokenizer.json or Hugging Face tokenizer directory; default: train "
                        "a byte-level BPE")
    p.add_argument("--eod-token", default=None, metavar="TOKEN",
                   help="the token that ends each document, for a tokenizer that names no EOS "
                        "(default: its EOS, else <|endoftext|>, </s>, ... where present)")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="vocabulary of the trained BPE (default 4096)")
    p.add_argument("--text-key", default="text",
                   help="field holding the text in json/parquet/datasets records (default "
                        "text)")
    p.add_argument("--txt-sample-by", default="document", choices=("document", "paragraph", "line"),
                   help=".txt files: one document per file (default), per blank-line paragraph, or "
                        "per line")
    p.add_argument("--extensions", default=None,
                   help="directories: only files ending in these comma-separated suffixes")
    p.add_argument("--tokenizer-sample-bytes", type=int, default=100_000_000,
                   help="bytes of the corpus the BPE is trained on (0 = all; default 100 MB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at PREFIX")
    p.add_argument("--chat", action="store_true",
                   help="records are {prompt, response}, {messages} or `tandem generate` output: "
                        "also write the "
                        "loss-mask channel PREFIX_loss_mask (loss on responses only; docs/data.md)")
    return p
