"""Qwen3's thinking: a reply that starts with ``<think>`` reasons until
``</think>``, then answers.

As vLLM's ``qwen3`` parser, and strict: only a reply that starts with the
opening tag has reasoning. With ``enable_thinking: false`` Qwen3's template
puts an empty ``<think>\\n\\n</think>\\n\\n`` in the prompt, and the reply,
all answer, is content. A reply cut off while thinking (``max_tokens``) is
all reasoning: the same split streamed and not (vLLM's non-streaming parser
reports such a reply as content, tags included, while its stream has
already sent it as reasoning).

The split works on text, so a tag split over several tokens (any tokenizer
without Qwen3's added tokens) splits alike. Streamed, a tail that may still
become a tag is held back until the next text decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


def _tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix
    of ``tag`` (text that may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Qwen3ReasoningParser:
    @staticmethod
    def split(text: str, final: bool = True) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a reply's ``text``: reasoning is None
        for a reply without thinking. Not ``final``: as much of each as the
        text so far decides (each a prefix of its final value)."""
        if not text.startswith(THINK_START):
            if not final and THINK_START.startswith(text):
                return None, ""  # may yet open with the tag
            return None, text
        body = text[len(THINK_START) :]
        reasoning, tag, content = body.partition(THINK_END)
        if not tag and not final:
            reasoning = reasoning[: len(reasoning) - _tag_prefix_len(body, THINK_END)]
        return reasoning, content

    def stream(self) -> ReasoningStream:
        """The split of one streamed reply, delta by delta."""
        return ReasoningStream(self)


@dataclass
class ReasoningStream:
    parser: Qwen3ReasoningParser
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """The new ``(reasoning, content)`` text once ``delta`` is added;
        ``final`` for the reply's last delta."""
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        reasoning = reasoning or ""
        new = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new
