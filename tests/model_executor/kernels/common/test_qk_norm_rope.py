"""The fused per-head RMSNorm + RoPE (+ KV-cache store) kernel against the
layers it replaces (``RMSNorm``, ``RotaryEmbedding`` and
``write_kv_cache``, themselves checked against ``transformers`` and the
paged-attention oracle)."""

import pytest
import torch

from vllm.model_executor.kernels.common.qk_norm_rope import QKNormRope, qk_norm_rope_
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.v1.attention.backends.torch_paged import write_kv_cache

HEAD_SIZE = 32


def _norms(device, dtype):
    norms = []
    for _ in range(2):
        norm = RMSNorm(HEAD_SIZE, 1e-6, dtype=dtype, device=device)
        norm.weight.copy_(torch.randn(HEAD_SIZE))
        norms.append(norm)
    return norms


def _tol(dtype):
    # bf16: a few ulps (the fp32 sum order moves a rounding that the
    # rotation's roundings then carry; the interpreter truncates to bf16)
    return 1e-5 if dtype == torch.float32 else 4 * 2**-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads"), [(1, 4, 2), (5, 3, 3), (0, 2, 1)]
)
def test_matches_norm_then_rope(device, dtype, tokens, heads, kv_heads):
    torch.manual_seed(tokens * 7 + heads)
    rope = RotaryEmbedding(HEAD_SIZE, 1e6, 4096, device)
    q_norm, k_norm = _norms(device, dtype)
    # q and k as strided views of one projection, as the model passes them
    qkv = torch.randn(tokens, 8, HEAD_SIZE, device=device, dtype=dtype) * 2
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    positions = torch.randint(0, 4096, (tokens,), device=device)
    ref_q, ref_k = rope(positions, q_norm(q), k_norm(k))
    untouched = qkv[:, heads + kv_heads :].clone()
    norm_rope = QKNormRope(q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin, positions)
    qk_norm_rope_(q, k, norm_rope)
    torch.testing.assert_close(q, ref_q, atol=_tol(dtype), rtol=_tol(dtype))
    torch.testing.assert_close(k, ref_k, atol=_tol(dtype), rtol=_tol(dtype))
    assert torch.equal(qkv[:, heads + kv_heads :], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stores_keys_and_values_at_their_slots(device, dtype):
    torch.manual_seed(1)
    tokens, heads, kv_heads, blocks, block_size = 5, 4, 2, 3, 4
    rope = RotaryEmbedding(HEAD_SIZE, 1e6, 4096, device)
    q_norm, k_norm = _norms(device, dtype)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, HEAD_SIZE, device=device)
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    slots = torch.randperm(blocks * block_size, device=device)[:tokens]
    shape = (2, blocks, block_size, kv_heads, HEAD_SIZE)
    cache = torch.randn(shape, device=device).to(dtype)  # poison: never zeros
    ref_cache = cache.clone()
    ref_q, ref_k = rope(positions, q_norm(q), k_norm(k))
    write_kv_cache(ref_cache, ref_k, v, slots)
    norm_rope = QKNormRope(q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin, positions)
    qk_norm_rope_(q, k, norm_rope, kv_cache=cache, v=v, slot_mapping=slots)
    torch.testing.assert_close(cache, ref_cache, atol=_tol(dtype), rtol=_tol(dtype))
    flat = cache.view(2, -1, kv_heads, HEAD_SIZE)
    assert torch.equal(flat[1, slots], v)  # values copied, not recomputed
    others = torch.ones(blocks * block_size, dtype=torch.bool, device=device)
    others[slots] = False
    assert torch.equal(
        flat[:, others], ref_cache.view(2, -1, kv_heads, HEAD_SIZE)[:, others]
    )
    torch.testing.assert_close(q, ref_q, atol=_tol(dtype), rtol=_tol(dtype))


def test_bad_arguments_are_named(device):
    rope = RotaryEmbedding(16, 1e4, 64, device)
    q, k = torch.randn(3, 4, 16, device=device), torch.randn(3, 2, 16, device=device)
    weight, positions = torch.ones(16, device=device), torch.arange(3, device=device)
    fields = (weight, weight, 1e-6, rope.cos_sin, positions)
    args = (QKNormRope(*fields),)
    with pytest.raises(ValueError, match="q: expected"):
        qk_norm_rope_(torch.randn(3, 2, 12, device=device), k, *args)
    with pytest.raises(ValueError, match="q: expected"):
        qk_norm_rope_(torch.randn(3, 32, device=device), k, *args)
    with pytest.raises(ValueError, match="k: expected"):
        qk_norm_rope_(q, torch.randn(2, 2, 16, device=device), *args)
    with pytest.raises(ValueError, match="cos_sin: expected"):
        qk_norm_rope_(
            q, k, QKNormRope(weight, weight, 1e-6, rope.cos_sin.double(), positions)
        )
    with pytest.raises(ValueError, match="positions: expected"):
        qk_norm_rope_(q, k, QKNormRope(*fields[:4], positions[:2]))
    with pytest.raises(ValueError, match="positions: expected"):
        qk_norm_rope_(q, k, QKNormRope(*fields[:4], positions.int()))
    with pytest.raises(ValueError, match="q_weight/k_weight"):
        qk_norm_rope_(q, k, QKNormRope(weight, weight[:8], *fields[2:]))
    with pytest.raises(ValueError, match="k: expected"):
        qk_norm_rope_(q, k.double(), *args)
    cache = torch.zeros(2, 1, 4, 2, 16, device=device)
    with pytest.raises(ValueError, match="v: expected"):  # one head, not two
        qk_norm_rope_(q, k, *args, kv_cache=cache, v=k[:, :1], slot_mapping=positions)
    with pytest.raises(ValueError, match="v: expected"):
        qk_norm_rope_(q, k, *args, kv_cache=cache, v=k.half(), slot_mapping=positions)
    strided = torch.arange(6, device=device)[::2]
    with pytest.raises(ValueError, match="slot_mapping: expected contiguous"):
        qk_norm_rope_(q, k, *args, kv_cache=cache, v=k, slot_mapping=strided)
    with pytest.raises(ValueError, match="v/slot_mapping"):
        qk_norm_rope_(q, k, *args, kv_cache=torch.zeros(2, 1, 4, 2, 16, device=device))
    with pytest.raises(ValueError, match="kv_cache: expected"):
        qk_norm_rope_(
            q, k, *args, kv_cache=torch.zeros(2, 1, 4, 3, 16, device=device), v=k,
            slot_mapping=positions,
        )  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping: expected"):
        qk_norm_rope_(
            q, k, *args, kv_cache=torch.zeros(2, 1, 4, 2, 16, device=device), v=k,
            slot_mapping=positions.int(),
        )  # fmt: skip
