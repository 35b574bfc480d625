"""Chat data with prompt masking (data.source=jsonl): records -> windows whose loss mask and doc ids
keep every depth's targets on response tokens of their own record, checked against hand-counted
cases with a word-level tokenizer where one word is one token."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tandem.data_pipeline.batches import get_batch
from tandem.data_pipeline.chat import chat_encoder, check_files, iter_encoded
from tandem.data_pipeline.chat_dataset import ChatWindows
from tandem.data_pipeline.dataset import build_datasets
from tandem.data_pipeline.tokenizer import load_tokenizer
from tandem.models.mtp import depth_target_mask
from tandem.trainer.config import TandemConfig
from tandem.trainer.config_checks import ConfigError

SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = "p1 p2 r1 r2 q1 s1 s2 u1 a1 u2 a2".split()
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_tokenizer(directory, template) -> str:
    """A word-level tokenizer directory (id 0 = EOD); with `template` (True: TEMPLATE, or a
    template's text), a chat template in its config."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS + ["<think>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS + ["<think>"]])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if template:
        config["chat_template"] = TEMPLATE if template is True else template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def kept(batch, depth):
    """Positions t whose depth-`depth` target (token t+1+depth) counts, as the model decides it."""
    mask = depth_target_mask(batch["loss_mask"], batch["doc_ids"], depth)[0]
    return [t for t in range(mask.shape[0]) if mask[t]]


def encoded(tok_dir, path):
    encoder = chat_encoder(load_tokenizer(tok_dir), tok_dir)
    check_files([path], encoder)
    return list(iter_encoded([path], encoder))


def test_prompt_response_packed_hand_counted(tmp_path):
    """No template: prompt ids then response ids then EOD. Stream (seq_len 8, one window):
        t:      0  1  2  3  4  5  6  7  8
        token:  p1 p2 r1 r2 E  q1 s1 s2 E      doc: 0 0 0 0 0 1 1 1 1
    depth 0 keeps targets r1 r2 E (t=1,2,3) and s1 s2 E (t=5,6,7), never q1 (prompt); depth 1
    (target t+2): t=0,1,2 (r1 r2 E) and 5,6 (s2 E); t=4 -> s1 crosses records, t=3 -> q1 prompt;
    depth 2 (target t+3): t=0,1 (r2 E) and 5 (E); t=3,4 would reach s1/s2 from record one."""
    tok = make_tokenizer(tmp_path / "tok", template=False)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p1 p2", "response": "r1 r2"},
                                              {"prompt": "q1", "response": "s1 s2"}])
    ds = ChatWindows(encoded(tok, path), seq_len=8, packing="pack", eod_id=0)
    batch = get_batch(ds, [0])
    words = SPECIALS + WORDS
    assert [words[i] for i in batch["tokens"][0]] == "<|endoftext|>".join(["p1 p2 r1 r2 ",
                                                                           " q1 s1 s2 ",
                                                                           ""]).split()
    assert batch["doc_ids"][0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert kept(batch, 0) == [1, 2, 3, 5, 6, 7]
    assert kept(batch, 1) == [0, 1, 2, 5, 6]
    assert kept(batch, 2) == [0, 1, 5]
    # the model counts the same targets per depth (main head, MTP 1, MTP 2), masked or not by
    # document
    from tandem.models import ModelConfig, MTPConfig, TandemModel

    torch.manual_seed(0)
    model = TandemModel(ModelConfig(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2,
                                    num_kv_heads=1,
                                    intermediate_size=16, moe_intermediate_size=8, num_experts=2,
                                    top_k=1,
                                    first_k_dense=1, max_seq_len=16),
                        MTPConfig(num_steps=2, num_layers=1))
    for document_mask in (False, True):
        out = model(batch["tokens"], batch["loss_mask"], batch["doc_ids"], document_mask)
        assert out.token_counts.tolist() == [6, 5, 3]


def test_messages_with_template_hand_counted(tmp_path):
    """Template render of [user u1, assistant a1, user u2, assistant a2]:
        <|user|> u1 <|end|> <|assistant|> a1 <|end|> <|user|> u2 <|end|> <|assistant|> a2 <|end|> E
    The loss is on a1 <|end|> and a2 <|end|> E (each turn's content and end-of-turn, not its
    header); depth 1 keeps only targets two tokens after a position inside the record that are
    assistant tokens."""
    tok = make_tokenizer(tmp_path / "tok", template=True)
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}])
    ((_, ids, flags),) = encoded(tok, path)
    words = SPECIALS + WORDS
    assert [words[i]
            for i in ids] == ("<|user|> u1 <|end|> <|assistant|> a1 <|end|> <|user|> u2 <|end|> "
                                       "<|assistant|> a2 <|end|> <|endoftext|>").split()
    assert flags.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    ds = ChatWindows([("x", ids, flags)], seq_len=12, packing="pad", eod_id=0)
    batch = get_batch(ds, [0])
    assert kept(batch, 0) == [3, 4, 9, 10, 11]
    assert kept(batch, 1) == [2, 3, 8, 9, 10]
    assert kept(batch, 2) == [1, 2, 7, 8, 9]


def test_a_template_ending_turns_with_the_eod_learns_no_second_one(tmp_path):
    """ChatML where `<|im_end|>` is the EOS: each turn ends `<|im_end|>\n`, and the EOD appended
    after the record was learnt as well, so every depth was taught a second end after the turn's
    (`...<|im_end|>\n<|im_end|>`). It only separates the record now."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["hello there\nI am fine user assistant system"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    bpe.save(str(tok_dir / "tokenizer.json"))
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
              "'<|im_end|>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
         "chat_template": chatml}))
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "I am fine"}]
    ((_, ids, flags),) = encoded(str(tok_dir), write_jsonl(tmp_path / "d.jsonl",
                                                           [{"messages": msgs}]))
    tok = load_tokenizer(str(tok_dir))
    assert tok.eod_token == "<|im_end|>" and ids[-1] == tok.eod_id and flags[-1] == 0
    assert tok.decode([int(i) for i, f in zip(ids, flags) if f]) == "I am fine<|im_end|>\n"


def test_a_template_without_a_generation_prompt_does_not_train_the_header(tmp_path):
    """A template that ignores add_generation_prompt renders `<|assistant|>` as part of the turn:
    the loss is still on each turn's content and end-of-turn only, as in the hand-counted case
    above (the header was a target)."""
    tok = make_tokenizer(tmp_path / "tok", template=TEMPLATE.split("{% if")[0])
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    ((_, ids, flags),) = encoded(tok, write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}]))
    assert len(ids) == 13 and flags.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("system", [False, True])
def test_a_conversation_that_opens_with_the_assistant(tmp_path, system):
    """[assistant a1, user u1, assistant a2], with TEMPLATE and with one that renders a default
    system turn (`<|user|> s1 s2 <|end|>`, as Qwen2.5's does) before a conversation that has none:
    the loss is on each turn's content and end-of-turn only. The first turn's span ran from the
    rendering's first character, so its header and the default system turn were targets."""
    template = TEMPLATE
    if system:
        template = ("{% if messages[0].role != 'system' %}<|user|> s1 s2 <|end|> {% endif %}"
                    + TEMPLATE)
    tok = make_tokenizer(tmp_path / "tok", template=template)
    msgs = [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a2"}]
    ((_, ids, flags),) = encoded(tok, write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}]))
    words = SPECIALS + WORDS
    text = ("<|assistant|> a1 <|end|> <|user|> u1 <|end|> <|assistant|> a2 <|end|> "
            "<|endoftext|>").split()
    lead = "<|user|> s1 s2 <|end|>".split() if system else []
    assert [words[i] for i in ids] == lead + text
    assert flags.tolist() == [0] * len(lead) + [0, 1, 1, 0, 0, 0, 0, 1, 1, 1]


def test_byte_level_bpe_trains_a_responses_first_word(tmp_path):
    """A byte-level BPE joins a word to the space before it: after the header `<|assistant|> ` the
    response's first token is ` forty`, which starts one character before the assistant span. It is
    a response token (it was left out when only a token's first character counted); the header and
    the user's words are not."""
    from tokenizers import AddedToken

    from tandem.data_pipeline.tokenizer import train_bpe

    texts = ["hello world the answer is forty two", "what is the answer please tell me"] * 50
    backend = train_bpe(iter(texts), 300).backend
    backend.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS[1:]])
    directory = tmp_path / "bpe"
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "chat_template": TEMPLATE}))
    tok = load_tokenizer(str(directory))
    msgs = [{"role": "user", "content": "what is the answer"},
            {"role": "assistant", "content": "forty two"}]
    ids, flags = chat_encoder(tok, str(directory)).encode("x", {"messages": msgs}, "messages")
    pieces = [tok.decode([i]) for i in ids.tolist()]
    trained = [p.strip() for p, f in zip(pieces, flags.tolist()) if f and p.strip()]
    assert pieces[pieces.index("<|assistant|>") + 1] == " forty", pieces
    assert trained == ["forty", "two", "<|end|>", "<|endoftext|>"], list(zip(pieces, flags))


def test_template_that_rewrites_earlier_turns(tmp_path):
    """A Qwen3-like template marks only the last assistant turn (`<think>`): the earlier turn's span
    is found by its content plus the end-of-turn text, the last one's includes the marker it
    generates."""
    last_only = ("{% for m in messages %}<|{{ m.role }}|> {% if m.role == 'assistant' and "
                 "loop.last %}<think> "
                 "{% endif %}{{ m.content }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    tok = make_tokenizer(tmp_path / "tok", template=last_only)
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    ((_, ids, flags),) = encoded(tok, write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}]))
    words = SPECIALS + WORDS + ["<think>"]
    assert [words[i]
            for i in ids] == ("<|user|> u1 <|end|> <|assistant|> a1 <|end|> <|user|> u2 <|end|> "
                                       "<|assistant|> <think> a2 <|end|> <|endoftext|>").split()
    assert flags.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    # a user message that quotes the reply: the reply trains, not the quote (the turn's content
    # was searched from the conversation's start and matched the user's `a1 <|end|>` first)
    msgs[0]["content"] = "u1 a1"
    ((_, ids, flags),) = encoded(tok, write_jsonl(tmp_path / "q.jsonl", [{"messages": msgs}]))
    assert [words[i] for i, f in zip(ids, flags) if f] == ["a1", "<|end|>", "<think>", "a2",
                                                           "<|end|>", "<|endoftext|>"]
    assert flags.tolist()[:7] == [0, 0, 0, 0, 0, 1, 1]
    # a reply repeated in a later turn trains there too: each turn's search starts past the last
    # one's span (from the start, the second `a1` found the first turn's again)
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a2"}]
    ((_, ids, flags),) = encoded(tok, write_jsonl(tmp_path / "r.jsonl", [{"messages": msgs}]))
    assert [words[i] for i, f in zip(ids, flags) if f] == [
        "a1", "<|end|>", "a1", "<|end|>", "<think>", "a2", "<|end|>", "<|endoftext|>"]


def test_prompt_response_uses_the_template_and_generate_ids(tmp_path):
    """With a template a prompt/response record is one user and one assistant turn; records carrying
    `tandem generate`'s ids train on exactly those ids."""
    tok = make_tokenizer(tmp_path / "tok", template=True)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p1", "response": "r1"},
                                              {"prompt": "x", "response": "y", "prompt_ids": [4, 5],
                                               "response_ids": [6, 0]},
                                              {"prompt_ids": [4], "response_ids": [6, 7],
                                               "finished": False},
                                              {"prompt_ids": [4], "response_ids": [6, 3],
                                               "finished": True}])
    (_, ids1, flags1), (_, ids2, flags2), (_, ids3, flags3), (_, ids4, flags4) = encoded(tok, path)
    # cut off: its end is not learnt
    assert ids3.tolist() == [4, 6, 7, 0] and flags3.tolist() == [0, 1, 1, 0]
    # ended at another stop id (a chat model's end of turn, which generate stops at): learnt, and
    # the EOD after it only separates the records
    assert ids4.tolist() == [4, 6, 3, 0] and flags4.tolist() == [0, 1, 1, 0]
    assert ids1.tolist() == [1, 4, 3, 2, 6, 3, 0] and flags1.tolist() == [0, 0, 0, 0, 1, 1, 1]
    # already EOD-terminated
    assert ids2.tolist() == [4, 5, 6, 0] and flags2.tolist() == [0, 0, 1, 1]


def test_padding_keeps_records_apart(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", template=False)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p1", "response": "r1"},
                                              {"prompt": "q1", "response": "s1 s2"}])
    ds = ChatWindows(encoded(tok, path), seq_len=6, packing="pad", eod_id=0)
    batch = get_batch(ds, [0, 1])
    assert batch["tokens"][0].tolist() == [4, 6, 0, 0, 0, 0, 0]
    assert batch["loss_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
    assert batch["doc_ids"][1].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert kept(batch, 1) == [0]  # r1 -> E; nothing in the padding


@pytest.mark.parametrize("line, expected", [
    ({"question": "q"}, "d.jsonl:2: a record needs"),
    ({"messages": [{"role": "user", "content": "u1"}]},
     "d.jsonl:2: messages have no assistant turn"),
    ({"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]},
     "d.jsonl:2: messages need a chat template"),
    ("not json", "d.jsonl:2: not valid JSON"),
])
def test_bad_records_name_file_and_line(tmp_path, line, expected):
    tok = make_tokenizer(tmp_path / "tok", template=False)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "p1", "response": "r1"}) + "\n"
                    + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    encoder = chat_encoder(load_tokenizer(tok), tok)
    with pytest.raises(ValueError, match=expected):
        check_files([str(path)], encoder)


@pytest.mark.parametrize("line, expected", [
    ({"prompt_ids": [4, 5], "response_ids": [6, 99]}, "d.jsonl:3: token id 99 is outside"),
    ({"messages": [{"role": "assistant", "content": "a1"}]},
     "d.jsonl:3: the chat template failed: 'open with the user'"),
    ({"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "s9"}]},
     "d.jsonl:3: cannot find assistant turn 2"),
    ('{"prompt": "p1 \\ud800", "response": "r1"}', "d.jsonl:3: text with a lone surrogate"),
], ids=["id_outside_vocabulary", "template_raises", "turn_not_rendered", "lone_surrogate"])
def test_a_bad_record_fails_before_any_is_tokenised(tmp_path, monkeypatch, line, expected):
    """What only encoding found (the template's own raise_exception, an assistant turn it does not
    render, ids outside the vocabulary, a lone surrogate the tokenizer fails on) is found by the
    check, before the first record is tokenised (it failed after the records before it were)."""
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('open with the user') }}"
                "{% endif %}" + TEMPLATE.split("{% if")[0].replace(
                    "{{ m.content }}", "{{ m.content | replace('s9', 's1') }}"))
    tok = make_tokenizer(tmp_path / "tok", template=template)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "p1", "response": "r1"}) + "\n"
                    + json.dumps({"prompt_ids": [4], "response_ids": [6]}) + "\n"
                    + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    encoder = chat_encoder(load_tokenizer(tok), tok)
    monkeypatch.setattr(encoder.tokenizer, "encode_rendered",
                        lambda *a: pytest.fail("a record was tokenised before the check"))
    with pytest.raises(ValueError, match=expected):
        check_files([str(path)], encoder)


def test_record_longer_than_window_when_padding(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", template=False)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p1 p2 p1 p2", "response": "r1 r2"}])
    with pytest.raises(ValueError,
                       match=r"d.jsonl:1: a record of 7 tokens .* longer than data.seq_len=4"):
        ChatWindows(encoded(tok, path), seq_len=4, packing="pad", eod_id=0)


def test_build_datasets_reads_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = make_tokenizer(tmp_path / "tok", template=True)
    rows = [{"prompt": "p1 p2", "response": "r1 r2"}] * 6
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "valid.parquet")
    cfg = TandemConfig()
    cfg.data.source, cfg.data.paths, cfg.data.tokenizer = "jsonl", [train], tok
    cfg.data.valid_paths, cfg.data.packing = [str(tmp_path / "valid.parquet")], "pad"
    train_ds, valid_ds, tokenizer = build_datasets(cfg.data, 16, 1234, 8, 2, model_vocab_size=64)
    assert len(train_ds) == 6 and len(valid_ds) == 2 and tokenizer.eod_id == 0
    batch = get_batch(valid_ds, [0])
    # targets p1 p2 <|end|> <|assistant|>: 0
    assert batch["loss_mask"][0, :8].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(get_batch(train_ds, [0])["tokens"], batch["tokens"])

    # records whose responses are all empty (no template adds an end of turn to learn): every
    # loss would be 0 / 0, and the run reported 0
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "p1 p2", "response": ""}] * 6)
    cfg.data.paths, cfg.data.valid_paths, cfg.data.packing = [empty], [], "pack"
    cfg.data.tokenizer = make_tokenizer(tmp_path / "plain", template=False)
    with pytest.raises(ValueError, match="empty.jsonl holds no response token"):
        build_datasets(cfg.data, 16, 1234, 8, 2, model_vocab_size=64)


def test_config_keys():
    cfg = TandemConfig()
    cfg.data.source = "jsonl"
    with pytest.raises(ConfigError, match="data.paths"):
        cfg.data.validate(cfg)
    cfg.data.paths, cfg.data.packing = ["x.jsonl"], "pad"
    with pytest.raises(ConfigError, match="data.tokenizer"):
        cfg.data.validate(cfg)
    cfg.data.tokenizer = "tok"
    cfg.data.validate(cfg)
    cfg.data.source = "megatron"
    with pytest.raises(ConfigError, match="pad needs data.source=jsonl"):
        cfg.data.validate(cfg)


def test_datasets_directory_records(tmp_path):
    """A `datasets` directory (save_to_disk) reads as records, bad rows named by row."""
    import datasets

    from tandem.data_pipeline.chat import iter_records

    datasets.Dataset.from_list([{"prompt": "p1", "response": "r1"},
                                {"prompt": "q1", "response": None}]).save_to_disk(
        str(tmp_path / "ds"))
    tok = make_tokenizer(tmp_path / "tok", template=False)
    assert [w.rsplit(":", 1)[1] for w, _ in iter_records([str(tmp_path / "ds")])] == ["row 1",
                                                                                      "row 2"]
    with pytest.raises(ValueError, match=r"ds:row 2: a record needs"):
        check_files([str(tmp_path / "ds")], chat_encoder(load_tokenizer(tok), tok))


QWEN_LIKE = (
    "{%- for m in messages %}{%- if m.role == 'system' %}<|system|> {{ m.content }} <|end|>\n"
    "{%- elif m.role == 'user' %}<|user|> {{ m.content }} <|end|>\n"
    "{%- else %}<|assistant|> {% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}"
    "{% endif %}{{ m.content }} <|end|>\n{%- endif %}"
    "{%- if loop.index > 8 %}{% break %}{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.mark.parametrize("template", [TEMPLATE, QWEN_LIKE], ids=["plain", "qwen_like"])
def test_renderer_equals_transformers(tmp_path, template):
    """data_pipeline/chat_template.render_chat renders as transformers' apply_chat_template does
    (the independent reference), with and without the generation prompt: whitespace control, loop
    controls, `tojson` of non-ASCII text, the template read from the tokenizer directory."""
    from transformers import AutoTokenizer

    from tandem.data_pipeline.chat_template import chat_template_in, render_chat

    tok = make_tokenizer(tmp_path / "tok", template=template)
    hf = AutoTokenizer.from_pretrained(tok, local_files_only=True)
    chat = chat_template_in([tok])
    msgs = [{"role": "system", "content": "s1"}, {"role": "user", "content": "u1 é"},
            {"role": "assistant", "content": "a1", "tool_calls": [{"name": "f", "arg": "ü"}]},
            {"role": "user", "content": "u2"}]
    for generation_prompt in (False, True):
        want = hf.apply_chat_template(msgs, tokenize=False,
                                      add_generation_prompt=generation_prompt)
        assert render_chat(chat, msgs, generation_prompt) == want


def test_finished_and_cut_off_samples_of_one_prompt_share_a_split(tmp_path):
    """Two `tandem generate` samples per prompt, one that ended at the EOD and one cut off by the
    token budget (`finished: false`, so an EOD that is no target is appended): both are the same
    prompt's and go to one split. The appended EOD made the second one's key its prompt plus the
    EOD, and two to four of six prompts had samples in both splits."""
    from tandem.data_pipeline.chat_dataset import split_records

    tok = make_tokenizer(tmp_path / "tok", template=False)
    p = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    rows = []
    for n, word in enumerate("p1 p2 q1 u1 u2 s1".split()):
        rows.append({"prompt_ids": [p[word], p["p2"]], "response_ids": [p["r1"], 0]})
        rows.append({"prompt_ids": [p[word], p["p2"]], "response_ids": [p["r1"], p["r2"]],
                     "finished": False})
    records = encoded(tok, write_jsonl(tmp_path / "g.jsonl", rows))
    assert [r[2].tolist() for r in records[:2]] == [[0, 0, 1, 1], [0, 0, 1, 1, 0]]
    for seed in range(5):
        train, valid = split_records(records, "50,50,0", seed)
        assert (len(train), len(valid)) == (6, 6)
        prompts = [{tuple(r[1][:2]) for r in part} for part in (train, valid)]
        assert not prompts[0] & prompts[1], seed


def test_records_of_one_prompt_share_a_split():
    """`tandem generate --samples-per-prompt 3` writes three records per prompt: the split sent
    some of a prompt's records to validation and the rest to training, so the evaluator's prompts
    and validation loss were on prompts the run trained on. Records that share no prompt split as
    before, record by record."""
    from tandem.data_pipeline.chat_dataset import split_records

    def record(prompt, response):
        return ("f.jsonl", np.array(prompt + response), np.array([0] * len(prompt)
                                                                + [1] * len(response)))

    alone = [record([p, p + 1], [7, 8, p]) for p in range(40)]
    train, valid = split_records(alone, "80,20", seed=3)
    order = np.random.default_rng(3).permutation(40)
    assert [r[1].tolist() for r in train + valid] == [alone[i][1].tolist() for i in order]
    assert (len(train), len(valid)) == (32, 8)
    samples = [record([p, p + 1], [7, s, p]) for p in range(40) for s in range(3)]
    train, valid = split_records(samples, "80,20", seed=3)
    prompts = [{tuple(r[1][:2]) for r in part} for part in (train, valid)]
    assert not prompts[0] & prompts[1] and len(prompts[0] | prompts[1]) == 40
    assert (len(train), len(valid)) == (96, 24)
