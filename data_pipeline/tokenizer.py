"""The one tokenizer wrapper Tandem uses everywhere (preprocessing, datasets, evaluator).

`load_tokenizer(path)` reads a local `tokenizer.json` (Hugging Face `tokenizers`) or a local Hugging
Face tokenizer directory; `train_bpe(texts, vocab_size, out_file)` trains the byte-level BPE used
for the embedded corpus. Both return a `TandemTokenizer`: `vocab_size`, `eod_id`, `encode`,
`encode_batch`, `decode`, `save`.

Text is encoded with special-token strings treated as plain text (a document that happens to contain
the literal `<|endoftext|>` does not get a spurious EOD) and without the post-processor's tokens,
except the BOS it puts before a text that starts a document or a prompt (`encode(start=True)`); the
data pipeline appends `eod_id` after each document itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

EOD_TOKEN = "<|endoftext|>"
"""The end-of-document special token of the byte-level BPE trained by `train_bpe`."""

# Tried in order when a loaded tokenizer does not name its EOS token itself.
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


class TandemTokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` (or, for slow HF tokenizers, a transformers
    one).

    Attributes: `path` (where it was loaded from, for error messages), `vocab_size` (ids are in
    [0, vocab_size), specials included), `eod_id` / `eod_token` (end-of-document).
    """

    def __init__(self, backend, eod_token: Optional[str] = None, path: str = "", hf=None) -> None:
        self.path = path
        # tokenizers.Tokenizer, or None when only a slow HF tokenizer exists
        self._backend = backend
        self._hf = hf if backend is None else None
        self._rendered = None  # `encode_rendered`'s copy of the backend
        vocab = self._get_vocab()
        self.vocab_size = max(len(vocab), max(vocab.values(), default=-1) + 1)
        self.eod_token, self.eod_id = _find_eod(vocab, eod_token, hf, path)
        if backend is not None:
            # Literal special-token strings inside documents are encoded as text, not as specials.
            backend.encode_special_tokens = True
            # a tokenizer.json saved with truncation or padding on (common in fine-tuned repos)
            # cut every document at its max_length, or filled short ones with pad ids the loss
            # counted: a document's ids are all of its text, and nothing else
            backend.no_truncation()
            backend.no_padding()

    def _get_vocab(self) -> dict:
        if self._backend is not None:
            return self._backend.get_vocab(with_added_tokens=True)
        return self._hf.get_vocab()

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer` (None for a slow Hugging Face tokenizer)."""
        return self._backend

    def encode(self, text: str, start: bool = False) -> List[int]:
        """Token ids of `text`, no EOS added. `start`: the text begins a document or a prompt, so
        the tokenizer's own leading special tokens (`start_ids`: a Llama or DeepSeek tokenizer's
        BOS) come first, as transformers' `tokenizer(text)`, Megatron-LM's preprocessing and vLLM's
        prompts have them."""
        if self._backend is not None:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            ids = list(self._hf.encode(text, add_special_tokens=False, split_special_tokens=True))
        return self.start_ids + ids if start else ids

    def encode_batch(self, texts: Sequence[str], start: bool = False) -> List[List[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        if self._backend is None:
            return [self.encode(t, start) for t in texts]
        lead = self.start_ids if start else []
        return [lead + e.ids for e in self._backend.encode_batch(list(texts),
                                                                 add_special_tokens=False)]

    @functools.cached_property
    def start_ids(self) -> List[int]:
        """The ids the tokenizer's post-processor puts before a text (BOS for Llama and DeepSeek
        tokenizers; none for Qwen's, GLM's or the trained BPE), found by encoding a probe both ways;
        none when they hold the end-of-document token, which would cut each document in two."""
        lead = _lead_ids(self._backend.encode if self._backend is not None else
                         lambda text, add_special_tokens: self._hf.encode(
                             text, add_special_tokens=add_special_tokens))
        return [] if self.eod_id in lead else lead

    def encode_rendered(self, text: str) -> Tuple[List[int], Optional[List[Tuple[int, int]]]]:
        """(token ids, each token's (start, end) character offsets) of a rendered chat template,
        whose special-token strings (`<|im_start|>`) become their special tokens, unlike `encode`,
        which keeps a document's literal special-token strings as text. A slow Hugging Face
        tokenizer has no offsets (None): prompts need none, chat training data a fast tokenizer
        (ChatEncoder)."""
        if self._backend is None:
            return list(self._hf.encode(text, add_special_tokens=False)), None
        if self._rendered is None:  # a copy, so `encode` is never switched under another caller
            self._rendered = type(self._backend).from_str(self._backend.to_str())
            self._rendered.encode_special_tokens = False
        enc = self._rendered.encode(text, add_special_tokens=False)
        return list(enc.ids), [(a, b) for a, b in enc.offsets]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens (EOD) are kept as their strings."""
        ids = [int(i) for i in ids]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def to_json_str(self) -> Optional[str]:
        """The `tokenizer.json` text, or None for a slow Hugging Face tokenizer (nothing to
        save)."""
        if self._backend is None:
            return None
        return self._backend.to_str()

    def save(self, out_file: str) -> None:
        """Write `tokenizer.json` to `out_file` atomically (temp file, then rename)."""
        text = self.to_json_str()
        if text is None:
            raise ValueError(f"tokenizer {self.path} is a slow Hugging Face tokenizer; it has no "
                             "tokenizer.json to "
                             "save")
        _atomic_write_text(out_file, text)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"TandemTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, "
                f"eod={self.eod_token!r}:{self.eod_id})")


def _lead_ids(encode) -> List[int]:
    """The ids `encode(text, add_special_tokens=True)` puts before the text's own (a probe encoded
    both ways; `encode` returns ids or an Encoding)."""
    plain, full = (getattr(e, "ids", e) for e in (encode("a", add_special_tokens=False),
                                                   encode("a", add_special_tokens=True)))
    return next((list(full[:i]) for i in range(len(full) - len(plain) + 1)
                 if list(full[i:i + len(plain)]) == list(plain)), [])


def _find_eod(vocab: dict, eod_token: Optional[str], hf, path: str):
    if eod_token is not None:
        if eod_token not in vocab:
            raise ValueError(f"tokenizer {path}: end-of-document token {eod_token!r} is not in its "
                             "vocabulary")
        return eod_token, vocab[eod_token]
    if hf is not None and getattr(hf, "eos_token", None) in vocab:
        return hf.eos_token, vocab[hf.eos_token]
    for cand in _EOD_CANDIDATES:
        if cand in vocab:
            return cand, vocab[cand]
    raise ValueError(
        f"tokenizer {path} has no end-of-document token (none of {', '.join(_EOD_CANDIDATES)}); "
        "name one: tandem preprocess --eod-token TOKEN, or eos_token in the tokenizer directory's "
        "tokenizer_config.json"
    )


def load_tokenizer(path: str, eod_token: Optional[str] = None) -> TandemTokenizer:
    """Load a local `tokenizer.json` file or a local Hugging Face tokenizer directory (never
    downloads).

    `eod_token` overrides the end-of-document token; by default it is the tokenizer's EOS token or
    the first of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>` present. Raises
    FileNotFoundError or ValueError with a one-line message naming the path.
    """
    from tokenizers import Tokenizer

    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer not found: {path}")
    if os.path.isfile(path):
        try:
            backend = Tokenizer.from_file(path)
        except Exception as exc:
            raise ValueError(f"cannot read tokenizer file {path}: {_first_line(exc)}") from None
        return TandemTokenizer(backend, eod_token, path)
    try:
        from transformers import AutoTokenizer

        # never runs a directory's own code, nor asks at a terminal whether to
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        tj = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tj):  # a bare tokenizer.json, or a class of its own (`auto_map`)
            return load_tokenizer(tj, eod_token or _configured_eos(path))
        raise ValueError(
            f"cannot load Hugging Face tokenizer directory {path}: {_first_line(exc)}"
        ) from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        # our own copy: we change encode_special_tokens
        backend = Tokenizer.from_str(backend.to_str())
        return TandemTokenizer(backend, eod_token, path, hf=hf)
    return TandemTokenizer(None, eod_token, path, hf=hf)


def _configured_eos(path: str) -> Optional[str]:
    """The `eos_token` tokenizer_config.json names (a string or an AddedToken's dict), for a
    directory read as its bare tokenizer.json: its end of document was the first default
    candidate the vocabulary held instead."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


BPE_TRAINING_WORD = 4096
"""The longest run of non-space characters BPE training takes whole: a longer one (a DNA sequence,
a base64 blob) is handed to the trainer in pieces of this many. Its cost grows with the square of
a word's length (4 s for a run of 100k characters, 4x per doubling: a 2 MB run did not finish in
200 s), and linearly in pieces.
The Python standard library's longest run is 1,170 characters, so ordinary text trains as it did."""

_LONG_RUN = re.compile(r"\S{%d,}" % (BPE_TRAINING_WORD + 1))


def _bounded_words(texts: Iterable[str]) -> Iterator[str]:
    """`texts`, each cut after every BPE_TRAINING_WORD characters of a longer run (a text without
    one as it is)."""
    for text in texts:
        start = 0
        for run in _LONG_RUN.finditer(text):
            for cut in range(run.start() + BPE_TRAINING_WORD, run.end(), BPE_TRAINING_WORD):
                yield text[start:cut]
                start = cut
        yield text[start:]


def train_bpe(text_iterator: Iterable[str], vocab_size: int,
              out_file: Optional[str] = None) -> TandemTokenizer:
    """Train a byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer and decoder, 256-byte initial
    alphabet, so any text round-trips) with `<|endoftext|>` as its only special token (id 0, the
    EOD).

    Deterministic for the same texts in the same order. Writes `out_file` (tokenizer.json) when
    given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError(f"BPE vocab_size={vocab_size} must be >= 258 (256 bytes, EOD and one "
                         "merge)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_bounded_words(text_iterator), trainer=trainer)
    wrapped = TandemTokenizer(tok, EOD_TOKEN, out_file or "<trained byte-level BPE>")
    if out_file:
        wrapped.save(out_file)
    return wrapped


def _atomic_write_text(out_file: str, text: str) -> None:
    out_dir = os.path.dirname(os.path.abspath(out_file))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=out_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out_file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
                         "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def tokenizer_file(path: str) -> Optional[str]:
    """The file that defines the tokenizer at `path` (a tokenizer.json, or a directory's
    tokenizer.json), or None when `path` is a directory without one."""
    path = os.path.expanduser(str(path))
    if os.path.isfile(path):
        return path
    tj = os.path.join(path, "tokenizer.json")
    return tj if os.path.isfile(tj) else None


TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""What a Hugging Face tokenizer directory holds beside tokenizer.json: its EOS token (the
end-of-document token a run trains with) and chat template."""


def copy_tokenizer(path: str, out_dir: str, eod_token: Optional[str] = None) -> None:
    """Copy the tokenizer at `path` (a tokenizer.json, or a directory holding one) into `out_dir`:
    tokenizer.json and the side files beside it. A bare tokenizer.json would load with the first
    default end-of-document token, not the EOS its directory names (`<|im_end|>` for Qwen3), and
    without its chat template. `eod_token`: the end-of-document token the run's data was made with
    (a Megatron prefix's meta.json names it beside its bare `<prefix>.tokenizer.json`); when the
    copy would load with another, a tokenizer_config.json naming it as the EOS goes with it."""
    path = os.path.expanduser(str(path))
    src = tokenizer_file(path)
    if src is None:
        raise FileNotFoundError(f"tokenizer not found: {path}")
    shutil.copyfile(src, os.path.join(out_dir, "tokenizer.json"))
    if os.path.basename(src) == "tokenizer.json":  # not a Megatron prefix's <prefix>.tokenizer.json
        for name in TOKENIZER_SIDE_FILES:
            side = os.path.join(os.path.dirname(src), name)
            if os.path.isfile(side):
                shutil.copyfile(side, os.path.join(out_dir, name))
    # the copy loads as its source does (`saved_tokenizer`: the directory when it has side files)
    loads_as = saved_tokenizer(os.path.dirname(src)) if os.path.basename(
        src) == "tokenizer.json" else src
    if eod_token is not None and (default_eod(loads_as) or (None,))[0] != eod_token:
        config = os.path.join(out_dir, TOKENIZER_SIDE_FILES[0])
        settings = {}
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                settings = json.load(f)
        _atomic_write_text(config, json.dumps({**settings, "eos_token": eod_token}, indent=2))


def default_eod(path: str) -> Optional[Tuple[str, int]]:
    """(token, id) of the end of document the tokenizer at `path` loads with unless told one (None:
    it names none)."""
    return _default_eod(os.path.abspath(path))


@functools.lru_cache(maxsize=None)
def _default_eod(path: str) -> Optional[Tuple[str, int]]:
    # cached: a run copies its tokenizer into every checkpoint, and a Hugging Face directory's load
    # takes transformers a second
    try:
        tok = load_tokenizer(path)
    except ValueError:
        return None
    return tok.eod_token, tok.eod_id


def same_tokenizer(a: str, b: str) -> bool:
    """Whether the tokenizers at paths `a` and `b` give the same ids (tokenizer_fingerprint) and
    load with the same end-of-document token (a side file's EOS changes it); False when either has
    no tokenizer.json or cannot be read."""
    files = [tokenizer_file(a), tokenizer_file(b)]
    try:
        return (None not in files and tokenizer_fingerprint(files[0]) == tokenizer_fingerprint(
            files[1]) and default_eod(a) == default_eod(b))
    except (ValueError, OSError):
        return False


def saved_tokenizer(directory: str) -> Optional[str]:
    """What to load for the tokenizer `copy_tokenizer` wrote into `directory` (a checkpoint): the
    directory when side files came with it, else its bare tokenizer.json; None without one."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return None
    if os.path.isfile(os.path.join(directory, TOKENIZER_SIDE_FILES[0])):
        return directory
    return os.path.join(directory, "tokenizer.json")


def checkpoint_tokenizer(path: str) -> Optional[str]:
    """The tokenizer shipped with a checkpoint directory (Hugging Face or a Tandem step), or
    None."""
    if tokenizer_file(path):
        return os.path.abspath(path)
    if any(os.path.isfile(os.path.join(path, n)) for n in _SLOW_TOKENIZER_FILES[:4]):
        return os.path.abspath(path)
    return None


def tokenizer_fingerprint(tokenizer: Union[str, TandemTokenizer]) -> str:
    """sha256 of what defines a tokenizer's ids: for a path, its tokenizer.json content (so a copy
    of it under any name, the directory holding it, or the same JSON written again has the same
    fingerprint), else a slow tokenizer's vocabulary files; for a loaded `TandemTokenizer`, the
    tokenizer.json it saves (what `tandem preprocess` writes beside a dataset).

    The JSON is hashed parsed, with sorted keys and no spacing, and with `post_processor`,
    `padding` and `truncation` replaced by the one thing of theirs that reaches Tandem's ids, the
    BOS the post-processor puts before a text: transformers rewrites them as it loads a directory
    (a bare tokenizer.json's null post-processor becomes a template that adds nothing), so the file
    and the tokenizer loaded from it would otherwise differ."""

    if isinstance(tokenizer, TandemTokenizer):
        text = tokenizer.to_json_str()
        return tokenizer_fingerprint(tokenizer.path) if text is None else _json_fingerprint(
            text.encode())
    tj = tokenizer_file(tokenizer)
    if tj:
        with open(tj, "rb") as f:
            return _json_fingerprint(f.read())
    h = hashlib.sha256()
    files = [os.path.join(tokenizer, n) for n in _SLOW_TOKENIZER_FILES
             if os.path.isfile(os.path.join(tokenizer, n))]
    if not files:
        raise FileNotFoundError(f"tokenizer not found: {tokenizer}")
    for file in files:
        h.update(os.path.basename(file).encode() + b"\0")
        with open(file, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


_REWRITTEN_FIELDS = ("post_processor", "padding", "truncation")
"""tokenizer.json fields hashed by what they do to the ids Tandem encodes (the post-processor's BOS
before a document, `_lead_ids`), not as written."""

_JSON_FINGERPRINTS: Dict[str, str] = {}
"""sha256 of a tokenizer.json's bytes -> its fingerprint: a blend of hundreds of prefixes holds as
many copies of one tokenizer.json (megabytes each), parsed once."""


def _json_fingerprint(raw: bytes) -> str:
    """The fingerprint of tokenizer.json bytes `raw`: parsed, sorted keys, no spacing, the
    `_REWRITTEN_FIELDS` replaced by the ids the post-processor puts before a text (`raw` itself when
    it does not parse)."""
    from tokenizers import Tokenizer

    key = hashlib.sha256(raw).hexdigest()
    if key not in _JSON_FINGERPRINTS:
        try:
            spec = json.loads(raw)
            lead = _lead_ids(Tokenizer.from_str(raw.decode("utf-8")).encode)
        except Exception:  # not a tokenizer.json (a test's stand-in): its bytes
            canonical = raw
        else:
            if isinstance(spec, dict):
                spec = {k: v for k, v in spec.items() if k not in _REWRITTEN_FIELDS}
            canonical = json.dumps([spec, lead], sort_keys=True, separators=(",", ":"),
                                   ensure_ascii=False).encode()
        _JSON_FINGERPRINTS[key] = hashlib.sha256(b"tokenizer.json\0" + canonical).hexdigest()
    return _JSON_FINGERPRINTS[key]
