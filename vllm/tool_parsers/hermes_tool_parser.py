"""Hermes-style tool calls (Qwen2.5 / Qwen3 and others): a reply calls a
tool with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

As vLLM's ``hermes`` parser. The text outside the calls is the reply's
content (``None`` when empty; blanks after a call dropped); each call's
arguments become a JSON string (a string argument too: vLLM dumps it). A
call that is not such JSON (a model's slip, or one cut off by
``max_tokens``) leaves the whole reply as content, so nothing is lost; an
unclosed last call that is whole JSON still counts.

Streamed, content passes through until a tag may start (a tail that may
still become ``<tool_call>`` is held back, as the reasoning parser does);
a call is sent whole, name and arguments in one delta, once its closing
tag arrives. A call that does not parse goes out as content (the calls
before it are sent already); at the end a call still open is sent if it
parses, else its text goes out as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from vllm.reasoning.qwen3_reasoning_parser import tag_prefix_len

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


def _parse_call(body: str) -> ParsedToolCall | None:
    """The call in a tag's body, or None where it is not a call (nesting too
    deep to parse included)."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    # always dumped, a string too (as vLLM): what goes out is JSON that the
    # client can send back
    arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
    return ParsedToolCall(call["name"], arguments)


class HermesToolParser:
    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """A whole reply's content (the text outside the calls) and calls;
        a call that does not parse leaves all of it as content."""
        content, calls = ToolCallStream().feed(text, final=True)
        if CALL_START in content:
            return text, []
        return content or None, calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream()


@dataclass
class ToolCallStream:
    """The calls of one streamed reply, delta by delta."""

    held: str = ""  # content that may start a tag, or an open call's text
    in_call: bool = False
    after_call: bool = False  # blanks that follow a call are dropped
    calls: int = 0  # sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) that ``text`` completes; ``final`` flushes."""
        self.held += text
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.held.find(CALL_END)
                if end < 0:
                    break
                call = _parse_call(self.held[:end])
                if call is None:  # not a call after all: its text is content
                    content += CALL_START + self.held[: end + len(CALL_END)]
                else:
                    calls.append(call)
                self.held = self.held[end + len(CALL_END) :]
                self.in_call, self.after_call = False, call is not None
            else:
                if self.after_call:
                    self.held = self.held.lstrip()
                    self.after_call = not self.held
                start = self.held.find(CALL_START)
                if start < 0:
                    keep = tag_prefix_len(self.held, CALL_START)
                    content += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep :]
                    break
                content += self.held[:start]
                self.held = self.held[start + len(CALL_START) :]
                self.in_call = True
        if final:
            call = _parse_call(self.held) if self.in_call else None
            if call is not None:
                calls.append(call)
            else:
                content += (CALL_START if self.in_call else "") + self.held
            self.held, self.in_call = "", False
        self.calls += len(calls)
        return content, calls
