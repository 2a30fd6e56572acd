"""Rendezvous helpers for starting the processes of one engine."""

from __future__ import annotations

import socket


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it; another
    process may still take it before the rendezvous binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def get_distributed_init_method(ip: str, port: int) -> str:
    """The ``tcp://`` init URL of a rendezvous at ``ip``:``port``."""
    host = f"[{ip}]" if ":" in ip else ip  # IPv6 literals take brackets
    return f"tcp://{host}:{port}"
