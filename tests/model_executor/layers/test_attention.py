import pytest
import torch

from vllm.forward_context import set_forward_context
from vllm.model_executor.kernels.common.qk_norm_rope import QKNormRope
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.v1.attention.backends.torch_paged import PagedAttentionMetadata
from vllm.v1.core.block_pool import BlockPool


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


@pytest.mark.parametrize("with_steps", [False, True])
def test_norm_rope_applied_in_every_path(device, with_steps):
    """With ``norm_rope`` the layer normalizes and rotates q and k itself
    (Triton: under the interpreter on CPU): without a step, in a step with
    prefill (a kernel of its own, with the cache store) and in a decode
    step (inside attention), equal to normalizing and rotating first."""
    torch.manual_seed(3)
    heads, kv_heads, size = 4, 2, 16
    rope = RotaryEmbedding(size, 1e6, 256, device)
    q_norm, k_norm = (RMSNorm(size, 1e-6, device=device) for _ in "qk")
    for norm in (q_norm, k_norm):
        norm.weight.copy_(torch.rand(size) + 0.5)
    layers = [Attention(heads, size, size**-0.5, kv_heads) for _ in range(2)]
    pool = BlockPool(num_blocks=8, block_size=4)
    if with_steps:
        for layer in layers:
            shape = (2, pool.num_blocks, pool.block_size, kv_heads, size)
            layer.kv_cache = torch.full(shape, float("nan"), device=device)
    # a prefill step of two requests, then a decode step of both
    steps = [[("a", 0, 6), ("b", 0, 3)], [("a", 6, 7), ("b", 3, 4)]]
    for chunks in steps if with_steps else [[("a", 0, 6)]]:
        for r, _, end in chunks:
            pool.allocate(r, end)
        meta = PagedAttentionMetadata.build(pool, chunks, device)
        positions = torch.cat(
            [torch.arange(start, end, device=device) for _, start, end in chunks]
        )
        tokens = positions.numel()
        qkv = torch.randn(tokens, heads + 2 * kv_heads, size, device=device)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        ref_q, ref_k = rope(positions, q_norm(q), k_norm(k))
        norm_rope = QKNormRope(
            q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin, positions
        )
        with set_forward_context(meta if with_steps else None):
            ref = layers[0](ref_q, ref_k, v)
            got = layers[1](q, k, v, norm_rope)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    if with_steps:
        torch.testing.assert_close(
            layers[1].kv_cache, layers[0].kv_cache, equal_nan=True
        )
