"""Prompts as ``LLM.generate`` takes them besides plain text and token-id
lists: vLLM's typed dicts, so that scripts written for vLLM run as they
are."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
