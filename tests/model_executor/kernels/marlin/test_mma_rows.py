"""The host-side checks of the tensor-core K loop (``marlin/mma_rows.py``):
which inputs its vector loads can read, and which configs launch. The loop
itself runs in the dense and MoE kernels' tests (``test_gemv_mma.py``,
``test_moe_decode_mma.py``)."""

from dataclasses import dataclass

import pytest
import torch

from vllm.model_executor.kernels.marlin.mma_rows import (
    check_warp_tiles,
    rows_aligned,
)


def test_rows_aligned():
    a = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert rows_aligned(a)
    assert rows_aligned(a[1:])  # a row is 128 bytes
    assert not rows_aligned(a.flatten()[1:65].view(1, 64))  # 2 bytes off
    assert not rows_aligned(torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64])
    assert rows_aligned(torch.zeros(1, 68, dtype=torch.bfloat16)[:, :64])  # one row
    experts = torch.zeros(3, 8, 16, dtype=torch.int32)  # [E, N, K // 8]: rows
    assert rows_aligned(experts)
    assert not rows_aligned(torch.zeros(3, 8, 18, dtype=torch.int32)[:, :, :16])


@dataclass
class Tiles:
    tiles: int
    per_warp: int
    slices: int


NAMES = ("tiles", "per_warp", "slices")


def test_check_warp_tiles():
    check_warp_tiles(Tiles(4, 2, 8), NAMES)  # 16 warps
    with pytest.raises(ValueError, match="config: slices must be a power of two"):
        check_warp_tiles(Tiles(1, 1, 3), NAMES)
    with pytest.raises(ValueError, match="config: per_warp must divide tiles"):
        check_warp_tiles(Tiles(2, 4, 1), NAMES)
    with pytest.raises(ValueError, match="in at most 16 warps"):
        check_warp_tiles(Tiles(4, 1, 8), NAMES)  # 32 warps
