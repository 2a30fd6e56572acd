"""L2 prefetch: the programs' shares cover a weight in whole lines, every
prefetched line lies in it (bounds and alignment, under the interpreter),
and only what may be prefetched is."""

import pytest
import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.l2_prefetch import (
    LINE,
    prefetch_lines,
    prefetch_share,
    prefetchable,
)
from vllm.model_executor.kernels.common.pdl import pdl

STEP_LINES = 128  # l2_prefetch's lines a step


@triton.jit
def _lines_kernel(out_ptr, nbytes, share, steps):
    """Every program's prefetched lines, as ``l2_prefetch`` walks its share."""
    start = tl.program_id(0).to(tl.int64) * share
    for off in range(start, start + share, 2048 * 128):
        row = tl.program_id(0) * steps + (off - start) // (2048 * 128)
        lines = prefetch_lines(off, start, share, nbytes)
        tl.store(out_ptr + row * 128 + tl.arange(0, 128), lines)


# the output projection at 1, 3 and 32 requests (32 heads), a weight short
# of the programs' lines, one of a line and 16 bytes
@pytest.mark.parametrize(
    ("nbytes", "programs"),
    [(2048 * 4096 * 2, 32), (2048 * 4096 * 2, 96), (2048 * 4096 * 2, 1024),
     (3 * LINE + 16, 7), (LINE + 16, 1)],
)  # fmt: skip
def test_every_line_lies_in_the_weight_and_all_of_it_is_covered(nbytes, programs):
    share = prefetch_share(nbytes, programs)
    assert share % LINE == 0 and share * programs >= nbytes
    assert (share - LINE) * programs < nbytes  # no more lines than it takes
    steps = triton.cdiv(share, LINE * STEP_LINES)
    out = torch.full((programs * steps * STEP_LINES,), -1, dtype=torch.int64)
    _lines_kernel[(programs,)](out, nbytes, share, steps)
    lines = out[out >= 0]
    assert len(lines) == programs * steps * STEP_LINES  # every lane, every step
    assert lines.max() + LINE <= nbytes and (lines % 16 == 0).all()
    covered = torch.zeros(nbytes, dtype=torch.bool)
    for line in lines.unique().tolist():
        covered[line : line + LINE] = True
    assert covered.all()
    assert len(lines.unique()) == triton.cdiv(nbytes, LINE)
    # a program's lanes past its share repeat the share's last line (a warp
    # issues it once) rather than prefetch the next program's
    for p, mine in enumerate(out.view(programs, -1)):
        last = min((p + 1) * share, nbytes) - LINE
        assert mine.max() <= last and len(mine.unique()) <= share // LINE


def test_nothing_is_prefetched_off_the_gpu():
    assert not prefetchable(torch.empty(4096, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_what_may_be_prefetched_on_gpu():
    cuda = torch.device("cuda")
    if not pdl(cuda):
        pytest.skip("PDL: Hopper and later")
    weight = torch.empty(2048, 4096, dtype=torch.bfloat16, device=cuda)  # 16.8 MB
    assert prefetchable(weight)
    assert not prefetchable(weight[:, :4000])  # not contiguous
    assert not prefetchable(weight.view(-1)[: LINE // 2 - 8])  # less than a line
    assert not prefetchable(weight.view(-1)[1 : LINE + 1])  # not 16-byte aligned
    assert not prefetchable(torch.empty(LINE + 1, dtype=torch.uint8, device=cuda))
    half_l2 = torch.cuda.get_device_properties(cuda).L2_cache_size // 2
    assert prefetchable(torch.empty(half_l2, dtype=torch.uint8, device=cuda))
    assert not prefetchable(torch.empty(half_l2 + 16, dtype=torch.uint8, device=cuda))
