"""Serving with ``vllm serve`` and the official ``openai`` client (the
README's main job).

Without ``--model`` it builds a tiny random Qwen3-MoE with a locally trained
tokenizer and chat template under ``out/tiny-qwen3-moe`` (no download, runs
on a CPU; its random weights write random text, but every request takes the
real path: HTTP, the engine loop, the workspace manager, the shared permute
scratch, the experts, the paged KV cache). It starts ``vllm serve`` on
127.0.0.1, sends one chat request, prints the reply and a summary of the
server's ``/metrics``, and stops the server with SIGTERM (it finishes what
is in flight and exits 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import openai

from vllm.entrypoints.serve_process import ServeProcess
from vllm.model_executor.model_loader.tiny_checkpoint import demo_checkpoint

METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:kv_cache_usage_perc",
    "vllm:e2e_request_latency_seconds_count",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a local checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    model = args.model or demo_checkpoint()
    serve_args = [
        "--max-model-len",
        str(args.max_model_len),
        "--served-model-name",
        "demo",
    ]
    print("$ vllm serve", model, " ".join(serve_args))
    server = ServeProcess(model, serve_args, startup_s=300)
    try:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="unused")
        reply = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Say hello to the MoE engine."}],
            max_tokens=args.max_tokens,
            temperature=0,
        )
        choice = reply.choices[0]
        print(f"reply: {choice.message.content!r} ({choice.finish_reason})")
        print(f"usage: {reply.usage}")
        for line in httpx.get(server.url_for("metrics")).text.splitlines():
            if line.startswith(METRICS):
                print("metrics:", line)
    finally:
        code = server.stop()
        print(f"vllm serve stopped (exit code {code})")
    if code != 0:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
