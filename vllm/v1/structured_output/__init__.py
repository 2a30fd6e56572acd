"""Structured outputs: a request's tokens held to a grammar, with xgrammar
(vLLM's default backend).

The engine parses a request's :class:`StructuredOutputsParams` when it
checks the request (a bad schema, regex or grammar is an error naming the
field, on the rank that admits requests) and compiles it when the request
is added, on a worker thread (xgrammar releases the GIL): the request's
prefill runs meanwhile and only its first sample waits for the grammar, so
a large schema holds back only the grammars queued behind it (one compile
at a time; an aborted request's queued compile is cancelled). Meanwhile
the request holds its place among the running and its KV blocks.
Tensor-parallel ranks compile in the check and when added, at once (their
schedules must stay equal). Compiled grammars are cached, up to 512 MiB. Before
each step samples, the matchers of its rows fill their allowed tokens as a
packed bitmask, which the sampler applies after bias, penalties and bans
(log-probs stay the model's; a row left with no token gets its banned ones
back: the grammar wins over ``min_tokens``). Each resolved token is
accepted by its request's matcher before it is appended: a token the
grammar refuses is never part of the output (the request aborts). A
grammar's next mask depends on the token before it, so under async
scheduling a step that samples for such a request resolves the step in
flight once its own forward is queued: the device runs that forward while
the host waits for the tokens and fills the masks (only its sampling waits).

A matcher that terminates (its grammar complete and a stop token accepted)
finishes its request with "stop" (also under ``ignore_eos``). xgrammar is
imported with the first such request: an engine that never sees one does not
need it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.request import Request, RequestStatus
from vllm.v1.sample.sampler import TokenMasks

logger = init_logger(__name__)

# compiled grammars kept (vLLM's default: a long-running server sees many)
CACHE_LIMIT_BYTES = 512 << 20
_SOURCE = re.compile(r"^(\[[^\]]*\]\s*)?[^\s:]+:\d+:\s*")


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """``vocab_size``: the model's logits' (the tokenizer's may be
        smaller; the padding is never allowed)."""
        try:
            import xgrammar
        except ImportError:  # (a dependency, but the GPU image may lack it)
            raise ValueError(
                "structured_outputs: needs the xgrammar package (pip install xgrammar)"
            ) from None
        self._xgrammar = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(
            info, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        # one compile at a time (xgrammar spreads each over threads itself)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiling: list[Request] = []  # their grammars not yet taken

    def validate(self, params: StructuredOutputsParams) -> None:
        """Parse ``params``' grammar (no compile: about a millisecond), or
        raise a ``ValueError`` naming the field."""
        field, source, parse, _ = self._grammar(params)
        _named(field, lambda: parse(source))

    def submit(self, params: StructuredOutputsParams) -> Future[Any]:
        """A fresh ``xgrammar.GrammarMatcher`` of ``params``' grammar, compiled
        (or taken from the cache) on the worker thread."""
        return self._worker.submit(self.matcher, params)

    def start(self, request: Request) -> None:
        """Compile ``request``'s grammar on the worker thread: until
        :meth:`take_compiled` hands it over, ``request.compiling`` holds
        the compile (and no step samples for the request)."""
        assert request.sampling_params.structured_outputs is not None
        request.compiling = self.submit(request.sampling_params.structured_outputs)
        self._compiling.append(request)

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def take_compiled(self) -> list[Request]:
        """Give the requests whose grammars compiled their matchers; returns
        those whose compile failed (after their check parsed it), to abort.
        An aborted request's compile is cancelled if still queued."""
        compiling, failed = [], []
        for request in self._compiling:
            future = request.compiling
            assert future is not None
            if request.status is RequestStatus.FINISHED:  # aborted meanwhile
                future.cancel()
                request.compiling = None
            elif not future.done():
                compiling.append(request)
            elif (error := future.exception()) is not None:
                logger.error("request %s: %s", request.request_id, error)
                failed.append(request)
            else:
                request.grammar, request.compiling = future.result(), None
        self._compiling = compiling
        return failed

    def wait_compiling(self, timeout_s: float) -> None:
        """Until a compile ends, at most ``timeout_s``."""
        futures = [r.compiling for r in self._compiling if r.compiling is not None]
        wait(futures, timeout_s, FIRST_COMPLETED)

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """:meth:`submit`'s work, on the calling thread."""
        field, source, _, compile_ = self._grammar(params)
        return self._xgrammar.GrammarMatcher(_named(field, lambda: compile_(source)))

    def _grammar(
        self, params: StructuredOutputsParams
    ) -> tuple[str, str, Callable[[str], Any], Callable[[str], Any]]:
        """The field ``params`` sets, its grammar's source, and its parse and
        (cached) compile by xgrammar."""
        grammar, compiler = self._xgrammar.Grammar, self._compiler
        spaced = not params.disable_any_whitespace
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else {"type": "object"}
            text = schema if isinstance(schema, str) else json.dumps(schema)
            field = "json" if params.json is not None else "json_object"
            return (
                field,
                text,
                lambda t: grammar.from_json_schema(t, any_whitespace=spaced),
                lambda t: compiler.compile_json_schema(t, any_whitespace=spaced),
            )
        if params.regex is not None:
            return "regex", params.regex, grammar.from_regex, compiler.compile_regex
        if params.choice is not None:
            # JSON string literals are EBNF's (escapes included); characters
            # past the BMP as themselves: the parser reads each half of a
            # \u surrogate pair as a character of its own
            literals = (json.dumps(c, ensure_ascii=False) for c in params.choice)
            ebnf = "root ::= " + " | ".join(literals)
            return "choice", ebnf, grammar.from_ebnf, compiler.compile_grammar
        assert params.grammar is not None  # (exactly one is set)
        return "grammar", params.grammar, grammar.from_ebnf, compiler.compile_grammar

    def token_masks(
        self, matchers: list[Any | None], device: torch.device
    ) -> TokenMasks | None:
        """The allowed tokens of the rows whose request has a matcher, or
        None when no row has one."""
        active = [(row, m) for row, m in enumerate(matchers) if m is not None]
        if not active:
            return None
        bitmask = self._xgrammar.allocate_token_bitmask(len(active), self.vocab_size)
        for i, (_, matcher) in enumerate(active):
            matcher.fill_next_token_bitmask(bitmask, i)
        if device.type == "cuda":  # a pinned copy: no stream sync
            bitmask = bitmask.pin_memory().to(device, non_blocking=True)
        return TokenMasks([row for row, _ in active], bitmask)


def _named(field: str, call: Callable[[], Any]) -> Any:
    """``call()``, its xgrammar error a ``ValueError`` naming ``field``."""
    try:
        return call()
    except RuntimeError as e:  # xgrammar's parse and schema errors
        # its first line, less the "[time] file.cc:line: " of the C++ side
        message = _SOURCE.sub("", str(e).splitlines()[0])
        raise ValueError(f"structured_outputs.{field}: {message}") from None
