"""``vllm serve`` in a subprocess on 127.0.0.1 and a free port: what the
examples, the serving benchmarks and the server tests start and stop.

The server's output goes to a file (a full pipe would block it) or, with no
log file, to the caller's terminal. ``stop()`` sends SIGTERM, which lets the
requests in flight finish, and returns the exit code.
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
from typing import Self

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServeProcess:
    def __init__(
        self,
        model: Path,
        args: list[str],
        log: Path | None = None,
        env: dict[str, str] | None = None,
        startup_s: float = 120.0,
    ) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log = log
        env = dict(os.environ) if env is None else env
        if log is None:
            self.proc = subprocess.Popen(cmd, env=env)
        else:
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
        self._wait_healthy(startup_s)

    def _log_tail(self) -> str:
        return "" if self.log is None else "\n" + self.log.read_text()[-4000:]

    def _wait_healthy(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}{self._log_tail()}"
                )
            try:
                if httpx.get(self.url_for("health"), timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"vllm serve not healthy after {startup_s:.0f} s{self._log_tail()}"
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, *parts: str) -> str:
        return "/".join([self.base_url, *parts])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def __enter__(self) -> Self:
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
