"""Which kernel runs a call: the Hopper kernels for 128-row default tiles
where they can run (bit for bit the Triton kernel's result), the Triton
kernels otherwise, and calls only the Hopper kernels take refused elsewhere."""

from unittest import mock

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    POISON,
    counted_gated_problem,
    gated_problem,
    model_gemm2,
    needs_hopper,
    problem,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    GroupedGemmConfig,
    dispatch,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
    hopper_gated,
    hopper_plain,
    takes_gluon,
    takes_gluon_gated,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import (
    Kernel,
    MoEGemmKernels,
    hopper_supports,
    moe_gemm_kernels,
)


def test_group_scales_need_the_hopper_kernel(device):
    """The Triton kernels take per-row scales only: per-group ones (and an
    fp8 gated output) are refused with a config, or off Hopper, naming the
    argument."""
    a, _, w, w_scale, offsets = problem([2, 3], 32, 32, device)
    out = torch.empty(a.shape[0], 32, device=device, dtype=torch.bfloat16)
    scale = torch.ones(a.shape[0], 1, device=device)
    config = GroupedGemmConfig(16, 32, 32, 4, 1)
    with pytest.raises(ValueError, match="config: expected None for per-group a_scale"):
        grouped_gemm_fp8(a, scale, w, w_scale, offsets, out, config)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="a: expected a tensor on a Hopper GPU"):
            grouped_gemm_fp8(a, scale, w, w_scale, offsets, out)
    inputs = gated_problem(3, 2, 2, 32, 32, device)
    act = torch.empty(6, 32, device=device, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="config: expected None for an fp8 out"):
        grouped_gemm_fp8_gated(
            *inputs, "silu", act, config, out_scale=torch.ones(6, 1, device=device)
        )


def test_not_taken_off_hopper():
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    assert not hopper_supports(torch.device("cpu"), 16, out)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tokens,experts", [(1024, 128), (8192, 128), (4096, 256)])
def test_launcher_takes_it_and_matches_triton_bitwise(tokens, experts):
    """GEMM2 at model dims (and 256 experts): the launcher picks this kernel
    for 128-row tiles; its output equals the Triton kernel's bit for bit
    (same K order) and the same on every call."""
    torch.manual_seed(tokens)
    inputs = model_gemm2(tokens, experts)
    out = torch.full((tokens * 8, 2048), POISON, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(hopper_plain, "launch", wraps=hopper_plain.launch) as launch:
        grouped_gemm_fp8(*inputs, out)
    assert launch.call_count == (tokens * 8 > 64 * experts)
    triton_out = torch.full_like(out, POISON)
    grouped_gemm_fp8(*inputs, triton_out, GroupedGemmConfig(128, 256, 128, 8, 4))
    assert torch.equal(out, triton_out)
    again = torch.full_like(out, POISON)
    for _ in range(4):
        grouped_gemm_fp8(*inputs, again)
        assert torch.equal(again, out)


@pytest.mark.gpu
@needs_hopper
def test_unsupported_calls_take_the_triton_kernels():
    """N not a multiple of 8, an ``out`` or gathered ``a`` off 16-byte
    alignment: the Triton kernels run, with the same results."""
    torch.manual_seed(2)
    inputs = model_gemm2(2048)
    rows = inputs[0].shape[0]
    ref = grouped_gemm_fp8_reference(
        *inputs, torch.empty(rows, 2048, device="cuda", dtype=torch.bfloat16)
    )
    flat = torch.empty(rows * 2048 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(rows, 2048)  # 2-byte aligned
    assert not takes_gluon(inputs[0], inputs[2], shifted)
    grouped_gemm_fp8(*inputs, shifted)
    torch.testing.assert_close(shifted, ref, rtol=1.6e-2, atol=1e-2)
    narrow = torch.empty(rows, 2044, device="cuda", dtype=torch.bfloat16)
    assert not takes_gluon(inputs[0], inputs[2][:, :2044], narrow)
    gated = counted_gated_problem([300, 200], 128, 256)
    a_bytes = torch.empty(gated[0].numel() + 8, device="cuda", dtype=torch.uint8)
    a_off = a_bytes[8:].view(gated[0].dtype).view(gated[0].shape)
    a_off.copy_(gated[0])
    act = torch.empty(500, 128, device="cuda", dtype=torch.bfloat16)
    assert takes_gluon_gated(gated[0], gated[4], act)
    assert not takes_gluon_gated(a_off, gated[4], act)
    grouped_gemm_fp8_gated(a_off, *gated[1:], "silu", act)
    ref_act = grouped_gemm_fp8_gated_reference(*gated, "silu", torch.empty_like(act))
    torch.testing.assert_close(act, ref_act, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@needs_hopper
def test_gated_launcher_takes_it_and_matches_triton_bitwise():
    """qwen3-30b-a3b GEMM1 at 8192 tokens: the launcher picks this kernel;
    bit for bit the Triton kernel's output, on every call."""
    torch.manual_seed(0)
    inputs = gated_problem(8192, 8, 128, 768, 2048, "cuda")
    out = torch.full((8192 * 8, 768), POISON, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(
        hopper_gated, "launch_gated", wraps=hopper_gated.launch_gated
    ) as launch:
        grouped_gemm_fp8_gated(*inputs, "silu", out)
    launch.assert_called_once()
    triton_out = torch.full_like(out, POISON)
    config = GroupedGemmConfig(128, 128, 128, 8, 4)
    grouped_gemm_fp8_gated(*inputs, "silu", triton_out, config)
    assert torch.equal(out, triton_out)
    again = torch.full_like(out, POISON)
    for _ in range(4):
        grouped_gemm_fp8_gated(*inputs, "silu", again)
        assert torch.equal(again, out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interprets on CPU tensors")
def test_a_callers_kernel_is_checked_not_rechosen(monkeypatch):
    """An expert layer's choice runs as given where it can (here the Triton
    kernel for a call dispatch would also give it) and is refused, naming
    ``kernel``, where it cannot; group scales on an fp8 call whose default
    tiles are 64 rows are refused even on Hopper (the rule before the
    restructuring)."""
    a, a_scale, w, w_scale, offsets = problem([2, 3], 32, 32, torch.device("cpu"))
    out = torch.full((a.shape[0], 32), POISON, dtype=torch.bfloat16)
    grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out, kernel=Kernel.TRITON)
    ref = grouped_gemm_fp8_reference(a, a_scale, w, w_scale, offsets, out.clone())
    torch.testing.assert_close(out, ref)
    groups = torch.ones(a.shape[0], 1)
    with pytest.raises(ValueError, match=r"kernel: Kernel\.TRITON does not take"):
        grouped_gemm_fp8(a, groups, w, w_scale, offsets, out, kernel=Kernel.TRITON)
    with pytest.raises(ValueError, match="a: expected a tensor on a Hopper GPU"):
        grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out, kernel=Kernel.HOPPER)
    monkeypatch.setattr(dispatch, "is_hopper", lambda device: True)
    with pytest.raises(ValueError, match="tiles are 128 rows high"):
        grouped_gemm_fp8(a, groups, w, w_scale, offsets, out)  # 5 rows, 64-row tiles


def test_the_layer_decides_both_gemms_once():
    """Off Hopper both GEMMs take the Triton kernels and per-row scales."""
    a, _, w13, _, _ = problem([2, 3], 64, 32, torch.device("cpu"))
    act = torch.empty(a.shape[0], 32, dtype=FP8_DTYPE)
    w2 = torch.empty(2, 32, 32, dtype=FP8_DTYPE)
    out = torch.empty(a.shape[0], 32, dtype=torch.bfloat16)
    kernels = moe_gemm_kernels(a, w13, act, w2, out)
    assert kernels == MoEGemmKernels(Kernel.TRITON, Kernel.TRITON)
    assert not kernels.group_scales
    assert MoEGemmKernels(Kernel.HOPPER, Kernel.HOPPER).group_scales
    assert not MoEGemmKernels(Kernel.HOPPER, Kernel.TRITON).group_scales
