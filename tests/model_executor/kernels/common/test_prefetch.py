"""The prefetch distance check (``common/prefetch.py``); the prefetches
themselves are counted in the decode kernels' sm_90 build tests
(``marlin/test_moe_decode.py``, ``grouped_gemm/test_decode.py``)."""

from dataclasses import dataclass

import pytest

from vllm.model_executor.kernels.common.prefetch import MAX_PREFETCH, check_prefetch


@dataclass
class Config:
    prefetch: int


def test_check_prefetch_names_the_config():
    for steps in (0, MAX_PREFETCH):
        check_prefetch(Config(steps), "prefetch")
    for steps in (-1, MAX_PREFETCH + 1):
        with pytest.raises(
            ValueError, match=rf"config: prefetch must be in 0..{MAX_PREFETCH}: Config"
        ):
            check_prefetch(Config(steps), "prefetch")
