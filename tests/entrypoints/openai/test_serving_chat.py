"""How a reply's text becomes chat messages and deltas under the reasoning
parser (the live server's side is ``test_reasoning.py``)."""

from vllm.entrypoints.openai.protocol import DeltaMessage
from vllm.entrypoints.openai.serving_chat import chat_message, delta_message
from vllm.reasoning import Qwen3ReasoningParser

PARSER = Qwen3ReasoningParser()
REPLY = "<think>plan a</think>answer"


def test_a_whole_reply_becomes_one_message():
    assert chat_message(None, REPLY, False, True).content == REPLY
    split = chat_message(PARSER, REPLY, False, True)
    assert (split.reasoning, split.content) == ("plan a", "answer")
    dropped = chat_message(PARSER, REPLY, False, False)
    assert (dropped.reasoning, dropped.content) == (None, "answer")
    thinking = chat_message(PARSER, "cut short", True, True)
    assert (thinking.reasoning, thinking.content) == ("cut short", None)
    plain = chat_message(PARSER, "no thinking", False, True)
    assert (plain.reasoning, plain.content) == (None, "no thinking")


def test_two_choices_stream_apart_and_held_text_sends_nothing():
    pieces = ["<thi", "nk>plan", " a</th", "ink>ans", "wer", ""]
    streams = [PARSER.stream(), PARSER.stream()]
    got: list[list[DeltaMessage | None]] = [[], []]
    for i, piece in enumerate(pieces):  # the choices' deltas interleaved
        for choice in (0, 1):
            final = i == len(pieces) - 1
            got[choice].append(delta_message(streams[choice], piece, final, True))
    for deltas in got:
        assert deltas[0] is None  # "<thi" may open the tag: held
        sent = [d for d in deltas if d is not None]
        assert "".join(d.reasoning or "" for d in sent) == "plan a"
        assert "".join(d.content or "" for d in sent) == "answer"
        assert deltas[-1] == DeltaMessage()  # the final one, with nothing new


def test_without_reasoning_only_the_answer_streams():
    stream = PARSER.stream()
    deltas = [delta_message(stream, p, False, False) for p in ("<think>x", "</think>")]
    assert deltas == [None, None]
    assert delta_message(stream, "y", True, False) == DeltaMessage(content="y")


def test_without_a_parser_text_streams_as_it_comes():
    assert delta_message(None, "", False, True) is None
    assert delta_message(None, "<think>", False, True) == DeltaMessage(
        content="<think>"
    )
    assert delta_message(None, "", True, True) == DeltaMessage(content="")
