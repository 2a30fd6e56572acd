"""The ``vllm`` command (console script): ``vllm serve MODEL_DIR [flags]``."""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli.serve import add_serve_parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM-shaped CLI.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    args = parser.parse_args(argv)
    args.dispatch(args)


if __name__ == "__main__":
    main()
