"""A live ``vllm serve`` in a subprocess, on 127.0.0.1 and a free port.

The server runs without ``TRITON_INTERPRET`` (which the suite's conftest
sets for the kernel tests): on a CPU the engine then takes its plain-PyTorch
path, as ``vllm serve`` does for a user, and steps in milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
import torch

from vllm.entrypoints.serve_process import ServeProcess

API_KEY = "test-key"
# fp32 on the CPU (exact greedy comparisons); no experts backend runs fp32 on
# CUDA, so a GPU machine serves the tiny model in bf16
SERVER_DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
# A server of two ranks runs gloo on the CPU and needs one GPU per rank on
# a GPU machine
needs_two_ranks = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="two ranks need two GPUs",
)


def parse_metrics(text: str) -> dict[str, float]:
    """``/metrics`` samples by name (one model: its label is dropped; the
    finish reason is kept as ``name/reason``)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if 'finished_reason="' in name:
                key += "/" + name.split('finished_reason="')[1].split('"')[0]
            samples[key] = float(value)
    return samples


class RemoteOpenAIServer(ServeProcess):
    def __init__(
        self, model: Path, args: list[str], log: Path, startup_s: float = 120.0
    ) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # On a GPU every pytest-xdist worker starts its servers on the one
        # device: at the default 0.9 the first one's KV cache takes it all
        # (the CPU ignores the flag).
        args = ["--gpu-memory-utilization", "0.04", *args]
        super().__init__(model, args, log, env, startup_s)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=API_KEY)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=API_KEY, max_retries=0
        )

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url_for("metrics")).text)
