"""The OpenAI-compatible HTTP server: FastAPI routes over one
:class:`~vllm.v1.engine.async_llm.AsyncLLM`, served by uvicorn.

Routes: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /health``, ``GET /metrics``
(Prometheus), ``POST /tokenize``, ``POST /detokenize``.

- ``api_key``: every ``/v1/*`` route needs ``Authorization: Bearer KEY``
  (401 otherwise); the others stay open, as the issue and vLLM have it.
- Failures answer OpenAI's error body. Malformed JSON and wrong types are a
  400 naming the field; the engine only ever sees valid requests, so a bad
  one disturbs no other.
- A client that disconnects cancels its request: streamed or not, its
  engine requests are aborted and their KV blocks freed.
- Lifecycle: the engine (model, KV cache) is built before the socket opens;
  the app's lifespan starts the engine loop and drains it at shutdown. On
  SIGTERM or SIGINT uvicorn stops accepting, waits for the responses in
  flight (streams included) to finish, then the lifespan stops the engine
  and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import FrameType
from typing import Any, cast

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import json_response, off_the_loop
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.logger import init_logger
from vllm.reasoning import REASONING_PARSERS
from vllm.tool_parsers import TOOL_PARSERS
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.v1.metrics.loggers import PrometheusStatLogger

logger = init_logger(__name__)

router = APIRouter()


@dataclass
class ServerState:
    engine: AsyncLLM
    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    stat_logger: PrometheusStatLogger


def _state(request: Request) -> ServerState:
    return cast(ServerState, request.app.state.server)


async def _unless_disconnected(handler: Awaitable[Response], raw: Request) -> Response:
    """Run ``handler``, cancelled if the client goes first (its engine
    requests are aborted on the way out). A streaming response is returned
    at once and watches the client itself."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait(
            {task, watcher}, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        return Response(status_code=499)  # client closed request (nginx's code)
    return task.result()


@router.get("/health")
async def health(raw: Request) -> Response:
    healthy = not _state(raw).engine.dead
    return Response(
        status_code=HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
    )


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    body = _state(raw).stat_logger.render()
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(raw: Request) -> Response:
    return json_response(_state(raw).models.list_models())


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw: Request) -> Response:
    handler = _state(raw).completion.create_completion(request)
    return await _unless_disconnected(handler, raw)


@router.post("/v1/chat/completions")
async def create_chat_completion(
    request: ChatCompletionRequest, raw: Request
) -> Response:
    handler = _state(raw).chat.create_chat_completion(request)
    return await _unless_disconnected(handler, raw)


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw: Request) -> Response:
    return json_response(await off_the_loop(_state(raw).tokenization.tokenize, request))


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw: Request) -> Response:
    return json_response(
        await off_the_loop(_state(raw).tokenization.detokenize, request)
    )


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """pydantic's first complaint, as a 400 naming the top-level field
    (its full location follows in the message)."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return OpenAIError(f"body: malformed JSON: {detail}")
    loc = [str(part) for part in first["loc"] if part != "body"]
    param = loc[0] if loc else None
    message = f"{param or 'body'}: {first['msg']}"
    if len(loc) > 1:
        message += f" (at {'.'.join(loc)})"
    if len(errors) > 1:
        message += f"; {len(errors) - 1} more error(s)"
    return OpenAIError(message, param=param)


def build_app(
    engine: AsyncLLM,
    models: OpenAIServingModels,
    stat_logger: PrometheusStatLogger,
    api_key: str | None = None,
    reasoning_parser: str | None = None,
    enable_prompt_tokens_details: bool = False,
    tool_parser: str | None = None,
) -> FastAPI:
    """``tool_parser``: the parser of replies' tool calls, given only with
    auto tool choice enabled."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(lifespan=lifespan)
    app.state.server = ServerState(
        engine,
        models,
        OpenAIServingCompletion(
            engine, models, enable_prompt_tokens_details=enable_prompt_tokens_details
        ),
        OpenAIServingChat(
            engine,
            models,
            None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser](),
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            tool_parser=None if tool_parser is None else TOOL_PARSERS[tool_parser](),
        ),
        OpenAIServingTokenization(engine, models),
        stat_logger,
    )
    app.include_router(router)

    async def openai_error(_: Request, exc: Exception) -> Response:
        return cast(OpenAIError, exc).response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        return _validation_error(cast(RequestValidationError, exc)).response()

    async def engine_dead(_: Request, exc: Exception) -> Response:
        return OpenAIError(str(exc), status=HTTPStatus.SERVICE_UNAVAILABLE).response()

    async def http_error(_: Request, exc: Exception) -> Response:
        # FastAPI's own 4xx (an unparsable body, an unknown route or method)
        error = cast(StarletteHTTPException, exc)
        return OpenAIError(
            str(error.detail), status=HTTPStatus(error.status_code)
        ).response()

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(EngineDeadError, engine_dead)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            given = request.headers.get("Authorization", "").encode()
            if request.url.path.startswith("/v1") and not hmac.compare_digest(
                given, expected
            ):
                return OpenAIError(
                    "Incorrect or missing API key: send Authorization: Bearer KEY",
                    status=HTTPStatus.UNAUTHORIZED,
                    code="invalid_api_key",
                ).response()
            return await call_next(request)

    return app


def build_async_engine(
    args: argparse.Namespace, stat_logger: PrometheusStatLogger
) -> AsyncLLM:
    """The engine, in a process of its own, and the tokenizer of ``vllm
    serve``'s arguments (no tokenizer for a checkpoint directory without
    tokenizer files: token ids only); a data-parallel engine for
    ``--data-parallel-size`` > 1 (its workers stop with the engine)."""
    from vllm.transformers_utils.generation_config import load_generation_defaults
    from vllm.transformers_utils.tokenizer import get_tokenizer
    from vllm.v1.engine.config import EngineConfig
    from vllm.v1.engine.core_client import MPClient

    tokenizer = get_tokenizer(args.model)
    if tokenizer is None:
        logger.warning("No tokenizer in %s: serving token ids only", args.model)
    elif args.chat_template is not None:  # a file, or the template itself
        template = args.chat_template
        path = Path(template)
        is_file = len(template) < 4096 and path.is_file()
        if not is_file and not any(c in template for c in "{}\n"):
            raise ValueError(
                f"--chat-template: expected a file or a Jinja template, got "
                f"{template!r} (no such file)"
            )
        tokenizer.chat_template = path.read_text() if is_file else template
    defaults = load_generation_defaults(args.model, args.generation_config)
    if defaults.sampling:
        logger.warning(
            "Requests that leave them unset sample with the model's "
            "generation_config.json values %s (--generation-config vllm: "
            "SamplingParams' defaults)",
            defaults.sampling,
        )
    config = EngineConfig(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        all2all_backend=args.all2all_backend,
        enable_dbo=args.enable_dbo,
    )
    return AsyncLLM(MPClient(config), tokenizer, stat_logger, defaults)


def _exit_cleanly(signum: int, frame: FrameType | None) -> Any:
    raise SystemExit(0)


def run_server(args: argparse.Namespace) -> None:
    """Build the engine, then serve until SIGTERM/SIGINT (exit status 0)."""
    # Before uvicorn: a signal while the model loads exits at once, and the
    # signal uvicorn re-raises after its graceful shutdown lands here
    # instead of killing the process with a signal status.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    names = args.served_model_name or [str(args.model)]
    stat_logger = PrometheusStatLogger(names[0])
    engine = build_async_engine(args, stat_logger)
    models = OpenAIServingModels(names, str(args.model), engine.max_model_len)
    app = build_app(
        engine,
        models,
        stat_logger,
        args.api_key,
        args.reasoning_parser,
        args.enable_prompt_tokens_details,
        args.tool_call_parser if args.enable_auto_tool_choice else None,
    )
    logger.info("Serving %s on http://%s:%d", ", ".join(names), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
