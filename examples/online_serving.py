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
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from vllm.model_executor.model_loader.tiny_checkpoint import demo_checkpoint

METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:kv_cache_usage_perc",
    "vllm:e2e_request_latency_seconds_count",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(base: str, server: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"vllm serve did not become healthy in {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a local checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    model = args.model or demo_checkpoint()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", str(args.max_model_len), "--served-model-name", "demo"]
    print("$", " ".join(cmd))
    server = subprocess.Popen(cmd)
    try:
        _wait_healthy(base, server, timeout_s=300)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Say hello to the MoE engine."}],
            max_tokens=args.max_tokens,
            temperature=0,
        )
        choice = reply.choices[0]
        print(f"reply: {choice.message.content!r} ({choice.finish_reason})")
        print(f"usage: {reply.usage}")
        metrics = httpx.get(f"{base}/metrics").text.splitlines()
        for line in metrics:
            if line.startswith(METRICS):
                print("metrics:", line)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        print(f"vllm serve stopped (exit code {code})")
    if code != 0:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
