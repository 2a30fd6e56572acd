"""Reasoning parsers: a reply's thinking, split from its answer
(``vllm serve --reasoning-parser NAME``; chat completions report it as
``reasoning_content``)."""

from __future__ import annotations

from vllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}

__all__ = ["REASONING_PARSERS", "Qwen3ReasoningParser"]
