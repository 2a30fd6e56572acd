"""The fused per-head RMSNorm + RoPE kernel against the layers it replaces
(``RMSNorm`` and ``RotaryEmbedding``, themselves checked against
``transformers``)."""

import pytest
import torch

from vllm.model_executor.kernels.common.qk_norm_rope import qk_norm_rope_
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads"), [(1, 4), (5, 3), (0, 2)])
def test_matches_norm_then_rope(device, dtype, tokens, heads):
    torch.manual_seed(tokens * 7 + heads)
    head_size = 32
    rope = RotaryEmbedding(head_size, 1e6, 4096, device)
    norm = RMSNorm(head_size, 1e-6, dtype=dtype, device=device)
    norm.weight.copy_(torch.randn(head_size))
    x = torch.randn(tokens, 8, head_size, device=device, dtype=dtype)[:, :heads] * 2
    positions = torch.randint(0, 4096, (tokens,), device=device)
    ref, _ = rope(positions, norm(x), norm(x))
    out = qk_norm_rope_(x, norm.weight, norm.eps, rope.cos_sin, positions)
    assert out.data_ptr() == x.data_ptr()  # in place
    # bf16: a few ulps (the fp32 sum order moves a rounding that the
    # rotation's roundings then carry; the interpreter truncates to bf16)
    tol = 1e-5 if dtype == torch.float32 else 4 * 2**-7
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_bad_arguments_are_named(device):
    rope = RotaryEmbedding(16, 1e4, 64, device)
    x = torch.randn(3, 2, 16, device=device)
    weight, positions = torch.ones(16, device=device), torch.arange(3, device=device)
    with pytest.raises(ValueError, match="x: expected"):
        qk_norm_rope_(
            torch.randn(3, 2, 12, device=device), weight, 1e-6, rope.cos_sin, positions
        )
    with pytest.raises(ValueError, match="cos_sin: expected"):
        qk_norm_rope_(x, weight, 1e-6, rope.cos_sin.double(), positions)
    with pytest.raises(ValueError, match="positions/weight"):
        qk_norm_rope_(x, weight, 1e-6, rope.cos_sin, positions[:2])
