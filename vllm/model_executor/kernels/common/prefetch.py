"""L1 prefetch for the decode kernels' weight streams (NVIDIA, inline PTX).

At decode sizes a kernel's programs each stream a few K steps of weights,
and ptxas, keeping its register target, issues a step's loads late (at the
end of the step before, or at the step's top): each step waits one HBM
latency (docs/marlin.md, v4.2). ``prefetch.global.L1`` asks for the lines
of steps further ahead without holding a register, so those loads find
them in L1. Where a prefetch sits matters: ptxas keeps a loop's loads above
a prefetch, so the kernels put their loop's prefetch last in the step.
"""

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.device_info import inline_ptx

MAX_PREFETCH = 8  # K steps ahead (unrolled before the loop)


def check_prefetch(config: object, name: str) -> None:
    """An error naming ``config`` unless its field ``name`` is a prefetch
    distance in K steps."""
    if not 0 <= getattr(config, name) <= MAX_PREFETCH:
        raise ValueError(f"config: {name} must be in 0..{MAX_PREFETCH}: {config}")


def prefetch_steps(steps: int, device: torch.device, kernel: object) -> int:
    """The prefetch distance a launch of ``kernel`` passes: ``steps`` where
    it runs compiled for NVIDIA (inline PTX), else 0."""
    return steps if inline_ptx(device, kernel) else 0


@triton.jit
def prefetch_l1(ptrs, mask=None):
    """Each pointer's line into L1 (where ``mask``): a hint, no register
    held. Kernels take it only with a distance from :func:`prefetch_steps`
    (the interpreter runs no PTX)."""
    if mask is None:
        tl.inline_asm_elementwise(
            "prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L1 [$1]; }"
            " mov.u32 $0, 0;", "=r,l,r", [ptrs, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def prefetch_row_step(rows, k, K, BLOCK_K: tl.constexpr, mask=None):
    """Prefetch into L1 the 128-byte lines of K step ``k`` of weight rows
    ``rows`` (pointers to their first elements, with a last dimension of 1;
    columns past K: the last) where ``mask``."""
    LINE: tl.constexpr = 1024 // rows.dtype.element_ty.primitive_bitwidth
    LINES: tl.constexpr = BLOCK_K // LINE if BLOCK_K > LINE else 1
    prefetch_l1(rows + tl.minimum(k + tl.arange(0, LINES) * LINE, K - 1), mask)
