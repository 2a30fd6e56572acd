"""Qwen3's thinking: a reply that opens with ``<think>`` reasons until
``</think>``, then answers.

As vLLM's ``qwen3`` parser. A reply thinks if it opens with the tag, or if
its prompt does (Qwen3 thinking-only templates end the prompt with
``<think>``): then everything up to ``</think>`` is reasoning. With
``enable_thinking: false`` Qwen3's template puts an empty
``<think>\\n\\n</think>\\n\\n`` in the prompt, and the reply, all answer,
is content. A reply cut off while thinking (``max_tokens``) is all
reasoning, streamed or not.

The split works on text, so a tag spread over several tokens (a tokenizer
without Qwen3's added tokens) splits alike. Streamed, a tail that may still
become a tag is held back until the next text decides it; each delta costs
its own length, not the reply's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


def tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix
    of ``tag`` (text that may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the reply inside
    ``<think>``."""
    return prompt_tail.rstrip().endswith(THINK_START)


class _Phase(enum.Enum):
    OPENING = "opening"  # the reply may still open with the tag
    THINKING = "thinking"
    ANSWERING = "answering"


@dataclass
class ReasoningStream:
    """The split of one streamed reply, delta by delta."""

    phase: _Phase = _Phase.OPENING
    held: str = ""  # text that may still become a tag

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """The new ``(reasoning, content)`` text once ``delta`` is added;
        ``final`` for the reply's last delta."""
        text, self.held = self.held + delta, ""
        if self.phase is _Phase.OPENING:
            if text.startswith(THINK_START):
                self.phase, text = _Phase.THINKING, text[len(THINK_START) :]
            elif not final and THINK_START.startswith(text):
                self.held = text
                return "", ""
            else:
                self.phase = _Phase.ANSWERING
        if self.phase is _Phase.ANSWERING:
            return "", text
        reasoning, tag, content = text.partition(THINK_END)
        if tag:
            self.phase = _Phase.ANSWERING
            return reasoning, content
        hold = 0 if final else tag_prefix_len(text, THINK_END)
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold], ""


class Qwen3ReasoningParser:
    @staticmethod
    def split(text: str, thinking: bool = False) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a whole reply: reasoning is None for a
        reply without thinking; ``thinking`` if its prompt opened the tag."""
        if not thinking:
            if not text.startswith(THINK_START):
                return None, text
            text = text[len(THINK_START) :]
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content

    @staticmethod
    def stream(thinking: bool = False) -> ReasoningStream:
        return ReasoningStream(_Phase.THINKING if thinking else _Phase.OPENING)
