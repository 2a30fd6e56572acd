"""Tool-call parsers: a reply's tool calls, split from its content
(``vllm serve --enable-auto-tool-choice --tool-call-parser NAME``; chat
completions report them as ``tool_calls``)."""

from __future__ import annotations

from vllm.tool_parsers.hermes_tool_parser import HermesToolParser

TOOL_PARSERS = {"hermes": HermesToolParser}

__all__ = ["TOOL_PARSERS", "HermesToolParser"]
