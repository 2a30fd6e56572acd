"""The decode-size GEMM against ``x.float() @ w.float().T`` (rounded once),
also with the residual add and RMSNorm in its prologue."""

import json

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    COMPILED,
    asm_for_sm90,
    compiled_in_own_process,
    sass,
)
from tests.model_executor.kernels.marlin.test_gemv_mma import resources
from vllm.model_executor.kernels.common.rms_norm import rms_norm, rms_norm_reference
from vllm.model_executor.kernels.common.skinny_gemm import (
    SKINNY_MAX_ROWS,
    _skinny_gemm_kernel,
    rms_norm_skinny_gemm,
    skinny_gemm,
    skinny_gemm_applies,
    skinny_gemm_reference,
    skinny_tiles,
)


# block_k 32: K steps that do not divide K (80, 20); None: the launcher's,
# whole-K tiles at one row (K padded to a power of two; 4097: steps), 1024
# at two; 128 covers K at one row, a whole-K tile too. N not a multiple of
# the tiles' rows
@pytest.mark.parametrize("block_k", [32, None, 128])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 40, 96), (2, 17, 80), (1, 3, 20), (1, 13, 4096), (1, 5, 4097)]
)
def test_matches_reference(device, m, n, k, block_k):
    torch.manual_seed(m * 100 + n)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    weight = torch.randn(n + 5, k, device=device, dtype=torch.bfloat16)[:n]
    out = skinny_gemm(x, weight, block_k=block_k)
    ref = skinny_gemm_reference(x, weight)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_tiles_span_k_at_one_row():
    # (BLOCK_N, BLOCK_K, WHOLE_K): the decode shapes' whole-K tiles
    assert skinny_tiles(1, 4096, norm=False) == (4, 4096, True)  # o_proj
    assert skinny_tiles(1, 2048, norm=True) == (8, 2048, True)  # q/k/v
    assert skinny_tiles(1, 96, norm=False) == (128, 128, True)
    assert skinny_tiles(1, 8, norm=True) == (1024, 16, True)
    assert skinny_tiles(1, 4097, norm=False) == (4, 1024, False)
    assert skinny_tiles(1, 4097, norm=True) == (8, 512, False)
    assert skinny_tiles(2, 4096, norm=False) == (4, 1024, False)
    assert skinny_tiles(1, 96, norm=False, block_k=128) == (128, 128, True)
    assert skinny_tiles(1, 96, norm=False, block_k=64) == (4, 64, False)
    for bad in (0, 48, 8):
        with pytest.raises(ValueError, match="block_k: expected"):
            skinny_tiles(1, 96, norm=False, block_k=bad)


MODULE = "tests.model_executor.kernels.common.test_skinny_gemm"


def compile_kernels() -> None:
    """The decode step's whole-K tiles (q/k/v with the norm, the output
    projection) built for sm_90 (in a process of its own, by the test
    below): a thread's 16-byte weight loads, those ptxas placed before the
    PDL wait (``ACQBULK``), and the spill bytes."""
    for norm, k in ((True, 2048), (False, 4096)):
        block_n, block_k, whole_k = skinny_tiles(1, k, norm)
        consts: dict[str, object] = dict(
            BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, NORM=norm,
            HAS_RESIDUAL=norm, WHOLE_K=whole_k,
        )  # fmt: skip
        if not norm:
            consts |= dict(res_ptr=None, norm_w_ptr=None, sum_ptr=None)
        aligned = ("N", "K", "stride_xm", "stride_wn", "stride_rm")
        cubin = asm_for_sm90(_skinny_gemm_kernel, consts, {}, aligned, 4)["cubin"]
        before_wait = sass(cubin).partition("ACQBULK")[0].count("LDG.E.128")
        usage = resources(cubin)
        weight_loads = block_n * block_k * 2 // (16 * 128)  # 4 warps
        print(COMPILED, json.dumps([weight_loads, before_wait, usage["LOCAL"],
                                    usage["STACK"]]))  # fmt: skip


def test_whole_k_tiles_load_every_weight_before_the_pdl_wait():
    """What the whole-K tiles are for: all of a program's weights in flight
    before it waits for the kernel before (ptxas may sink loads past the
    wait), without spilling (121-124 registers, Triton 3.9)."""
    builds = compiled_in_own_process(MODULE)
    assert len(builds) == 2
    for weight_loads, before_wait, local, stack in builds:
        assert weight_loads == 16 and before_wait >= weight_loads
        assert local == stack == 0


def test_strided_rows_and_empty(device):
    x = torch.randn(2, 2, 64, device=device, dtype=torch.bfloat16)[:, 1]
    weight = torch.randn(24, 64, device=device, dtype=torch.bfloat16)
    ref = skinny_gemm_reference(x, weight)
    torch.testing.assert_close(skinny_gemm(x, weight, 32), ref, atol=2e-2, rtol=2e-2)
    assert skinny_gemm(x[:0], weight).shape == (0, 24)


def test_applies_where_it_was_measured_to_win():
    bf16 = torch.bfloat16
    for with_pdl in (True, False):
        assert skinny_gemm_applies(1, 128, 2048, bf16, with_pdl)  # a router
        # an output projection
        assert skinny_gemm_applies(2, 2048, 4096, bf16, with_pdl)
        assert not skinny_gemm_applies(2, 5120, 2048, bf16, with_pdl)  # cuBLAS
        assert not skinny_gemm_applies(4, 128, 2048, bf16, with_pdl)
        assert not skinny_gemm_applies(0, 128, 2048, bf16, with_pdl)
        assert not skinny_gemm_applies(1, 128, 2048, torch.float32, with_pdl)
    # One row launched with PDL, after a kernel that was: q/k/v and the head
    # on whole-K tiles, longer K on stepped tiles up to 5120 weight rows
    assert skinny_gemm_applies(1, 5120, 2048, bf16, with_pdl=True)
    assert skinny_gemm_applies(1, 151936, 2048, bf16, with_pdl=True)
    assert skinny_gemm_applies(1, 151936, 4096, bf16, with_pdl=True)
    assert skinny_gemm_applies(1, 5120, 4097, bf16, with_pdl=True)
    assert not skinny_gemm_applies(1, 5121, 4097, bf16, with_pdl=True)
    assert not skinny_gemm_applies(1, 5120, 2048, bf16, with_pdl=False)
    assert not skinny_gemm_applies(1, 151936, 2048, bf16, with_pdl=False)


def test_bad_arguments_are_named(device):
    w = torch.randn(8, 32, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected"):
        skinny_gemm(torch.randn(SKINNY_MAX_ROWS + 1, 32, device=device).bfloat16(), w)
    with pytest.raises(ValueError, match="x: expected"):
        skinny_gemm(torch.randn(2, 32, device=device), w.float())  # fp32
    with pytest.raises(ValueError, match="weight: expected"):
        skinny_gemm(torch.randn(2, 16, device=device).bfloat16(), w)
    with pytest.raises(ValueError, match="weight: expected"):
        skinny_gemm(torch.randn(2, 32, device=device).half(), w)
    with pytest.raises(ValueError, match="weight: expected"):
        skinny_gemm(torch.randn(2, 32, device=device).bfloat16(), w[0, 0])
    with pytest.raises(ValueError, match="block_k: expected"):
        skinny_gemm(torch.randn(2, 32, device=device).bfloat16(), w, block_k=48)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (2, 17, 80), (1, 3, 2048)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("block_k", [32, None])
def test_norm_prologue_equals_the_norm_kernel_then_the_gemm(
    device, m, n, k, with_residual, block_k
):
    """``rms_norm_skinny_gemm`` against ``rms_norm`` then ``skinny_gemm``
    (the kernels round alike) and the fp32 reference: several programs, K
    steps that do not divide K (or, ``block_k`` None at one row, whole-K
    tiles), ``x`` and the residual with other row strides; the sum exactly,
    and the residual left as it was."""
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 24, device=device, dtype=torch.bfloat16)[:, 10 : 10 + k]
    x = x * 3
    residual = (
        torch.randn(m, k + 8, device=device, dtype=torch.bfloat16)[:, :k]
        if with_residual
        else None
    )
    before = None if residual is None else residual.clone()
    norm_weight = (torch.rand(k, device=device) + 0.5).bfloat16()
    weight = torch.randn(n + 5, k, device=device, dtype=torch.bfloat16)[:n]
    out, total = rms_norm_skinny_gemm(x, residual, norm_weight, 1e-6, weight, block_k)
    normed, expected_total = rms_norm(x, norm_weight, 1e-6, residual)
    if residual is None:
        assert total is x
    else:
        assert expected_total is not None and torch.equal(total, expected_total)
        assert before is not None and torch.equal(residual, before)
    # the fp32 sums of squares run in another order: a normalized value may
    # round one bf16 step apart
    torch.testing.assert_close(
        out, skinny_gemm(normed, weight, block_k), atol=5e-2, rtol=2e-2
    )
    ref_normed, _ = rms_norm_reference(x, norm_weight, 1e-6, residual)
    ref = skinny_gemm_reference(ref_normed, weight).float()
    # (the interpreter rounds to bf16 by truncation, toward zero: each of
    # the sum, the normalized row and the output shrinks by ~2^-9 on average)
    assert float((out.float() - ref).norm() / ref.norm()) < 3e-2


def test_norm_prologue_bad_arguments_are_named(device):
    x = torch.randn(1, 32, device=device).bfloat16()
    w = torch.randn(8, 32, device=device).bfloat16()
    nw = torch.ones(32, device=device).bfloat16()
    with pytest.raises(ValueError, match=r"^residual: expected"):
        rms_norm_skinny_gemm(x, x[:, :16], nw, 1e-6, w)
    with pytest.raises(ValueError, match=r"^residual: expected"):
        rms_norm_skinny_gemm(x, x.float(), nw, 1e-6, w)
    with pytest.raises(ValueError, match=r"^norm_weight: expected"):
        rms_norm_skinny_gemm(x, x, nw[:16], 1e-6, w)
    with pytest.raises(ValueError, match=r"^norm_weight: expected"):
        rms_norm_skinny_gemm(x, x, nw.float(), 1e-6, w)
    with pytest.raises(ValueError, match=r"^norm_weight: expected"):
        rms_norm_skinny_gemm(x, x, nw.repeat(2)[::2], 1e-6, w)  # strided
    with pytest.raises(ValueError, match=r"^weight: expected"):
        rms_norm_skinny_gemm(x, x, nw, 1e-6, w[:, :16])
    out, total = rms_norm_skinny_gemm(x[:0], x[:0], nw, 1e-6, w)
    assert out.shape == (0, 8) and total.shape == (0, 32)
