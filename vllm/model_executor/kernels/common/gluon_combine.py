"""Combine functions for Gluon's ``gl.reduce`` and ``gl.associative_scan``.

Kernels reduce with these rather than ``gl.sum`` / ``gl.max``: those wrap
Triton jit functions, which ``TRITON_INTERPRET`` (the CPU tests) turns into
ones Gluon cannot compile.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def add(a, b):
    return a + b


@gluon.jit
def maximum(a, b):
    return gl.maximum(a, b)
