"""Quality of a checkpoint on held-out code: bits per byte, repetition and MTP acceptance.

    python bench/default_job_quality.py [--checkpoint runs/tiny] [--windows 128] [--prompts 32]

Two held-out sources, neither in the training corpus:

* `test`: the stdlib corpus's own held-out split (data_pipeline/stdlib_corpus.stdlib_files: the
  first ~1.5 MB of the sorted `.py` files under the standard library's `test/`);
* `pip`: the sorted `.py` files of the installed `pip` package's `_internal/` (site-packages, which
  the corpus never reads), up to `--second-bytes` bytes; `--second-dir DIR` names another directory.

Bits per byte (teacher-forced). Each source's files are tokenized with the checkpoint's tokenizer
and concatenated into one stream, each file followed by the end-of-document token, exactly as the
training data is laid out. The stream is cut into consecutive windows of seq_len + 1 tokens (the
training `data.seq_len`) overlapping by one token, so every token after the stream's first is the
target of exactly one window; `--windows` of them, evenly spaced over the stream, are scored (all of
them when there are fewer). In a window the model reads tokens 0..S-1 and predicts tokens 1..S, each
from the tokens before it in that window only (`--document-mask on`: only those of its own file, as
inference reads a document; the default follows the checkpoint's data.document_mask). Then

    bits per byte = (sum over predicted tokens of -ln p(token | window prefix)) / ln 2
                    / (number of UTF-8 bytes those predicted tokens stand for)

Every predicted token counts, the end-of-document token included, and a document's first token
too unless `--document-mask` is on (then it is predicted from nothing of its own document, and is
left out of the losses and the bytes alike, as training leaves it out); a byte-level BPE token
stands for exactly its vocabulary string's length in bytes (one byte per character of the byte-level
alphabet) and the end-of-document token for none, so the bytes of a file's tokens sum to the file's
UTF-8 size (checked for every file; a tokenizer that is not byte-level fails that check by name).
The cross-entropy is the checkpoint's own `eval.metrics.teacher_forced` main-head loss (mean over
the window's counted targets, times their number), in fp32.

Decoding (`eval.decode_eval.evaluate_decoding`, the in-loop evaluator's decoder): `--prompts`
prompts, the first `prompt_len` tokens (the checkpoint's `eval.prompt_len`) of windows evenly spaced
over each source, continued by `max_new_tokens` tokens (its `eval.max_new_tokens`) with K = its
`mtp.num_steps` drafts per round: greedy (acceptance length, per-position rates, and distinct-2/4 of
the continuations' token ids: `eval.metrics.distinct_n`, the mean over prompts of distinct / total
n-grams) and speculative sampling at T=1 (acceptance only).

Prints one block per source and ends with one line of key=value pairs (`bits_per_byte`,
`distinct_4`, `acceptance_greedy`, ... for the test split; `<key>_pip` for the second source).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch


def pip_internal_dir() -> str:
    """`pip/_internal` of the pip this interpreter imports (outside the stdlib corpus)."""
    spec = importlib.util.find_spec("pip")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no installed `pip` package to read held-out code from; pass "
                                "--second-dir")
    return os.path.join(list(spec.submodule_search_locations)[0], "_internal")


def code_files(root: str, max_bytes: int) -> List[str]:
    """Sorted `.py` files under root (relative path order), as many as fit in max_bytes (at least
    one)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        found += [os.path.join(dirpath, n) for n in filenames if n.endswith(".py")]
    found.sort(key=lambda p: os.path.relpath(p, root))
    taken, total = [], 0
    for path in found:
        size = os.path.getsize(path)
        if taken and total + size > max_bytes:
            break
        taken.append(path)
        total += size
    if not taken:
        raise FileNotFoundError(f"no .py files under {root}")
    return taken


def token_bytes(tokenizer) -> List[int]:
    """UTF-8 bytes each token id stands for: its byte-level vocabulary string's length, 0 for
    specials."""
    backend = tokenizer.backend
    if backend is None:
        raise ValueError(f"tokenizer {tokenizer.path} is not a `tokenizers` byte-level BPE")
    special = {t.content for t in backend.get_added_tokens_decoder().values()}
    out = [0] * tokenizer.vocab_size
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        out[i] = 0 if piece in special else len(piece)
    return out


def token_stream(tokenizer, files: Sequence[str], nbytes: List[int]) -> Tuple[List[int], int]:
    """(token ids of the files, each followed by EOD; total UTF-8 bytes). Checks that every file's
    tokens stand for exactly its bytes (the bits-per-byte denominator rests on it)."""
    texts = []
    for path in files:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            texts.append((path, raw.decode("utf-8"), len(raw)))
        except UnicodeDecodeError:
            continue  # as the corpus does: files that are not UTF-8 are skipped
    stream, total = [], 0
    for (path, _, size), ids in zip(texts, tokenizer.encode_batch([t for _, t, _ in texts])):
        got = sum(nbytes[i] for i in ids)
        if got != size:
            raise ValueError(f"tokenizer {tokenizer.path}: the tokens of {path} stand for {got} "
                             "bytes, the file "
                             f"has {size}; bits per byte needs a byte-level BPE")
        stream += ids + [tokenizer.eod_id]
        total += size
    return stream, total


def windows(stream: Sequence[int], seq_len: int, count: int) -> List[List[int]]:
    """`count` of the stream's consecutive seq_len+1-token windows (overlapping by one), evenly
    spaced."""
    total = (len(stream) - 1) // seq_len
    if total < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window of "
                         f"{seq_len + 1}")
    picks = range(total) if count >= total else sorted({i * total // count for i in range(count)})
    return [list(stream[j * seq_len : j * seq_len + seq_len + 1]) for j in picks]


@torch.no_grad()
def bits_per_byte(model, wins: List[List[int]], nbytes: List[int], batch: int, eod_id: int = -1,
                  document_mask: bool = False) -> Dict[str, float]:
    """Teacher-forced bits per byte of the windows' predicted tokens (module docstring) and the
    sums. `document_mask`: the files packed into a window are kept apart (data.document_mask, as the
    checkpoint trained), each one read from its own start."""
    from tandem.eval.metrics import teacher_forced
    from tandem.models import depth_target_mask

    nats, tokens, nb = 0.0, 0, 0
    for i in range(0, len(wins), batch):
        t = torch.tensor(wins[i : i + batch], dtype=torch.long)
        is_eod = (t == eod_id).long()
        # without the mask the windows are one sequence each: every target counts (the files'
        # ids would drop each file's first token from the loss, and from the loss only)
        doc_ids = torch.cumsum(is_eod, 1) - is_eod if document_mask else torch.zeros_like(t)
        counted = depth_target_mask(torch.ones(t.shape[0], t.shape[1] - 1), doc_ids, 0)
        n = int(counted.sum())
        batch_i = {"tokens": t, "doc_ids": doc_ids}
        nats += teacher_forced(model, [batch_i], document_mask=document_mask)["loss/main"] * n
        tokens += n
        nb += sum(nbytes[int(x)] for x in t[:, 1:][counted])
    return {"bits_per_byte": nats / math.log(2) / nb, "loss": nats / tokens,
            "bytes_per_token": nb / tokens, "tokens": tokens, "bytes": nb}


def decode_figures(model, prompts: List[List[int]], K: int, max_new: int, batch: int, eos_id: int,
                   seed: int) -> Dict[str, float]:
    """Greedy and T=1 speculative decoding of the prompts (the in-loop evaluator's decoder)."""
    from tandem.eval.decode_eval import evaluate_decoding
    from tandem.eval.metrics import distinct_n

    common = dict(num_steps=K, max_new_tokens=max_new, batch_size=batch, eos_id=eos_id, seed=seed)
    with torch.inference_mode():
        greedy, spec, _ = evaluate_decoding(model, prompts, temperature=0.0, **common)
        sampled, _, _ = evaluate_decoding(model, prompts, temperature=1.0, autoregressive=False,
                                          **common)
    outs = [o for r in spec for o in r.outputs]
    out = {"distinct_2": distinct_n(outs, 2), "distinct_4": distinct_n(outs, 4),
           "acceptance_greedy": greedy["acceptance_length"],
           "identical_to_autoregressive": float(greedy["identical_to_autoregressive"])}
    out.update({f"greedy_pos_{k}": greedy[f"accept_rate/pos_{k}"] for k in range(1, K + 1)})
    out["acceptance_t1"] = sampled["acceptance_length"]
    out.update({f"t1_pos_{k}": sampled[f"accept_rate/pos_{k}"] for k in range(1, K + 1)})
    out["_sample"] = outs[0] if outs else []
    return out


def measure(checkpoint: str, *, num_windows: int = 128, num_prompts: int = 32, batch: int = 8,
            second_dir: str = "", second_bytes: int = 400_000, prompt_len: int = 0,
            max_new_tokens: int = 0,
            seed: int = 0, verbose: bool = True, document_mask: str = "checkpoint") -> Dict[str,
                                                                                            float]:
    """All figures of one checkpoint: `<key>` for the test split, `<key>_pip` for the second source.
    `document_mask`: score the windows with files kept apart (`on`: each file read alone from its
    start, as inference reads a document), not (`off`), or as the checkpoint trained
    (`checkpoint`)."""
    from tandem.data_pipeline.stdlib_corpus import stdlib_files
    from tandem.trainer.checkpoint import load_model_from_checkpoint, resolve_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer

    step_dir = resolve_checkpoint(checkpoint)
    model, cfg = load_model_from_checkpoint(step_dir)
    tok = load_run_tokenizer(cfg, step_dir)
    if tok is None:
        raise ValueError(f"checkpoint {step_dir} has no tokenizer")
    nbytes = token_bytes(tok)
    apart = bool(cfg.data.document_mask) if document_mask == "checkpoint" else document_mask == "on"
    seq_len = int(cfg.data.seq_len)
    K = int(cfg.mtp.num_steps)
    plen = max(1, min(prompt_len or cfg.eval.prompt_len, seq_len))
    max_new = max_new_tokens or cfg.eval.max_new_tokens
    second_dir = second_dir or pip_internal_dir()
    sources = [("", stdlib_files()[1]), ("_pip", code_files(second_dir, second_bytes))]
    say = (lambda *a: print(*a, flush=True)) if verbose else (lambda *a: None)
    say(f"checkpoint {step_dir}: seq_len {seq_len}, K={K}, vocab {tok.vocab_size}, "
        f"data.document_mask={bool(cfg.data.document_mask)}, files scored "
        f"{'apart' if apart else 'packed'}; "
        f"{num_windows} windows, {num_prompts} prompts of {plen} tokens + {max_new} new per source")
    figures: Dict[str, float] = {}
    for suffix, files in sources:
        t0 = time.perf_counter()
        stream, size = token_stream(tok, files, nbytes)
        fig = bits_per_byte(model, windows(stream, seq_len, num_windows), nbytes, batch, tok.eod_id,
                            apart)
        prompts = [w[:plen] for w in windows(stream, seq_len, num_prompts)]
        fig.update(decode_figures(model, prompts, K, max_new, batch, tok.eod_id, seed))
        sample = fig.pop("_sample")
        name = "test split" if not suffix else f"{second_dir}"
        say(f"[{name}] {len(files)} files, {size} bytes, {len(stream)} tokens "
            f"({size / len(stream):.2f} bytes/token "
            f"over the stream); scored {fig['tokens']} tokens = {fig['bytes']} bytes "
            f"({time.perf_counter() - t0:.1f} s)")
        say(f"  bits/byte {fig['bits_per_byte']:.4f}  loss {fig['loss']:.4f} nats/token  "
            f"{fig['bytes_per_token']:.3f} bytes/token")
        say(f"  greedy: acceptance {fig['acceptance_greedy']:.3f} (pos " +
            " / ".join(f"{fig[f'greedy_pos_{k}']:.3f}" for k in range(1, K + 1)) +
            f"), distinct-2 {fig['distinct_2']:.3f}, distinct-4 {fig['distinct_4']:.3f}, "
            f"identical to AR {bool(fig['identical_to_autoregressive'])}")
        say(f"  T=1:    acceptance {fig['acceptance_t1']:.3f} (pos " +
            " / ".join(f"{fig[f't1_pos_{k}']:.3f}" for k in range(1, K + 1)) + ")")
        say(f"  first greedy continuation: {tok.decode(sample)!r}")
        figures.update({f"{k}{suffix}": v for k, v in fig.items()})
    return figures


FINAL_KEYS = ("bits_per_byte", "distinct_4", "acceptance_greedy", "acceptance_t1", "greedy_pos_1",
              "greedy_pos_2",
              "greedy_pos_3", "bits_per_byte_pip", "distinct_4_pip", "acceptance_greedy_pip",
              "acceptance_t1_pip")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="runs/tiny",
                   help="run or step directory (default: the tiny recipe's)")
    p.add_argument("--windows", type=int, default=128, help="teacher-forced windows per source")
    p.add_argument("--prompts", type=int, default=32, help="decoded prompts per source")
    p.add_argument("--batch-size", type=int, default=8,
                   help="windows per forward / prompts per decode batch")
    p.add_argument("--prompt-len", type=int, default=0,
                   help="default: the checkpoint's eval.prompt_len")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="default: the checkpoint's eval.max_new_tokens")
    p.add_argument("--second-dir", default="",
                   help="second held-out code directory (default: pip/_internal)")
    p.add_argument("--second-bytes", type=int, default=400_000,
                   help="cap on the second source's bytes")
    p.add_argument("--seed", type=int, default=0, help="seed of the T=1 sampling generators")
    p.add_argument("--document-mask", choices=("checkpoint", "on", "off"), default="checkpoint",
                   help="score each file apart (on), the windows as packed (off), or as the "
                        "checkpoint trained")
    args = p.parse_args(argv)
    for name in ("windows", "prompts", "batch_size", "second_bytes"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    try:
        figures = measure(args.checkpoint, num_windows=args.windows, num_prompts=args.prompts,
                          batch=args.batch_size,
                          second_dir=args.second_dir, second_bytes=args.second_bytes,
                          prompt_len=args.prompt_len,
                          max_new_tokens=args.max_new_tokens, seed=args.seed,
                          document_mask=args.document_mask)
    except (FileNotFoundError, ValueError) as exc:
        print(f"default_job_quality: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={figures[k]:.4f}" for k in FINAL_KEYS if k in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
