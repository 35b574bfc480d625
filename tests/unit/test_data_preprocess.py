"""Preprocessing: text -> .bin/.idx round trips for every input kind, outputs, overwrite refusal,
CLI."""

import errno
import json
import os
import warnings

import numpy as np
import pytest

from tandem.data_pipeline import preprocess as pp
from tandem.data_pipeline.preprocess import preprocess, read_meta
from tandem.data_pipeline.preprocess_cli import preprocess_main
from tandem.data_pipeline.tokenizer import load_tokenizer, train_bpe

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "héllo wörld 🙂\n\n  indented\ttab",
    "x" * 300,
    "class A:\n    pass\n",
    "<|endoftext|> literal inside a document",
]


def _read_back(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


def _expected(tok, docs):
    return [tok.encode(d) + [tok.eod_id] for d in docs]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(iter(DOCS * 10), 320, str(out))
    return str(out)


def _write_inputs(root, kind):
    root.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        p = root / "docs.jsonl"
        p.write_text("".join(json.dumps({"text": d, "meta": i}) + "\n" for i, d in enumerate(DOCS)),
                     encoding="utf-8")
        return [str(p)], DOCS
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = root / "docs.parquet"
        pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), str(p))
        return [str(p)], DOCS
    if kind in ("saved", "saved_dict"):  # `datasets` save_to_disk: state.json, data-*.arrow
        import datasets

        p = root / "saved"
        ds = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))})
        (datasets.DatasetDict({"train": ds}) if kind == "saved_dict" else ds).save_to_disk(str(p))
        return [str(p)], DOCS
    if kind == "txt":
        paths = []
        for i, d in enumerate(DOCS[:3]):
            p = root / f"doc{i}.txt"
            p.write_text(d, encoding="utf-8")
            paths.append(str(p))
        return paths, DOCS[:3]
    if kind == "dir":
        src = root / "src"
        (src / "pkg" / "__pycache__").mkdir(parents=True)
        (src / "b.py").write_text(DOCS[0], encoding="utf-8")
        (src / "a.py").write_text(DOCS[1], encoding="utf-8")
        (src / "pkg" / "c.py").write_text(DOCS[3], encoding="utf-8")
        (src / "pkg" / "empty.py").write_text("", encoding="utf-8")
        (src / "pkg" / "latin1.py").write_bytes(b"caf\xe9\n")  # not UTF-8: skipped
        (src / "pkg" / "__pycache__" / "c.cpython-311.pyc").write_bytes(b"\x00junk")
        (src / ".hidden").write_text("secret", encoding="utf-8")
        return [str(src)], [DOCS[1], DOCS[0], DOCS[3]]  # sorted: a.py, b.py, pkg/c.py
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt", "dir", "saved", "saved_dict"])
def test_round_trip_matches_direct_tokenization(tmp_path, tok_path, kind):
    """Every input kind gives each document's own tokens + EOD; a `datasets` directory gives its
    rows' text (its metadata files had been read as the corpus, its .arrow skipped as not
    UTF-8)."""
    inputs, docs = _write_inputs(tmp_path / "in", kind)
    prefix = str(tmp_path / "out" / "data")
    said = []
    meta = preprocess(inputs, prefix, tokenizer=tok_path, log=said.append)
    if kind == "dir":  # the file that is not UTF-8 is named, not only counted in meta.json
        assert meta["skipped_not_utf8_files"] == 1
        assert said == [f"skipped 1 file(s) that are not UTF-8 text: {inputs[0]}/pkg/latin1.py"]
    tok = load_tokenizer(tok_path)
    got, ds = _read_back(prefix)
    assert got == _expected(tok, docs)
    assert ds.index.dtype == np.uint16
    assert meta["documents"] == len(docs) and meta["tokens"] == sum(map(len, got))
    assert meta["eod_id"] == tok.eod_id and meta["vocab_size"] == tok.vocab_size
    assert read_meta(prefix) == meta
    saved = load_tokenizer(prefix + ".tokenizer.json")
    assert saved.encode(DOCS[1]) == tok.encode(DOCS[1])
    # nothing but the four outputs is left beside the prefix (no staging directories)
    assert sorted(os.listdir(tmp_path / "out")) == ["data.bin", "data.idx", "data.meta.json",
                                                    "data.tokenizer.json"]


def test_txt_by_line_and_multiple_inputs_keep_order(tmp_path, tok_path):
    (tmp_path / "lines.txt").write_text("first line\nsecond line\n\nthird\n", encoding="utf-8")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "from json"}) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "mixed")
    preprocess([str(tmp_path / "lines.txt"), str(tmp_path / "d.jsonl")], prefix, tokenizer=tok_path,
               text_key="body", txt_sample_by="line")
    tok = load_tokenizer(tok_path)
    got, _ = _read_back(prefix)
    assert got == _expected(tok, ["first line", "second line", "third", "from json"])


def test_a_gzipped_text_file_is_one_document(tmp_path, tok_path):
    """`.txt.gz` under the default `txt_sample_by="document"`: decompressed, one document, as by
    paragraph or line (its compressed bytes were skipped as a file that is not UTF-8)."""
    import gzip

    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as f:
        f.write("compressed text\n\nsecond paragraph\n")
    (tmp_path / "b.txt").write_text("plain text\n", encoding="utf-8")
    prefix = str(tmp_path / "gz")
    meta = preprocess([str(tmp_path / "a.txt.gz"), str(tmp_path / "b.txt")], prefix,
                      tokenizer=tok_path)
    got, _ = _read_back(prefix)
    assert got == _expected(load_tokenizer(tok_path), ["compressed text\n\nsecond paragraph\n",
                                                       "plain text\n"])
    assert meta["documents"] == 2


def test_repeated_inputs_a_bom_and_a_directory_of_shards(tmp_path, tok_path, capsys):
    """A file named and also matched by a glob was read twice; a text file's UTF-8 BOM became three
    byte tokens; a directory of JSONL shards is read file by file, as its documents say, but the
    run now says so (it trained on JSON syntax without a word), and `.ndjson` holds records."""
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfwith a bom\n")
    (tmp_path / "b.ndjson").write_text(json.dumps({"text": "a record"}) + "\n", encoding="utf-8")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "s0.jsonl").write_text(json.dumps({"text": "shard"}) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "out")
    meta = preprocess([str(tmp_path / "a.txt"), str(tmp_path / "*.txt"),
                       str(tmp_path / "b.ndjson"), str(shards)], prefix, tokenizer=tok_path)
    got, _ = _read_back(prefix)
    shard_text = (shards / "s0.jsonl").read_text()
    assert got == _expected(load_tokenizer(tok_path), ["with a bom\n", "a record", shard_text])
    assert meta["documents"] == 3
    err = capsys.readouterr().err
    assert "note: 1 input(s) named more than once, read once" in err
    assert f"note: {shards} holds 1 JSON/parquet file(s) (first {shards / 's0.jsonl'})" in err


def test_trains_bpe_when_no_tokenizer_given(tmp_path):
    inputs, docs = _write_inputs(tmp_path / "in", "jsonl")
    prefix = str(tmp_path / "trained")
    meta = preprocess(inputs, prefix, vocab_size=300)
    tok = load_tokenizer(prefix + ".tokenizer.json")
    assert meta["vocab_size"] == tok.vocab_size <= 300 and meta["tokenizer_source"] == (
        "trained byte-level BPE"
    )
    got, _ = _read_back(prefix)
    assert got == _expected(tok, docs)
    assert [tok.decode(ids[:-1]) for ids in got] == docs


def test_parquet_text_as_string_view_or_a_categorical(tmp_path, tok_path):
    """Text columns that newer writers store as string_view, and pandas categoricals (a dictionary
    of strings), were refused as 'not strings'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first row", "second row", "first row"]
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string_view())}),
                   tmp_path / "v.parquet")
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), tmp_path / "d.parquet")
    prefix = str(tmp_path / "out")
    preprocess([str(tmp_path / "v.parquet"), str(tmp_path / "d.parquet")], prefix,
               tokenizer=tok_path)
    got, _ = _read_back(prefix)
    assert got == _expected(load_tokenizer(tok_path), texts + texts)


def test_a_zst_input_reads_as_its_records(tmp_path, tok_path):
    """A `.jsonl.zst` shard (how large public corpora ship) gives the dataset its uncompressed
    `.jsonl` gives."""
    import zstandard

    text = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (tmp_path / "a.jsonl").write_text(text, encoding="utf-8")
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    for name in ("a.jsonl", "b.jsonl.zst"):
        preprocess([str(tmp_path / name)], str(tmp_path / name.split(".")[0]), tokenizer=tok_path)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()


def test_a_zst_input_without_zstandard_names_the_package(tmp_path, tok_path, monkeypatch):
    """`datasets` said only 'Compression type zstd not supported' (zstandard made unimportable)."""
    import importlib.util
    import sys

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "zstandard" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    (tmp_path / "a.jsonl.zst").write_bytes(b"(\xb5/\xfd not really zstd")
    with pytest.raises(ValueError, match="needs the zstandard package: pip install zstandard"):
        preprocess([str(tmp_path / "a.jsonl.zst")], str(tmp_path / "out"), tokenizer=tok_path)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl.zst"]


def test_bpe_trains_on_a_long_run_of_letters_in_pieces():
    """A document that is one run of letters (a DNA sequence): the trainer's cost grew with the
    square of the run (4 s at 100k letters, a 2 MB one did not finish in 200 s); it takes such a
    run in pieces of BPE_TRAINING_WORD, and ordinary text whole, as before."""
    import random

    from tandem.data_pipeline import tokenizer as tokenizer_module

    random.seed(0)
    dna = "".join(random.choice("ACGT") for _ in range(200_000))
    limit = tokenizer_module.BPE_TRAINING_WORD
    pieces = list(tokenizer_module._bounded_words(["x " + dna + " y", *DOCS]))
    assert "".join(pieces[:-len(DOCS)]) == "x " + dna + " y" and pieces[-len(DOCS):] == DOCS
    assert max(len(p) for p in pieces) <= limit + 2
    tok = train_bpe(iter(["x " + dna + " y", *DOCS]), 300)
    assert tok.decode(tok.encode(dna[:5000])) == dna[:5000]
    assert tok.vocab_size == 300


def test_refuses_to_overwrite_and_leaves_files_untouched(tmp_path, tok_path):
    inputs, _ = _write_inputs(tmp_path / "in", "jsonl")
    prefix = str(tmp_path / "ds")
    preprocess(inputs, prefix, tokenizer=tok_path)
    files = [prefix + s for s in (".bin", ".idx", ".meta.json", ".tokenizer.json")]
    before = {f: (open(f, "rb").read(), os.stat(f).st_mtime_ns) for f in files}
    other = tmp_path / "other.txt"
    other.write_text("completely different", encoding="utf-8")
    with pytest.raises(FileExistsError, match="overwrite"):
        preprocess([str(other)], prefix, tokenizer=tok_path)
    assert {f: (open(f, "rb").read(), os.stat(f).st_mtime_ns) for f in files} == before
    assert sorted(os.listdir(tmp_path)) == sorted(["in", "other.txt"] + [os.path.basename(f)
                                                                         for f in files])

    preprocess([str(other)], prefix, tokenizer=tok_path, overwrite=True)
    got, _ = _read_back(prefix)
    assert got == _expected(load_tokenizer(tok_path), ["completely different"])


def test_interrupted_run_leaves_no_complete_looking_prefix(tmp_path, tok_path, monkeypatch):
    inputs, _ = _write_inputs(tmp_path / "in", "jsonl")
    prefix = str(tmp_path / "out" / "ds")

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pp, "_commit", boom)
    with pytest.raises(KeyboardInterrupt):
        preprocess(inputs, prefix, tokenizer=tok_path)
    assert os.listdir(tmp_path / "out") == []


def test_a_failed_overwrite_keeps_the_old_dataset_and_the_new_one(tmp_path, tok_path,
                                                                  monkeypatch):
    """A rename that fails while `overwrite` moves the new dataset into place (EIO on the staged
    .idx): the old dataset is back byte for byte, and the new one is kept whole in the staging
    directory the one-line error names (the old files had been deleted first, the staged ones
    after the error)."""
    inputs, _ = _write_inputs(tmp_path / "in", "jsonl")
    prefix = str(tmp_path / "out" / "ds")
    preprocess(inputs, prefix, tokenizer=tok_path)
    files = [prefix + s for s in (".bin", ".idx", ".meta.json", ".tokenizer.json")]
    before = {f: open(f, "rb").read() for f in files}
    other = tmp_path / "other.txt"
    other.write_text("completely different", encoding="utf-8")
    real_replace = os.replace

    def eio_on_staged_idx(src, dst):
        if str(src).endswith(os.sep + "data.idx"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", eio_on_staged_idx)
    with pytest.raises(OSError, match=f"at {prefix} .*as it was.* kept in ") as exc:
        preprocess([str(other)], prefix, tokenizer=tok_path, overwrite=True)
    monkeypatch.undo()
    assert "\n" not in str(exc.value)
    assert {f: open(f, "rb").read() for f in files} == before
    staging = str(exc.value).split(" kept in ")[1].split(" ")[0]
    got, _ = _read_back(os.path.join(staging, "data"))
    assert got == _expected(load_tokenizer(tok_path), ["completely different"])
    assert sorted(os.listdir(staging)) == ["data.bin", "data.idx", "data.meta.json",
                                           "data.tokenizer.json"]


def test_missing_input_and_missing_text_key_are_clear(tmp_path, tok_path):
    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        preprocess([str(tmp_path / "nothere.jsonl")], str(tmp_path / "x"), tokenizer=tok_path)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"content": "abc"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'text'"):
        preprocess([str(p)], str(tmp_path / "x"), tokenizer=tok_path)
    assert not os.path.exists(tmp_path / "x.bin")


def test_a_datasets_directory_without_a_text_column_is_named(tmp_path, tok_path):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": ["a", "b"], "n": [1, 2]}).save_to_disk(str(saved))
    with pytest.raises(ValueError, match=rf"^{saved}: no 'text' field .*\(fields: body, n\)"):
        preprocess([str(saved)], str(tmp_path / "x"), tokenizer=tok_path)
    with pytest.raises(ValueError, match=rf"^{saved}: column 'n' holds int64, not strings"):
        preprocess([str(saved)], str(tmp_path / "x"), tokenizer=tok_path, text_key="n")
    assert sorted(os.listdir(tmp_path)) == ["saved"]


def test_cli_prints_summary_and_refuses_overwrite(tmp_path, tok_path, capsys):
    inputs, docs = _write_inputs(tmp_path / "in", "jsonl")
    prefix = str(tmp_path / "cli")
    assert preprocess_main(["--input", *inputs, "--output-prefix", prefix, "--tokenizer",
                            tok_path]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"{len(docs)} documents" in out[0] and prefix in out[0]
    with pytest.raises(SystemExit) as exc:
        preprocess_main(["--input", *inputs, "--output-prefix", prefix, "--tokenizer", tok_path])
    assert exc.value.code == 2
    assert "already exists" in capsys.readouterr().err
    assert preprocess_main(["--input", *inputs, "--output-prefix", prefix, "--vocab-size", "300",
                            "--overwrite"]) == 0


def test_cli_refuses_a_negative_tokenizer_sample(tmp_path, capsys):
    """A negative --tokenizer-sample-bytes once trained a BPE anyway; it fails before any file is
    read or written."""
    with pytest.raises(SystemExit) as exc:
        preprocess_main(["--input", str(tmp_path / "none.jsonl"), "--output-prefix",
                         str(tmp_path / "x"), "--tokenizer-sample-bytes", "-1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == ("tandem preprocess: error: "
                                               "--tokenizer-sample-bytes -1 must be >= 0 (0: all)")
    assert os.listdir(tmp_path) == []


def test_large_vocab_uses_int32():
    assert pp.token_dtype(4096) == np.uint16
    assert pp.token_dtype(65499) == np.uint16
    assert pp.token_dtype(65500) == np.int32
    assert pp.token_dtype(151_000) == np.int32


def _listing(root):
    return sorted(os.path.relpath(os.path.join(d, x), root) for d, ds, fs in os.walk(root)
                  for x in ds + fs)


def _cli_fails(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        preprocess_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("chat", [[], ["--chat"]])
@pytest.mark.parametrize("prefix, problem, example", [
    ("", "is empty", "./corpus"),
    ("out/", "ends in '/'", "out/corpus"),
    ("out", "is a directory", "out/corpus"),
])
def test_output_prefix_naming_a_directory_is_refused(tmp_path, tok_path, capsys, monkeypatch,
                                                     prefix, problem, example, chat):
    """`--output-prefix ""` once wrote `<cwd>.bin` and friends beside the working directory, and
    `out/` wrote `out.bin` beside the folder."""
    inputs, _ = _write_inputs(tmp_path / "work" / "in", "jsonl")
    (tmp_path / "work" / "out").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    before = _listing(tmp_path)
    line = _cli_fails(["--input", *inputs, "--output-prefix", prefix, "--tokenizer", tok_path,
                       *chat], capsys)
    assert line == (f"tandem preprocess: error: output prefix {prefix!r} (--output-prefix) "
                    f"{problem}: the files are named PREFIX.bin, PREFIX.idx, ...; give e.g. "
                    f"{example}")
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("name, body, message", [
    ("empty.jsonl", "", "no documents found in {path}"),
    ("blank.jsonl", "\n  \n\n", "no documents found in {path}"),
    # a dataset of whitespace with a degenerate BPE, written without a word
    ("whitespace.jsonl", '{"text": ""}\n{"text": "   \\n\\t "}\n', "no documents found in {path}"),
    ("bad.jsonl", '{"text": "a"}\n\n{oops\n', "{path}:3: not valid JSON (Expecting property name"),
    ("number.jsonl", '{"text": "a"}\n{"text": 5}\n', "{path}:2: 'text' is not a string (found 5)"),
    ("list.json", "[1,2,3]", "{path}:record 1: not a JSON object"),
    ("line.jsonl", '"just a string"\n', "{path}:1: not a JSON object"),
    # named the file only ("not UTF-8 text"), or `datasets`' "An error occurred while generating"
    ("latin.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "{path}:2: not UTF-8 text"),
    ("surrogate.jsonl", '{"text": "a"}\n{"text": "\\ud800"}\n',
     "{path}:2: text with a lone surrogate"),
])
def test_bad_json_records_are_named_before_tokenizer_training(tmp_path, capsys, monkeypatch, name,
                                                              body, message):
    """These once gave `StopIteration`, megatron's 'Instruction "train" corresponds to no data!', a
    two-line message without a line number, or were read as the text "5"."""
    path = tmp_path / name
    path.write_bytes(body if isinstance(body, bytes) else body.encode("utf-8"))
    monkeypatch.setattr(pp, "train_bpe", lambda *a, **k: pytest.fail("tokenizer trained"))
    before = _listing(tmp_path)
    line = _cli_fails(["--input", str(path), "--output-prefix", str(tmp_path / "out" / "ds")],
                      capsys)
    assert line.startswith("tandem preprocess: error: " + message.format(path=path)), line
    assert _listing(tmp_path) == before


def test_json_arrays_objects_and_empty_files_beside_others_still_read(tmp_path, tok_path):
    (tmp_path / "array.json").write_text('[\n{"text": "a"},\n{"text": null},\n{"text": "b"}\n]\n')
    (tmp_path / "object.json").write_text('{\n  "text": "c"\n}\n')
    (tmp_path / "empty.jsonl").write_text("")
    inputs = [str(tmp_path / n) for n in ("array.json", "empty.jsonl", "object.json")]
    meta = preprocess(inputs, str(tmp_path / "ds"), tokenizer=tok_path)
    got, _ = _read_back(str(tmp_path / "ds"))
    assert got == _expected(load_tokenizer(tok_path), ["a", "b", "c"])
    assert meta["skipped_empty_documents"] == 1


def test_only_the_text_field_is_read(tmp_path, tok_path, capsys):
    """Files whose other fields differ (a `url` in one, an `id` in another, a `meta` object that
    turns into a string; Parquet files of other columns) failed in `datasets`, which built one
    schema from every field: "An error occurred while generating the dataset". A record without the
    text field is said, not only counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text('{"text": "a", "url": "http://x"}\n'
                                      '{"text": "b", "meta": {"x": 2}}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "c", "id": 7, "meta": "str"}\n{"txt": "lost"}\n')
    pq.write_table(pa.table({"text": ["d"], "url": ["u"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["e"], "id": [1]}), tmp_path / "b.parquet")
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "a.parquet", "b.parquet")]
    assert preprocess_main(["--input", *inputs, "--output-prefix", str(tmp_path / "ds"),
                            "--tokenizer", tok_path]) == 0
    got, _ = _read_back(str(tmp_path / "ds"))
    assert got == _expected(load_tokenizer(tok_path), ["a", "b", "c", "d", "e"])
    assert (f"skipped 1 record(s) without a 'text' field (first {tmp_path / 'b.jsonl'}:2)"
            in capsys.readouterr().err)
    assert read_meta(str(tmp_path / "ds"))["skipped_records_without_text_key"] == 1


def test_sigterm_removes_the_staging_directory(tmp_path, tok_path):
    """SIGTERM (a Slurm time limit, scancel) mid-preprocess left the hidden staging directory, with
    the partial dataset in it, for good."""
    import signal
    import subprocess
    import sys
    import time

    with open(tmp_path / "big.jsonl", "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.trainer.cli", "preprocess", "--input",
                             str(tmp_path / "big.jsonl"), "--output-prefix",
                             str(tmp_path / "out" / "ds"), "--tokenizer", tok_path],
                            stderr=subprocess.PIPE, text=True)
    out, deadline = tmp_path / "out", time.monotonic() + 120
    while (not (out.is_dir() and any(n.startswith(".ds.staging") for n in os.listdir(out)))
           and time.monotonic() < deadline):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert os.listdir(out) == []


def test_each_document_starts_with_the_tokenizers_bos(tmp_path):
    """A Llama-style tokenizer's BOS starts every document once, as transformers' `tokenizer(text)`
    (the reference) and Megatron-LM's preprocessing give it; it was dropped."""
    from transformers import PreTrainedTokenizerFast

    from tests.unit.test_data_tokenizer import _bos_tokenizer

    path = _bos_tokenizer(tmp_path / "tok")
    docs = ["b c", "c", "a b c a"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = str(tmp_path / "out" / "data")
    preprocess([str(src)], prefix, tokenizer=load_tokenizer(str(path), eod_token="</s>"))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert _read_back(prefix)[0] == [ref(d).input_ids + [1] for d in docs]
    assert all(row[0] == 0 and row.count(0) == 1 for row in _read_back(prefix)[0])


def test_eod_token_for_a_tokenizer_without_an_eos(tmp_path, capsys, monkeypatch):
    """A tokenizer that names no EOS (and holds none of the usual ones) was refused with advice to
    pass an argument that no command had: `--eod-token` names the token that ends each document,
    and training reads it back from meta.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from tandem.data_pipeline.dataset import tokenizer_for_prefixes

    backend = Tokenizer(models.WordLevel({"<end>": 0, "a": 1, "b": 2}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<end>", special=True)])
    tok = str(tmp_path / "tokenizer.json")
    backend.save(tok)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "a b"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    prefix = str(tmp_path / "data")
    monkeypatch.chdir(tmp_path)  # a relative --tokenizer: meta.json records where it is
    argv = ["--input", str(src), "--output-prefix", prefix, "--tokenizer", "tokenizer.json"]
    with pytest.raises(SystemExit) as exited:
        preprocess_main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--eod-token" in err and err.count("\n") == 1, err
    assert preprocess_main(argv + ["--eod-token", "<end>"]) == 0
    assert _read_back(prefix)[0] == [[1, 2, 0], [2, 0]]
    assert tokenizer_for_prefixes([prefix], "").eod_token == "<end>"
    assert read_meta(prefix)["tokenizer_source"] == tok
