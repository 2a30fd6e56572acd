import itertools
import random

import pytest

from vllm.model_executor.model_loader.tiny_checkpoint import train_tokenizer
from vllm.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from vllm.reasoning.qwen3_reasoning_parser import prompt_opens_thinking
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

SPLITS = [
    ("<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
    ("<think>plan</think>", ("plan", "")),
    ("<think></think>answer", ("", "answer")),
    ("<think>plan</think>a</think>b", ("plan", "a</think>b")),  # the first tag ends it
    ("<think>cut short by max_tokens", ("cut short by max_tokens", "")),
    ("<think>", ("", "")),
    ("<think>✓ 日本</think>語", ("✓ 日本", "語")),
    # no opening tag at the start: all content (enable_thinking false)
    ("answer only", (None, "answer only")),
    ("plan</think>answer", (None, "plan</think>answer")),
    (" <think>plan</think>answer", (None, " <think>plan</think>answer")),
    ("<thi", (None, "<thi")),
    ("", (None, "")),
]
# the prompt opened the tag: the reply starts inside it
THINKING_SPLITS = [
    ("plan</think>answer", ("plan", "answer")),
    ("plan only, cut short", ("plan only, cut short", "")),
    ("<think>x</think>y", ("<think>x", "y")),
    ("</thin", ("</thin", "")),
    ("", ("", "")),
]
CASES = [(text, False, want) for text, want in SPLITS]
CASES += [(text, True, want) for text, want in THINKING_SPLITS]


@pytest.mark.parametrize(("text", "thinking", "expected"), CASES)
def test_a_whole_reply_splits_at_the_first_closing_tag(text, thinking, expected):
    assert Qwen3ReasoningParser.split(text, thinking) == expected


def stream_split(text: str, cuts: list[int], thinking: bool) -> tuple[str, str]:
    """The concatenated deltas of ``text`` fed in the pieces ``cuts`` make
    (a repeated cut feeds an empty delta), then an empty final delta."""
    stream = Qwen3ReasoningParser.stream(thinking)
    reasoning = content = ""
    for start, end in itertools.pairwise([0, *cuts, len(text)]):
        r, c = stream.feed(text[start:end], final=False)
        reasoning, content = reasoning + r, content + c
    r, c = stream.feed("", final=True)
    return reasoning + r, content + c


@pytest.mark.parametrize(("text", "thinking", "expected"), CASES)
def test_streamed_in_any_pieces_it_splits_alike(text, thinking, expected):
    reasoning, content = expected
    want = (reasoning or "", content)
    rng = random.Random(len(text))
    # every single cut, every pair of cuts (equal ones: an empty delta),
    # character by character, random
    cuts = [[i] for i in range(len(text) + 1)]
    cuts += [[i, j] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    cuts.append(list(range(1, len(text))))
    for _ in range(20):
        cuts.append(sorted(rng.choices(range(len(text) + 1), k=5)))
    for pieces in cuts:
        assert stream_split(text, pieces, thinking) == want, pieces


def test_a_tail_that_may_become_a_tag_is_held_back():
    stream = Qwen3ReasoningParser.stream()
    assert stream.feed("<th", final=False) == ("", "")
    assert stream.feed("ink>plan </th", final=False) == ("plan ", "")
    assert stream.feed("e", final=False) == ("</the", "")  # not the tag after all
    assert stream.feed("</think", final=False) == ("", "")
    assert stream.feed(">ans", final=False) == ("", "ans")
    assert stream.feed("</think>", final=True) == ("", "</think>")
    no_tag = Qwen3ReasoningParser.stream()
    assert no_tag.feed("<", final=False) == ("", "")
    assert no_tag.feed("b", final=False) == ("", "<b")


def test_detokenized_deltas_of_a_real_tokenizer_split_alike():
    """Tags spread over several tokens of a byte-level BPE (no added
    ``<think>`` tokens), streamed as the server streams: the
    detokenizer's pieces, token by token."""
    tokenizer = train_tokenizer(320)
    reply = "<think>\nThe user wants json.load.\n</think>\n\nimport json ✓"
    ids = tokenizer(reply)["input_ids"]
    assert len(tokenizer("</think>")["input_ids"]) > 1
    detok = IncrementalDetokenizer(tokenizer)
    stream = REASONING_PARSERS["qwen3"].stream()
    reasoning = content = ""
    for i, token in enumerate(ids):
        delta = detok.update([token])
        if i == len(ids) - 1:
            delta += detok.flush()
        r, c = stream.feed(delta, final=i == len(ids) - 1)
        reasoning, content = reasoning + r, content + c
    assert (reasoning, content) == Qwen3ReasoningParser.split(reply)
    assert reasoning == "\nThe user wants json.load.\n"
    assert content == "\n\nimport json ✓"


@pytest.mark.parametrize(
    ("tail", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),  # a thinking-only template
        ("<|im_start|>assistant\n", False),
        ("assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking false
        ("", False),
    ],
)
def test_a_prompt_that_opens_the_tag_starts_the_reply_thinking(tail, opens):
    assert prompt_opens_thinking(tail) is opens
