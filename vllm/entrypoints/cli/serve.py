"""``vllm serve MODEL_DIR``: the OpenAI-compatible server over the engine.

Flags are spelled as vLLM spells them and ``--help`` shows every default.
``--tensor-parallel-size``, ``--data-parallel-size`` and
``--enable-expert-parallel`` are accepted but only their single-GPU values
run until expert parallelism lands; others are refused before anything
loads. The server and the engine are imported only when the command runs,
so ``vllm serve --help`` answers at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8", "w4a16")
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
        type=int,
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
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="Only 1 until expert parallelism lands (default: %(default)s).",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="Only 1 until expert parallelism lands (default: %(default)s).",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="Refused until expert parallelism lands (default: off).",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        choices=LOG_LEVELS,
        default="info",
        help="uvicorn's log level (default: %(default)s).",
    )
    parser.set_defaults(dispatch=cmd_serve, parser=parser)


def check_parallelism(args: argparse.Namespace) -> str | None:
    """Why the parallelism flags cannot run yet, or None."""
    for flag in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, flag) != 1:
            option = "--" + flag.replace("_", "-")
            return (
                f"{option}: only 1 is supported until expert parallelism lands, "
                f"got {getattr(args, flag)}"
            )
    if args.enable_expert_parallel:
        return "--enable-expert-parallel: not supported until expert parallelism lands"
    return None


def cmd_serve(args: argparse.Namespace) -> None:
    if (problem := check_parallelism(args)) is not None:
        args.parser.error(problem)
    from vllm.entrypoints.openai.api_server import run_server

    try:
        run_server(args)
    except ValueError as e:  # a bad flag value the engine refused, by name
        args.parser.error(str(e))
