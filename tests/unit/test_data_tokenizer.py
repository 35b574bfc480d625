"""Tokenizer wrapper: byte-level BPE round trip, determinism, loading and its errors."""

import random

import pytest

from tandem.data_pipeline.tokenizer import EOD_TOKEN, load_tokenizer, train_bpe

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
] * 20


def _random_text(rng: random.Random, n: int) -> str:
    pools = [
        "abcdefghijklmnopqrstuvwxyz ",
        " \t\n\r",
        "{}[]()<>|!@#$%^&*_-+=~`'\"\\/",
        "éßøπλ中文日本語한국어",
        "🙂🚀👍🏽",
        "\x00\x01\x7f\u200b\ufeff",
    ]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(n))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(iter(CORPUS), 300, str(out)), out


def test_bpe_round_trips_arbitrary_text(bpe):
    tok, _ = bpe
    rng = random.Random(0)
    texts = [_random_text(rng, rng.randint(0, 200)) for _ in range(200)]
    texts += ["", " ", "\n\n", "  leading spaces", "trailing  ", EOD_TOKEN,
              f"a{EOD_TOKEN}b"] + CORPUS[:3]
    for text in texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_bpe_vocab_eod_and_literal_special_string(bpe):
    tok, _ = bpe
    assert tok.eod_token == EOD_TOKEN and tok.eod_id == 0
    assert 258 <= tok.vocab_size <= 300
    # the literal string inside a document is text, never a spurious end-of-document
    assert tok.eod_id not in tok.encode(f"x = '{EOD_TOKEN}'")
    assert tok.decode([tok.eod_id]) == EOD_TOKEN


def test_bpe_is_deterministic(tmp_path, bpe):
    tok, path = bpe
    again = train_bpe(iter(CORPUS), 300, str(tmp_path / "again.json"))
    assert (tmp_path / "again.json").read_text() == path.read_text()
    assert again.encode(CORPUS[1]) == tok.encode(CORPUS[1])


def test_load_tokenizer_file_and_directories(tmp_path, bpe):
    tok, path = bpe
    text = "def f(x):\n    return x * 2  # ünï\n"
    from_file = load_tokenizer(str(path))
    assert from_file.encode(text) == tok.encode(text) and from_file.vocab_size == tok.vocab_size
    assert from_file.eod_id == tok.eod_id

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text(path.read_text())
    assert load_tokenizer(str(bare)).encode(text) == tok.encode(text)

    from transformers import PreTrainedTokenizerFast

    hf_dir = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_file=str(path),
                            eos_token=EOD_TOKEN).save_pretrained(str(hf_dir))
    hf = load_tokenizer(str(hf_dir))
    assert hf.encode(text) == tok.encode(text)
    assert hf.eod_id == tok.eod_id and hf.decode(hf.encode(text)) == text


def test_a_directory_whose_tokenizer_class_is_its_own_keeps_its_eos(tmp_path):
    """A tokenizer_config.json naming a class of the directory's own code (`auto_map`, ChatGLM's)
    is read as its bare tokenizer.json, without running that code or asking at the terminal, and
    with the EOS the config names (the first default candidate in the vocabulary was taken)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world " * 10], trainers.BpeTrainer(
        vocab_size=280, special_tokens=[EOD_TOKEN, "<|user|>", "<|eot|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ChatGLM4Tokenizer", "eos_token": "<|eot|>",
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]}}))
    loaded = load_tokenizer(str(tmp_path))
    assert (loaded.eod_token, loaded.eod_id) == ("<|eot|>", 2)


def test_truncation_and_padding_saved_in_a_tokenizer_do_not_reach_the_ids(tmp_path, bpe):
    """A tokenizer.json saved with truncation or padding on (as fine-tuned repos often are), read
    as a file and as a Hugging Face directory: every document's ids are all of its text and nothing
    else. Preprocessing cut each document at max_length, or filled the short ones of a batch with
    pad ids before their EOD, which the loss then counted."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok, path = bpe
    texts = [CORPUS[1] * 3, "x", CORPUS[0]]
    want = [tok.encode(t) for t in texts]
    assert len(want[0]) > 8 and len({len(w) for w in want}) == 3
    saved = Tokenizer.from_file(str(path))
    saved.enable_truncation(max_length=8)
    saved.enable_padding(pad_id=5, pad_token="!")
    saved.save(str(tmp_path / "tokenizer.json"))
    hf_dir = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                            eos_token=EOD_TOKEN).save_pretrained(str(hf_dir))
    for source in (tmp_path / "tokenizer.json", hf_dir):
        loaded = load_tokenizer(str(source))
        assert [loaded.encode(t) for t in texts] == want, source
        assert loaded.encode_batch(texts) == want, source


def test_load_tokenizer_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(str(bad))
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="emptydir"):
        load_tokenizer(str(empty_dir))


def test_unknown_eod_token_is_a_clear_error(bpe):
    _, path = bpe
    with pytest.raises(ValueError, match="<nope>"):
        load_tokenizer(str(path), eod_token="<nope>")


def test_a_checkpoint_keeps_its_tokenizers_eos_and_chat_template(tmp_path):
    """A run whose tokenizer directory names `<|im_end|>` its EOS (Qwen3's) trains with that
    end-of-document token. Its checkpoint records the directory's side files with tokenizer.json,
    so `tandem eval` / `tandem generate --checkpoint` stop at that token too, and an export ships
    the EOS and the chat template (a bare tokenizer.json fell back to `<|endoftext|>`, without
    a template)."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from tandem.data_pipeline.chat_template import chat_template_in
    from tandem.data_pipeline.tokenizer import copy_tokenizer, saved_tokenizer
    from tandem.trainer.eval_cli import load_run_tokenizer
    from tandem.trainer.recipe import load_config

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.WordLevel({s: i for i, s in enumerate(specials + ["a", "b"])},
                                         unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(s, special=True) for s in specials])
    source, step = tmp_path / "qwen_tokenizer", tmp_path / "step_1"
    source.mkdir()
    step.mkdir()
    backend.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}))
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}"
                                                "{% endfor %}")
    assert load_tokenizer(str(source)).eod_token == "<|im_end|>"

    copy_tokenizer(str(source), str(step))
    assert saved_tokenizer(str(step)) == str(step)
    assert load_tokenizer(saved_tokenizer(str(step))).eod_id == 2
    assert chat_template_in([str(step)]) is not None
    cfg = load_config(None, [f"data.tokenizer={source}"])
    assert load_run_tokenizer(cfg, str(step)).eod_token == "<|im_end|>"
    bare = tmp_path / "bare_step"  # a checkpoint from before: its bare tokenizer.json still loads
    bare.mkdir()
    (bare / "tokenizer.json").write_text((source / "tokenizer.json").read_text())
    assert saved_tokenizer(str(bare)) == str(bare / "tokenizer.json")


def test_a_checkpoint_of_megatron_data_keeps_the_eod_the_data_was_made_with(tmp_path):
    """`tandem preprocess` writes a bare `<prefix>.tokenizer.json` and names the EOD it ended each
    document with in its meta.json. A checkpoint's copy of that file loaded with the first default
    candidate (`<|endoftext|>`, id 0) where the data used `<|im_end|>` (id 2), so `tandem eval`
    and `generate` stopped at another token; the copy now says which."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from tandem.data_pipeline.tokenizer import copy_tokenizer, saved_tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.WordLevel({s: i for i, s in enumerate(specials + ["a", "b"])},
                                         unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(s, special=True) for s in specials])
    prefix_file = tmp_path / "corpus.tokenizer.json"
    backend.save(str(prefix_file))
    assert load_tokenizer(str(prefix_file)).eod_id == 0  # what a bare copy loads with
    for eod, want in (("<|im_end|>", 2), ("<|endoftext|>", 0), (None, 0)):
        step = tmp_path / f"step_{want}_{eod is None}"
        step.mkdir()
        copy_tokenizer(str(prefix_file), str(step), eod_token=eod)
        assert load_tokenizer(saved_tokenizer(str(step))).eod_id == want
        # the default's copy stays a bare file, loaded without transformers
        assert (step / "tokenizer_config.json").exists() == (want == 2)
    # a tokenizer naming no EOS, and holding none of the usual ones (tandem preprocess --eod-token)
    backend.add_special_tokens([AddedToken("<sep>", special=True)])
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] == "<sep>"]
    spec["model"]["vocab"] = {"<sep>": 5, "a": 3, "b": 4}
    no_eos = tmp_path / "no_eos.tokenizer.json"
    no_eos.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="--eod-token"):
        load_tokenizer(str(no_eos))
    step = tmp_path / "step_no_eos"
    step.mkdir()
    copy_tokenizer(str(no_eos), str(step), eod_token="<sep>")
    assert load_tokenizer(saved_tokenizer(str(step))).eod_id == 5
    # what a run's checkpoint records: its tokenizer as its data was made with (a run built from a
    # Megatron prefix loads it with the meta.json's EOD)
    import torch

    from tandem.trainer.checkpoint import CheckpointWriter

    model = torch.nn.Linear(2, 2)
    run_tok = load_tokenizer(str(prefix_file), eod_token="<|im_end|>")
    written = CheckpointWriter(str(tmp_path / "run"), tokenizer=run_tok).save(
        1, model, torch.optim.AdamW(model.parameters()), "a: 1\n", {})
    assert load_tokenizer(saved_tokenizer(written)).eod_id == 2
    # a directory's own settings are kept when its EOS is not the data's
    source = tmp_path / "dir"
    source.mkdir()
    backend.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "chat_template": "{{ messages }}"}))
    step = tmp_path / "step_dir"
    step.mkdir()
    copy_tokenizer(str(source), str(step), eod_token="<|im_end|>")
    assert load_tokenizer(saved_tokenizer(str(step))).eod_id == 2
    assert json.loads((step / "tokenizer_config.json").read_text())["chat_template"] == (
        "{{ messages }}")


def _bos_tokenizer(tmp_path, bos="<s>"):
    """A Llama-style tokenizer.json: its post-processor puts `bos` before every text."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    specials = ["<s>", "</s>", "<|endoftext|>"]
    backend = Tokenizer(models.WordLevel(
        {s: i for i, s in enumerate(specials + ["a", "b", "c"])}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(s, special=True) for s in specials])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, specials.index(bos))])
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    return path


def test_a_document_or_prompt_starts_with_the_tokenizers_bos(tmp_path):
    """Plain text that begins a document or a prompt gets the BOS a Llama or DeepSeek tokenizer's
    post-processor adds, as transformers' `tokenizer(text)` (the reference here), Megatron-LM's
    preprocessing and vLLM's prompts give it: once, before the text, never before a response; the
    chat and ids forms are left as their template or ids say. It was dropped everywhere."""
    import json

    from transformers import PreTrainedTokenizerFast

    from tandem.data_pipeline.chat import ChatEncoder
    from tandem.data_pipeline.prompts import Prompt, tokenize_prompts

    path = _bos_tokenizer(tmp_path)
    tok = load_tokenizer(str(path), eod_token="</s>")
    ref = PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert tok.start_ids == [0]
    for text in ("b c", "c c b a"):
        assert tok.encode(text, start=True) == ref(text).input_ids == [0, *tok.encode(text)]
    assert tok.encode_batch(["b", "c b"], start=True) == [ref("b").input_ids, ref("c b").input_ids]
    enc = ChatEncoder(tok)
    ids, flags = enc.encode("r:1", {"text": "b c"}, "text")
    assert ids.tolist() == [0, 4, 5, 1] and flags.tolist() == [1, 1, 1, 1]
    ids, flags = enc.encode("r:2", {"prompt": "b", "response": "c"}, "prompt")
    assert ids.tolist() == [0, 4, 5, 1] and flags.tolist() == [0, 0, 1, 1]
    _, rows = tokenize_prompts([Prompt("p:1", "c b")], tok, None, 16, "")
    assert rows == [[0, 5, 4]]
    # the BOS is part of what a dataset's tokenizer is checked by: a prefix made with it is not
    # one made without it
    from tandem.data_pipeline.tokenizer import tokenizer_fingerprint

    plain = tmp_path / "plain.json"
    spec = json.loads(path.read_text())
    plain.write_text(json.dumps({**spec, "post_processor": None}))
    assert load_tokenizer(str(plain)).start_ids == []
    assert tokenizer_fingerprint(str(plain)) != tokenizer_fingerprint(str(path))
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(str(path))
    # a tokenizer without one, and one whose BOS is its end-of-document token, add nothing
    assert load_tokenizer(str(_bos_tokenizer(tmp_path / "eod", "</s>")),
                          eod_token="</s>").start_ids == []
