"""CutlassExpertsFp8: the devices and sizes it refuses (its numerics are
compared with the dense reference in test_modular_kernel.py)."""

import pytest
import torch

from tests.model_executor.layers.fused_moe.utils import moe_config, random_weights
from vllm.model_executor.layers.fused_moe.config import QuantScheme
from vllm.model_executor.layers.fused_moe.experts import fp8_channel
from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8
from vllm.model_executor.layers.fused_moe.experts.triton_fp8_moe import TritonExpertsFp8


@pytest.mark.parametrize(
    ("have", "cutlass", "triton_fp8"),
    [((8, 0), False, False), ((8, 9), False, True), ((9, 0), True, True)],
)
def test_capability_decides(monkeypatch, have, cutlass, triton_fp8):
    """_scaled_grouped_mm needs sm90; our fp8 GEMMs fp8 tensor cores (sm89)."""
    monkeypatch.setattr(fp8_channel, "capability", lambda device: have)
    moe = moe_config("cpu", scheme=QuantScheme.FP8_PER_TOKEN)
    cuda = torch.device("cuda")
    for cls, runs in ((CutlassExpertsFp8, cutlass), (TritonExpertsFp8, triton_fp8)):
        reason = cls.unsupported(moe, cuda)
        assert (reason is None) == runs
        if not runs:
            assert f"{cls.__name__} needs compute capability" in str(reason)


def test_sizes_and_scheme_are_refused_at_construction():
    moe = moe_config("cpu", scheme=QuantScheme.FP8_PER_TOKEN, hidden_size=136)
    with pytest.raises(ValueError, match="multiples of 16, got 136/64"):
        CutlassExpertsFp8.from_unquantized(moe, *random_weights(moe, "cpu"))
    bf16 = moe_config("cpu")
    with pytest.raises(ValueError, match=r"moe\.quant_config\.scheme"):
        CutlassExpertsFp8.from_unquantized(bf16, *random_weights(bf16, "cpu"))
