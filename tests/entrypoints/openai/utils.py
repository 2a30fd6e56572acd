"""A live ``vllm serve`` in a subprocess, on 127.0.0.1 and a free port.

The server runs without ``TRITON_INTERPRET`` (which the suite's conftest
sets for the kernel tests): on a CPU the engine then takes its plain-PyTorch
path, as ``vllm serve`` does for a user, and steps in milliseconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx
import openai

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


class RemoteOpenAIServer:
    def __init__(
        self, model: Path, args: list[str], log: Path, startup_s: float = 120.0
    ) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log = log
        with open(log, "wb") as out:  # a file: a full pipe would block the server
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
        self._wait_healthy(startup_s)

    def _wait_healthy(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url_for("health"), timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy:\n{self.log.read_text()[-4000:]}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, *parts: str) -> str:
        return "/".join([self.base_url, *parts])

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=API_KEY)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=API_KEY, max_retries=0
        )

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url_for("metrics")).text)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
