"""Offline packing of the Marlin W4A16 weights and the reference dequantization."""

import pytest
import torch

from vllm.model_executor.kernels.marlin import (
    dequantize_weights,
    quantize_weights,
    repack_weights,
    unpack_weights,
)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def test_repack_roundtrip(device: torch.device) -> None:
    q = torch.randint(0, 16, (24, 256), dtype=torch.uint8, device=device)
    packed = repack_weights(q)
    assert packed.dtype == torch.int32 and packed.shape == (24, 32)
    assert torch.equal(unpack_weights(packed), q.to(torch.int32))
    scales = torch.rand(2, 24, device=device).to(torch.bfloat16)
    assert torch.equal(
        dequantize_weights(packed, scales, 128), dequantize_weights(q, scales, 128)
    )


@pytest.mark.parametrize("group_size", [128, -1])
def test_quantize_close_to_weights(device: torch.device, group_size: int) -> None:
    w = torch.randn(32, 256, device=device)
    q, scales = quantize_weights(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    deq = dequantize_weights(q, scales, group_size)
    # Uniform rounding error on a grid of max|w| / 7: about 0.11 for Gaussians.
    assert _rel_err(deq, w) < 0.2
