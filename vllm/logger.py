"""Package loggers: one ``vllm`` root with a single stream handler."""

import logging

from vllm import envs

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_root = logging.getLogger("vllm")
if not _root.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(envs.logging_level())
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """A logger under the package root, e.g. ``init_logger(__name__)``."""
    return logging.getLogger(name)
