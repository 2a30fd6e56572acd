"""L1 prefetch for the decode kernels' weight streams (NVIDIA, inline PTX).

At decode sizes a kernel's programs each stream a few K steps of weights,
and ptxas, keeping its register target, issues a step's loads late (at the
end of the step before, or at the step's top): each step waits one HBM
latency (docs/marlin.md, v4.2). ``prefetch.global.L1`` asks for the lines
of steps further ahead without holding a register, so those loads find
them in L1. Where a prefetch sits matters: ptxas keeps a loop's loads above
a prefetch, so the kernels put their loop's prefetch last in the step.
"""

import triton
import triton.language as tl

MAX_PREFETCH = 8  # K steps ahead (unrolled before the loop)


def check_prefetch(config: object, name: str) -> None:
    """An error naming ``config`` unless its field ``name`` is a prefetch
    distance in K steps."""
    if not 0 <= getattr(config, name) <= MAX_PREFETCH:
        raise ValueError(f"config: {name} must be in 0..{MAX_PREFETCH}: {config}")


@triton.jit
def prefetch_l1(ptrs):
    """Each pointer's line into L1: a hint, no register held (compiled for
    NVIDIA only: callers pass a prefetch distance of 0 elsewhere)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
