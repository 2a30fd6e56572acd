"""A request's output text, grown token by token.

Byte-level tokenizers split multi-byte characters over several tokens; the
text of a prefix then ends in U+FFFD until the character completes. The
detokenizer holds such a tail back, and the last ``len(longest stop) - 1``
characters too (they may begin a stop string), so every piece it emits is
whole text that stays in the output, and the pieces add up to it.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.token_ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string appeared; text ends before it

    def update(self, token_ids: list[int]) -> str:
        """Add tokens; returns the new text (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        complete = full.rstrip(_INCOMPLETE) if full.endswith(_INCOMPLETE) else full
        hold = max((len(s) for s in self.stop), default=1) - 1
        # A stop string may begin in text already emitted or held back.
        start = max(0, len(self.text) - hold)
        hits = [h for h in (complete.find(s, start) for s in self.stop) if h >= 0]
        if hits:
            self.stopped = True
            return self._emit(complete[: min(hits)])
        return self._emit(complete[: len(complete) - hold])

    def flush(self) -> str:
        """At the request's end: what was held back (bytes that never became a
        character decode to U+FFFD)."""
        if self.stopped:
            return ""
        return self._emit(
            self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        )

    def _emit(self, text: str) -> str:
        delta = text[len(self.text) :]
        if len(text) > len(self.text):
            self.text = text
        return delta
