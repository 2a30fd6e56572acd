"""The split combine's sm_90 build: its L2 prefetches before its PDL wait
(its results are :mod:`.test_triton_paged`'s split-KV cases)."""

import json

from tests.model_executor.kernels.grouped_gemm.utils import (
    COMPILED,
    asm_for_sm90,
    compiled_in_own_process,
    sass,
)
from vllm.v1.attention.backends.split_kv import _combine_splits_kernel

MODULE = "tests.v1.attention.backends.test_split_kv"


def compile_kernels() -> None:
    """The split combine built for sm_90 with and without a prefetch (in a
    process of its own, by the test below): its L2 bulk prefetches
    (``UBLKPF``) before and after the PDL wait (``ACQBULK``)."""
    for prefetch in (True, False):
        consts = dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=32, PDL=True,
                      PREFETCH=prefetch)  # fmt: skip
        pointers = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "prefetch_ptr": "*u8"}
        aligned = ("stride_ot", "stride_oh")
        cubin = asm_for_sm90(_combine_splits_kernel, consts, pointers, aligned, 4)
        before, wait, after = sass(cubin["cubin"]).partition("ACQBULK")
        print(COMPILED, json.dumps([prefetch, wait, before.count("UBLKPF"),
                                    after.count("UBLKPF")]))  # fmt: skip


def test_the_combine_prefetches_before_its_pdl_wait():
    """While the attention runs, i.e. before the combine's wait; none
    after it, and none without a weight to prefetch."""
    builds = compiled_in_own_process(MODULE)
    assert [prefetch for prefetch, *_ in builds] == [True, False]
    for prefetch, wait, before_wait, after_wait in builds:
        assert wait == "ACQBULK" and after_wait == 0
        assert (before_wait > 0) == prefetch
