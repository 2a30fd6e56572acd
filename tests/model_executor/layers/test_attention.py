import pytest
import torch

from vllm.model_executor.layers.attention import Attention


def test_causal_gqa_matches_sdpa():
    torch.manual_seed(0)
    tokens, heads, kv_heads, size = 9, 8, 2, 16
    q = torch.randn(tokens, heads, size)
    k, v = torch.randn(tokens, kv_heads, size), torch.randn(tokens, kv_heads, size)
    out = Attention(heads, size, size**-0.5, kv_heads)(q, k, v)
    group = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
    )
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(tokens, heads * size))
    # The first token attends to itself only.
    torch.testing.assert_close(
        out[0].view(heads, size), v[0].repeat_interleave(group, 0)
    )
    with pytest.raises(
        ValueError, match="num_kv_heads: expected a divisor of num_heads=8"
    ):
        Attention(8, size, 1.0, 3)
