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
