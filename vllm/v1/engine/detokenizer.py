"""A request's output text, grown token by token.

Byte-level tokenizers split multi-byte characters over several tokens; the
text of a prefix then ends in U+FFFD until the character completes. The
detokenizer holds such a tail back, and the last ``len(longest stop) - 1``
characters too (they may begin a stop string), so every piece it emits is
whole text that stays in the output, and the pieces add up to it.

Each update decodes a short window of tokens, not the whole sequence (as
vLLM's ``detokenize_incrementally`` and Hugging Face's ``TextStreamer`` do):
``_prefix_offset:_read_offset`` are tokens already turned into text, kept as
context (SentencePiece decodes a word's leading space only after another
token), and ``_read_offset:`` are the new ones. The window moves on once its
text ends in a whole character, so a step costs O(window), not O(sequence).
A stop string counts only if it ends past the text of the first
``min_tokens`` tokens (vLLM's rule); the text ends before it, or after it
with ``include_stop_str_in_output``; so does the text of a token that
ended the request (EOS, a stop token id). Special tokens are left out of
the text unless ``skip_special_tokens`` is False.
"""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import SamplingParams

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        min_tokens: int = 0,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        # the text a stop string must end past: None until there are
        # min_tokens tokens, then the length of theirs
        self._stop_from: int | None = None if min_tokens else 0
        self.token_ids: list[int] = []
        self.text = ""  # emitted so far
        # the stop string that appeared (the text ends before it)
        self.stop_string: str | None = None
        self._complete = ""  # decoded text ending in a whole character
        self._prefix_offset = 0
        self._read_offset = 0

    @classmethod
    def for_params(
        cls, tokenizer: Any, params: SamplingParams
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            params.stop_strings,
            params.min_tokens,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def update(self, token_ids: list[int], stop_terminated: bool = False) -> str:
        """Add tokens; returns the new text (possibly empty).
        ``stop_terminated``: the last of them ended the request (EOS, a stop
        token id, a finished grammar); as in vLLM its text is left out
        unless ``include_stop_str_in_output``."""
        if self.stopped:
            return ""
        if stop_terminated and not self.include_stop:
            token_ids = token_ids[:-1]
        self.token_ids.extend(token_ids)
        new_text = self._window_text()
        if new_text and not new_text.endswith(_INCOMPLETE):
            self._complete += new_text
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
        if self._stop_from is None and len(self.token_ids) >= self.min_tokens:
            self._stop_from = len(self._decode(self.token_ids[: self.min_tokens]))
        hold = max((len(s) for s in self.stop), default=1) - 1
        return self._emit_until_stop(self._complete, hold)

    def flush(self) -> str:
        """At the request's end: what was held back (bytes that never became a
        character decode to U+FFFD), up to a stop string in it."""
        if self.stopped:
            return ""
        return self._emit_until_stop(self._complete + self._window_text(), 0)

    def _emit_until_stop(self, text: str, hold: int) -> str:
        """Emit ``text`` up to its first stop string, else all but its last
        ``hold`` characters."""
        hold_back = max((len(s) for s in self.stop), default=1) - 1
        # A stop string may begin in text already emitted or held back.
        hits = []
        if self._stop_from is not None:
            # one must end past the first min_tokens tokens' text (vLLM's rule)
            emitted = len(self.text) - hold_back
            found = (
                (text.find(s, max(self._stop_from - len(s) + 1, emitted, 0)), s)
                for s in self.stop
            )
            hits = [(at, s) for at, s in found if at >= 0]
        if hits:
            at, self.stop_string = min(hits)  # the first; the shortest at a tie
            kept = len(self.stop_string) if self.include_stop else 0
            return self._emit(text[: at + kept])
        return self._emit(text[: max(len(text) - hold, 0)])

    def _window_text(self) -> str:
        """Text of the tokens after ``_read_offset``, decoded after their
        context so that it reads as in the whole sequence."""
        ids = self.token_ids
        context = self._decode(ids[self._prefix_offset : self._read_offset])
        return self._decode(ids[self._prefix_offset :])[len(context) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens
        )

    def _emit(self, text: str) -> str:
        delta = text[len(self.text) :]
        if len(text) > len(self.text):
            self.text = text
        return delta
