"""A suite prompt past the evaluator's prompt length keeps its last tokens (eval/suites.py
`tokenize_suite`), and before them the tokenizer's leading ids: a Llama or DeepSeek tokenizer's
BOS was cut away with the prompt's start, so every long HumanEval or MT-Bench prompt was decoded as
no served prompt is."""

from __future__ import annotations

from tandem.eval.suites import SuitePrompt, tokenize_suite


class _BosTokenizer:
    """Characters as ids, BOS = 1 before a text that starts a prompt (`start_ids`)."""

    start_ids = [1]

    def encode(self, text, start=False):
        return ([1] if start else []) + [ord(c) for c in text]


class _PlainTokenizer(_BosTokenizer):
    start_ids: list = []

    def encode(self, text, start=False):
        return [ord(c) for c in text]


def test_a_cut_prompt_keeps_its_bos_and_then_its_last_tokens():
    text = "def f(x):\n    return x + 1\n"
    prompts = [SuitePrompt("humaneval", None, "x:1", text), SuitePrompt("humaneval", None, "x:2",
                                                                        "def g():")]
    ids, cut = tokenize_suite(prompts, _BosTokenizer(), None, 10)
    assert cut == 1
    assert ids[0] == [1] + [ord(c) for c in text[-9:]]  # BOS, then the last 9 characters
    assert ids[1] == [1] + [ord(c) for c in "def g():"]  # short enough: untouched
    # a tokenizer without leading ids keeps the last `limit` tokens, as before
    ids, _ = tokenize_suite(prompts, _PlainTokenizer(), None, 10)
    assert ids[0] == [ord(c) for c in text[-10:]]
    # no room for the BOS besides a token: the last token alone
    ids, _ = tokenize_suite(prompts[:1], _BosTokenizer(), None, 1)
    assert ids[0] == [ord("\n")]
