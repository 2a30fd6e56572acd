"""L2 prefetch: a weight's chunks cover it in whole lines, and only what
may be prefetched is."""

import pytest
import torch

from vllm.model_executor.kernels.common.l2_prefetch import (
    LINE,
    prefetch_chunk,
    prefetchable,
)
from vllm.model_executor.kernels.common.pdl import pdl


@pytest.mark.parametrize("nbytes", [LINE, 3 * LINE + 16, 2048 * 4096 * 2, 10**7])
@pytest.mark.parametrize("programs", [1, 7, 32, 128])
def test_chunks_cover_the_weight_in_whole_lines(nbytes, programs):
    chunk = prefetch_chunk(nbytes, programs)
    assert chunk % LINE == 0 and chunk * programs >= nbytes
    assert (chunk - LINE) * programs < nbytes  # no more lines than it takes


def test_nothing_is_prefetched_without_pdl():
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
    half_l2 = torch.cuda.get_device_properties(cuda).L2_cache_size // 2
    assert prefetchable(torch.empty(half_l2, dtype=torch.uint8, device=cuda))
    assert not prefetchable(torch.empty(half_l2 + 16, dtype=torch.uint8, device=cuda))
