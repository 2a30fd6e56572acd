"""``vllm serve MODEL_DIR``: the OpenAI-compatible server over the engine.

Flags are spelled as vLLM spells them and ``--help`` shows every default.
``--data-parallel-size N --enable-expert-parallel`` runs N engine ranks (one
process and one GPU each) with the experts sharded over them
(:class:`~vllm.v1.engine.dp_engine.DPEngineCore`), exchanging tokens through
``--all2all-backend``; ``--tensor-parallel-size N --enable-expert-parallel``
runs N ranks that split the attention heads, the dense MLPs and the experts
and all run every request. Either without ``--enable-expert-parallel``, or
both at once, is refused before anything loads. The server and the engine
are imported only when the command runs, so ``vllm serve --help`` answers at
once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm.reasoning import REASONING_PARSERS
from vllm.tool_parsers import TOOL_PARSERS

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8", "w4a16", "w4a8")
ALL2ALL_BACKENDS = ("allgather_reducescatter", "all2all")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible server.",
        description="Start the OpenAI-compatible server on a local checkpoint.",
    )
    parser.add_argument(
        "model",
        type=Path,
        help="Checkpoint directory (config.json, weights, tokenizer).",
    )
    parser.add_argument(
        "--host", default="0.0.0.0", help="Address to listen on (default: %(default)s)."
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=8000,
        help="Port to listen on (default: %(default)s).",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Name(s) requests use as 'model' (default: the MODEL argument).",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on /v1/* routes (default: none).",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="Longest prompt + output (default: the model's max_position_embeddings).",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Fraction of GPU memory for weights, activations and KV cache "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="Weights' dtype (default: %(default)s).",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="Quantize the experts while loading (default: none).",
    )
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="'dummy': random weights of the checkpoint's shapes "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="Requests in one batch (default: %(default)s).",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="Tokens computed in one engine step (default: %(default)s).",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Run every step eagerly, no CUDA graphs (default: off).",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="Sampling defaults, a max_tokens cap and extra EOS ids: 'auto' "
        "takes the model's generation_config.json, 'vllm' only its EOS ids, a "
        "directory its file (default: %(default)s).",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse the KV cache of an earlier request's equal prompt prefix, "
        "in whole blocks of 16 tokens (default: on).",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Schedule and fill the next step while the GPU runs the current "
        "one; a request that stops computes one token past its end (default: "
        "on with one rank on a GPU, off elsewhere; data-parallel ranks take it "
        "when asked, tensor parallelism and --enable-dbo refuse it).",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seeds dummy weights and unseeded sampling (default: %(default)s).",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="A Jinja chat template, or a file holding one (default: the tokenizer's).",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Report in usage.prompt_tokens_details how many prompt tokens the "
        "prefix cache held (default: off).",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="Report chat replies' thinking apart, as reasoning_content "
        "(default: none, the thinking stays in content).",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let chat requests with tools call them (tool_choice "auto"); '
        "needs --tool-call-parser (default: off, such requests are refused).",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="How replies call tools (Qwen3: hermes), reported as tool_calls "
        "(default: none).",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="Ranks that split attention heads, dense MLPs and experts, all "
        "running every request; > 1 needs --enable-expert-parallel and "
        "--data-parallel-size 1 (default: %(default)s).",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="Engine ranks, one process and GPU each; > 1 needs "
        "--enable-expert-parallel (default: %(default)s).",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="Shard the experts over the ranks (default: off).",
    )
    parser.add_argument(
        "--all2all-backend",
        choices=ALL2ALL_BACKENDS,
        default="allgather_reducescatter",
        help="How the ranks exchange tokens under expert parallelism "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--enable-dbo",
        action="store_true",
        help="Dual-batch overlap under expert parallelism: each step as two "
        "micro-batches, one's token exchange overlapping the other's compute "
        "(default: off).",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        choices=LOG_LEVELS,
        default="info",
        help="uvicorn's log level (default: %(default)s).",
    )
    parser.set_defaults(dispatch=cmd_serve, parser=parser)


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:  # uvicorn would wrap it (99999 -> 34463)
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {port}")
    return port


def check_parallelism(args: argparse.Namespace) -> str | None:
    """Why the parallelism flags cannot run, or None."""
    for flag, value in (
        ("--data-parallel-size", args.data_parallel_size),
        ("--tensor-parallel-size", args.tensor_parallel_size),
    ):
        if value < 1:
            return f"{flag}: expected >= 1, got {value}"
    if args.tensor_parallel_size > 1 and (
        args.data_parallel_size > 1 or not args.enable_expert_parallel
    ):
        return (
            f"--tensor-parallel-size: {args.tensor_parallel_size} ranks need "
            f"--enable-expert-parallel (the experts split over the same ranks) "
            f"and --data-parallel-size 1 (both at once are not supported)"
        )
    if args.data_parallel_size > 1 and not args.enable_expert_parallel:
        return (
            f"--data-parallel-size: {args.data_parallel_size} ranks need "
            f"--enable-expert-parallel (replicated experts are not supported)"
        )
    return None


def cmd_serve(args: argparse.Namespace) -> None:
    if (problem := check_parallelism(args)) is not None:
        args.parser.error(problem)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        args.parser.error(
            "--enable-auto-tool-choice: needs --tool-call-parser (how replies "
            "call tools)"
        )
    from vllm.entrypoints.openai.api_server import run_server

    try:
        run_server(args)
    except ValueError as e:  # a bad flag value the engine refused, by name
        args.parser.error(str(e))
