"""`tandem preprocess --chat` writes the tokens and a loss-mask channel; `data.source=megatron`
reads both over megatron-core's shuffled samples, with the loss on response tokens only and record
boundaries as doc ids (so no MTP depth's target crosses records); bad input fails in one line naming
file and line."""

from __future__ import annotations

import json
import os

import pytest

from tandem.data_pipeline.batches import get_batch
from tandem.data_pipeline.dataset import build_datasets
from tandem.data_pipeline.preprocess_cli import preprocess_main  # noqa: E402
from tandem.models.mtp import depth_target_mask  # noqa: E402
from tandem.trainer.config import TandemConfig  # noqa: E402
from tests.unit.test_chat_data import SPECIALS, WORDS, make_tokenizer, write_jsonl

# a response's EOD is learnt (it ends the answer)
RESPONSE_WORDS = {"r1", "r2", "s1", "s2", "<|endoftext|>"}


def records(n: int):
    """Prompt words and response words never overlap, so each target's expected flag is its
    word's."""
    prompts, responses = ["p1 p2", "q1", "p2 q1 p1"], ["r1 r2", "s1 s2 s1", "r2"]
    return [{"prompt": prompts[i % 3], "response": responses[(i // 3) % 3]} for i in range(n)]


def megatron_cfg(prefix: str, tok: str):
    cfg = TandemConfig()
    cfg.data.source, cfg.data.paths, cfg.data.tokenizer, cfg.data.split = (
        "megatron",
        [prefix],
        tok,
        "80,20,0",
    )
    cfg.data.cache_dir = os.path.dirname(prefix)
    return cfg


def test_preprocess_chat_then_megatron_windows(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok", template=False)
    data = write_jsonl(tmp_path / "chat.jsonl", records(30))
    prefix = str(tmp_path / "out" / "chat")
    assert preprocess_main(["--chat", "--input", data, "--output-prefix", prefix, "--tokenizer",
                            tok]) == 0
    assert "with loss mask" in capsys.readouterr().out
    for ext in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx", ".meta.json"):
        assert os.path.isfile(prefix + ext), ext
    cfg = megatron_cfg(prefix, tok)
    train_ds, valid_ds, _ = build_datasets(cfg.data, 8, 1234, 40, 4)
    words = SPECIALS + WORDS
    for i in range(20):
        batch = get_batch(train_ds, [i])
        tokens, mask, docs = batch["tokens"][0], batch["loss_mask"][0], batch["doc_ids"][0]
        expect = [float(words[int(t)] in RESPONSE_WORDS) for t in tokens[1:]]
        assert mask.tolist() == expect, (i, tokens.tolist())
        # records are EOD-terminated here, so record boundaries equal EOD counts
        is_eod = (tokens == 0).long()
        assert docs.tolist() == (is_eod.cumsum(0) - is_eod).tolist()
        for depth in range(3):
            keep = depth_target_mask(mask[None], docs[None], depth)[0]
            for t in keep.nonzero().flatten().tolist():
                assert docs[t] == docs[t + depth
                                       + 1] and words[int(tokens[t + depth + 1])] in RESPONSE_WORDS
    assert valid_ds is not None


def test_plain_overwrite_drops_the_channel(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", template=False)
    data = write_jsonl(tmp_path / "chat.jsonl", records(6))
    prefix = str(tmp_path / "chat")
    assert preprocess_main(["--chat", "--input", data, "--output-prefix", prefix, "--tokenizer",
                            tok]) == 0
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "p1 r1"}])
    assert preprocess_main(["--input", text, "--output-prefix", prefix, "--tokenizer", tok,
                            "--overwrite"]) == 0
    assert not os.path.exists(prefix + "_loss_mask.bin")


@pytest.mark.parametrize("bad, expected", [
    ({"question": "q"}, "chat.jsonl:3: a record needs"),
    ({"messages": [{"role": "user", "content": "p1"}, {"role": "assistant", "content": "r1"}]},
     "chat.jsonl:3: messages need a chat template"),
])
def test_bad_record_is_one_line_before_any_output(tmp_path, capsys, bad, expected):
    tok = make_tokenizer(tmp_path / "tok", template=False)
    data = write_jsonl(tmp_path / "chat.jsonl", records(2) + [bad])
    prefix = str(tmp_path / "chat")
    with pytest.raises(SystemExit) as exc:
        preprocess_main(["--chat", "--input", data, "--output-prefix", prefix, "--tokenizer", tok])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl", "tok"]  # nothing written, no staging left


def test_a_channel_of_other_documents_with_the_same_totals_is_refused(tmp_path):
    """The channel of another preprocessing with the same number of documents and tokens (5 + 3
    against 3 + 5) put beside the tokens: each flag would fall on another token. Only the totals
    were compared, so it was read."""
    import shutil

    from tandem.data_pipeline.dataset import check_loss_mask_channel

    tok = make_tokenizer(tmp_path / "tok", template=False)
    prefixes = []
    for name, recs in (("a", [{"prompt": "p1 p2", "response": "r1 r2"},
                              {"prompt": "q1", "response": "s1"}]),
                       ("b", [{"prompt": "p1", "response": "r1"},
                              {"prompt": "q1 p2", "response": "s1 s2"}])):
        prefixes.append(str(tmp_path / name))
        assert preprocess_main(["--chat", "--input", write_jsonl(tmp_path / f"{name}.jsonl", recs),
                                "--output-prefix", prefixes[-1], "--tokenizer", tok]) == 0
    check_loss_mask_channel(prefixes[0])
    for ext in (".bin", ".idx"):
        shutil.copy(prefixes[1] + "_loss_mask" + ext, prefixes[0] + "_loss_mask" + ext)
    with pytest.raises(ValueError, match="_loss_mask.idx gives document 0 3 tokens, but .*a.idx 5"):
        check_loss_mask_channel(prefixes[0])


def test_meta_records_the_channel(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", template=True)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "u1"},
                                                               {"role": "assistant",
                                                                "content": "a1"}]}])
    prefix = str(tmp_path / "chat")
    assert preprocess_main(["--chat", "--input", data, "--output-prefix", prefix, "--tokenizer",
                            tok]) == 0
    with open(prefix + ".meta.json") as f:
        meta = json.load(f)
    # <|user|> u1 <|end|> <|assistant|> a1 <|end|> E: a1 <|end|> E are the response
    assert meta["tokens"] == 7 and meta["response_tokens"] == 3 and meta["chat_template"] is True
