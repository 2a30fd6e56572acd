"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step is hundreds of kernels of a few microseconds; each one's
start (launch, address math, first loads in flight) otherwise begins only
after the previous kernel has drained. On Hopper a kernel launched with PDL
may start while the kernel before it on the stream finishes, and wait on
the device for its results (``griddepcontrol``); in a CUDA graph the
launch becomes a programmatic edge.

The contract of a kernel launched with ``launch_pdl=pdl(...)``:

- Before :func:`pdl_wait` it stores nothing and loads nothing that the
  previous kernel writes (weights, which no kernel of the step writes, are
  fair game: that is the point).
- :func:`pdl_wait` also releases the next kernel, and only then, in every
  program that does not exit first (a program that exits releases too, so
  an early exit comes after the wait): so when a kernel starts, every
  kernel before its predecessor has completed, and data written two
  launches back (the routing, read by the MoE's second GEMM) may be read
  before the wait. A kernel launched with PDL that released earlier would
  break this for the kernel after it.

Off NVIDIA GPUs and under the Triton interpreter (which has no
``griddepcontrol``) the flag is False and the kernels compile without the
instructions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm import envs
from vllm.model_executor.kernels.common.device_info import capability


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (Hopper and later)."""
    if torch.version.hip or envs.triton_interpret() or envs.disable_pdl():
        return False
    cap = capability(device)
    return cap is not None and cap >= (9, 0)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel's results, then let the next kernel
    start (no-op unless ``PDL``)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@gluon.jit
def gluon_pdl_wait(PDL: gl.constexpr):
    """:func:`pdl_wait` in a Gluon kernel (inline PTX)."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; griddepcontrol.launch_dependents; mov.b32 $0, 0;",
            "=r", [], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip
