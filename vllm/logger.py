"""Package loggers: one ``vllm`` root with a single stream handler."""

import logging

from vllm import envs

# Time, level and logger name (the module, via init_logger(__name__)).
_FORMAT = "%(asctime)s.%(msecs)03d %(name)s %(levelname)s: %(message)s"
_root = logging.getLogger("vllm")
if not _root.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(envs.logging_level())
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """A logger under the package root, e.g. ``init_logger(__name__)``."""
    return logging.getLogger(name)
