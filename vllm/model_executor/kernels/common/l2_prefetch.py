"""Warm a weight in L2 from a kernel that waits anyway.

In a decode step at a few tokens the paged attention and its split
combine are latency-bound: HBM idles while they run. The output projection
after them streams its weight (16.8 MB in Qwen3-30B-A3B) only once the
combine lets it start (PDL starts one kernel early, not two). So the
combine's programs, which start while the attention runs, issue bulk L2
prefetches of that weight before their PDL wait, and the projection reads
it from L2. Qwen3-30B-A3B at batch 1 (H100, one lease): TPOT fp8 2.345 /
2.341 -> 2.291 / 2.289 ms, bf16 2.835 -> 2.783. Not yet timed at the
other batches that split KV (up to 32 requests there), where more
programs share the weight.

Only weights (no kernel of the step writes them: prefetching before the
wait keeps the PDL contract, :mod:`~.pdl`) of at most half the L2, so that
the step's activations and KV keep the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.device_info import l2_bytes
from vllm.model_executor.kernels.common.pdl import pdl

LINE = 2048  # bytes of one bulk prefetch (cp.async.bulk.prefetch.L2)
_LINE: tl.constexpr = tl.constexpr(LINE)
_LINES: tl.constexpr = tl.constexpr(128)  # a program's prefetches a step


@triton.jit
def prefetch_lines(off, start, share, nbytes):
    """The byte offsets of the lines a program prefetches in its step at
    ``off`` of its ``share`` from ``start``: past the share's end (or the
    weight's) the last line again, which a warp issues once."""
    last = tl.minimum(start + share, nbytes) - _LINE
    return tl.minimum(off + tl.arange(0, _LINES) * _LINE, last)


@triton.jit
def l2_prefetch(ptr, nbytes, start, share):
    """Prefetch bytes [start, start + share) of the ``nbytes`` at ``ptr``
    into L2 in whole lines. ``ptr`` is a byte pointer, 16-byte aligned,
    ``nbytes`` a multiple of 16 and at least a line, ``start`` and
    ``share`` multiples of a line (:func:`prefetchable`,
    :func:`prefetch_share`)."""
    tl.static_assert(ptr.dtype.element_ty == tl.uint8, "ptr: a byte pointer")
    for off in range(start, start + share, _LINE * _LINES):
        lines = prefetch_lines(off, start, share, nbytes)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], 2048; mov.u32 $0, 0;", "=r,l",
            [ptr + lines], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def prefetch_share(nbytes: int, programs: int) -> int:
    """Bytes each of ``programs`` prefetches so that they cover ``nbytes``:
    whole lines, as few as that takes."""
    return triton.cdiv(triton.cdiv(nbytes, programs), LINE) * LINE


def prefetchable(weight: torch.Tensor) -> bool:
    """Whether kernels on ``weight``'s device prefetch it: launched with PDL
    (Hopper), contiguous, at a 16-byte aligned address, a multiple of 16
    bytes from one line to half the L2."""
    nbytes = weight.numel() * weight.element_size()
    return (
        pdl(weight.device)
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == nbytes % 16 == 0
        and LINE <= nbytes <= l2_bytes(weight.device) // 2
    )
