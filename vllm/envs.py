"""Every environment variable the package reads, in one place."""

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def debug_workspace() -> bool:
    """VLLM_DEBUG_WORKSPACE=1 logs every workspace growth and the lock."""
    return _flag("VLLM_DEBUG_WORKSPACE")


def logging_level() -> str:
    """VLLM_LOGGING_LEVEL sets the package's log level (default INFO)."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()


def master_addr() -> str | None:
    """MASTER_ADDR: the rendezvous host of ``env://`` process-group setup."""
    return os.environ.get("MASTER_ADDR") or None


def master_port() -> str | None:
    """MASTER_PORT: the rendezvous port of ``env://`` process-group setup."""
    return os.environ.get("MASTER_PORT") or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its interpreter (tests)."""
    return _flag("TRITON_INTERPRET")


def disable_pdl() -> bool:
    """VLLM_DISABLE_PDL=1 launches the decode kernels without programmatic
    dependent launch (for A/B timing and debugging)."""
    return _flag("VLLM_DISABLE_PDL")
