"""``tool_choice`` ``"required"`` or a named function: the reply is held by
structured outputs to JSON that calls tools (vLLM's way), so any model calls
them, with or without a tool parser.

- A named function: the reply is its arguments, an object of the
  function's ``parameters`` schema (any object without one): one call.
- ``"required"``: the reply is a JSON array of at least one
  ``{"name": ..., "parameters": {...}}``, each the name of a given tool and
  arguments of its schema.

The JSON is compact (no whitespace between tokens: arguments are for
programs, and a weak model cannot pad them without end). The calls come out
as a tool parser's do: :meth:`ForcedToolCalls.extract`
for a whole reply, :meth:`ForcedToolCalls.stream` for a streamed one (every
call in the last delta, once the JSON is whole). A reply that does not
parse (cut off by ``max_tokens``) is returned as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.hermes_tool_parser import ParsedToolCall

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ForcedToolCalls:
    def __init__(
        self, parameters: dict[str, dict[str, Any] | None], named: str | None
    ) -> None:
        """``parameters``: each given tool's name and JSON schema;
        ``named``: the function the reply must call, None for "required"."""
        self.parameters, self.named = parameters, named

    @property
    def structured_outputs(self) -> StructuredOutputsParams:
        if self.named is not None:
            return StructuredOutputsParams(
                json=self.parameters[self.named] or ANY_OBJECT,
                disable_any_whitespace=True,
            )
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [name]},
                    "parameters": schema or ANY_OBJECT,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.parameters.items()
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputsParams(json=array, disable_any_whitespace=True)

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """No content and the reply's calls, or the reply as content where
        it does not parse."""
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return text or None, []
        if self.named is not None:
            arguments = json.dumps(value, ensure_ascii=False)
            return None, [ParsedToolCall(self.named, arguments)]
        calls = [
            ParsedToolCall(
                call["name"], json.dumps(call["parameters"], ensure_ascii=False)
            )
            for call in value
        ]
        return None, calls

    def stream(self) -> ForcedCallStream:
        return ForcedCallStream(self)


@dataclass
class ForcedCallStream:
    """A streamed reply's calls: nothing until the reply ends (its JSON is
    whole only then), then all of them, or the reply as content."""

    forced: ForcedToolCalls
    held: str = ""
    calls: int = 0  # sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        self.held += text
        if not final:
            return "", []
        content, calls = self.forced.extract(self.held)
        self.held, self.calls = "", self.calls + len(calls)
        return content or "", calls
