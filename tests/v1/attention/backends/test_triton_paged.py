"""The Triton paged attention against the plain-PyTorch one (its oracle), on
CPU tensors under ``TRITON_INTERPRET=1``, or on CUDA where there is one."""

import pytest
import torch

from vllm.model_executor.kernels.common.l2_prefetch import prefetchable
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.common.qk_norm_rope import QKNormRope, qk_norm_rope_
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.v1.attention.backends.split_kv import num_kv_splits
from vllm.v1.attention.backends.torch_paged import (
    PagedAttentionMetadata,
    paged_attention,
    write_kv_cache,
)
from vllm.v1.attention.backends.triton_paged import DecodeKV, triton_paged_attention
from vllm.v1.core.block_pool import BlockPool


def _step(
    heads, kv_heads, d, page, chunks, lens, device, dtype=torch.float32, cached=None
):
    """A cache holding ``lens`` tokens per request (NaN in every slot never
    written), or only the first ``cached[r]``, and one step's batch of
    ``chunks``; returns the inputs of both backends."""
    pool = BlockPool(
        num_blocks=sum(-(-n // page) for n in lens.values()) + 2, block_size=page
    )
    for r in sorted(lens, reverse=True):  # tables interleave with the order
        pool.allocate(r, lens[r])
    cache = torch.full(
        (2, pool.num_blocks, page, kv_heads, d),
        float("nan"),
        dtype=dtype,
        device=device,
    )
    for r, n in (cached or lens).items():  # what earlier steps cached
        if not n:
            continue
        meta = PagedAttentionMetadata.build(pool, [(r, 0, n)], device)
        k, v = (torch.randn(n, kv_heads, d, device=device, dtype=dtype) for _ in "kv")
        write_kv_cache(cache, k, v, meta.slot_mapping)
    meta = PagedAttentionMetadata.build(pool, chunks, device)
    q = torch.randn(
        int(meta.slot_mapping.numel()), heads, d, device=device, dtype=dtype
    )
    return q, cache, meta


def _run(q, cache, meta, scale, prefetch=None):
    return triton_paged_attention(
        q,
        cache[0],
        cache[1],
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        scale,
        prefetch=prefetch,
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(4, 2, 16), (6, 2, 24), (4, 4, 32)]
)
def test_mixed_batch_matches_torch(device, heads, kv_heads, d):
    """A prefill chunk continuing a cached prefix, a whole prefill longer
    than one KV tile, a decode token and a one-token chunk: GQA groups of 2,
    3 and 1, head sizes that are and are not powers of two."""
    torch.manual_seed(0)
    lens = {"a": 30, "b": 70, "c": 9, "d": 5}
    chunks = [("a", 19, 30), ("b", 0, 70), ("c", 8, 9), ("d", 4, 5)]
    q, cache, meta = _step(heads, kv_heads, d, 4, chunks, lens, device)
    ref = paged_attention(q, cache, meta, d**-0.5)
    torch.testing.assert_close(_run(q, cache, meta, d**-0.5), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_decode_with_split_kv_matches_torch(device, num_seqs):
    """Decode batches small enough that each request's KV range is split
    over several programs (some of them empty) and combined."""
    torch.manual_seed(1)
    lens = {str(i): n for i, n in enumerate([150, 1, 77][:num_seqs])}
    chunks = [(r, n - 1, n) for r, n in lens.items()]
    q, cache, meta = _step(4, 2, 16, 16, chunks, lens, device)
    assert num_kv_splits(num_seqs, 2, 1, q.device) > 1
    ref = paged_attention(q, cache, meta, 0.3)
    torch.testing.assert_close(_run(q, cache, meta, 0.3), ref, atol=2e-5, rtol=0)


def _norm_rope(d, device, dtype):
    """Random q/k norms and a rope table, with the torch layers they stand
    for (the oracle: checked against ``transformers``)."""
    norms = []
    for _ in "qk":
        norm = RMSNorm(d, 1e-6, dtype=dtype, device=device)
        norm.weight.copy_(torch.randn(d) * 0.5 + 1)
        norms.append(norm)
    rope = RotaryEmbedding(d, 1e6, 4096, device)
    return norms, rope


def _poison_next_allocations(*tensors: tuple[tuple[int, ...], torch.dtype]) -> None:
    """NaN in CUDA memory where tensors of these shapes and dtypes, allocated
    in this order, will land (the caching allocator hands the freed blocks
    back in the same layout)."""
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    poison = [torch.full(s, float("nan"), dtype=t, device="cuda") for s, t in tensors]
    del poison


def _check_decode_new_kv(device, dtype, lens, heads, kv_heads, d):
    """A decode batch whose keys and values are not yet cached (NaN in
    their slots): the kernel normalizes and rotates q and k, attends to the
    new key and value without reading their slots, and stores them there;
    q, k and v stay as they were, and no other slot changes."""
    torch.manual_seed(len(lens))
    names = [str(i) for i in range(len(lens))]
    total = dict(zip(names, lens, strict=True))
    chunks = [(r, n - 1, n) for r, n in total.items()]
    cached = {r: n - 1 for r, n in total.items()}
    _, cache, meta = _step(heads, kv_heads, d, 16, chunks, total, device, dtype, cached)
    tokens = len(lens)
    # q, k and v as strided views of one q/k/v product, as the model passes them
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d, device=device).to(dtype) * 3
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.tensor(lens, device=device) - 1
    (q_norm, k_norm), rope = _norm_rope(d, device, dtype)
    norm_rope = QKNormRope(q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin, positions)
    ref_q, ref_k = rope(positions, q_norm(q), k_norm(k))
    ref_cache = cache.clone()
    write_kv_cache(ref_cache, ref_k, v, meta.slot_mapping)
    ref = paged_attention(ref_q.float(), ref_cache.float(), meta, d**-0.5)
    before = qkv.clone()
    # NaN where the output and the split partials will be allocated: the
    # combine must not read the partials of empty splits (never written)
    splits = num_kv_splits(tokens, kv_heads, 1, q.device)
    _poison_next_allocations(
        ((tokens, heads, d), dtype), ((tokens, heads, splits, d), torch.float32)
    )

    out = triton_paged_attention(
        q, cache[0], cache[1], meta.block_table, meta.seq_lens,
        meta.query_start_loc, 1, d**-0.5,
        DecodeKV(k, v, meta.slot_mapping, norm_rope),
    )  # fmt: skip
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # the new slots hold the rotated keys and the values, every other slot
    # (NaN or cached) is untouched
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=tol, rtol=tol)
    flat = cache.view(2, -1, kv_heads, d)
    assert torch.equal(flat[1, meta.slot_mapping], v)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize(
    ("dtype", "lens"),
    [
        # one request over several splits (4 on the CPU's 8 "SMs", 32 on the
        # H200), some empty; 65 puts the new token first in its KV tile
        (torch.float32, [65]),
        (torch.float32, [150, 1, 77]),  # a first token: no cached key at all
        # (16-bit on CPU: fp16, since the interpreter's bf16 dots are wrong)
        (torch.float16, [150]),
        (torch.float16, [150, 1, 77, 64, 16, 5, 9, 130]),  # one split each
    ],
)
def test_decode_new_kv_matches_norm_rope_then_attention(device, dtype, lens):
    _check_decode_new_kv(device, dtype, lens, 4, 2, 32)


@pytest.mark.parametrize("lens", [[150], [33, 1, 70]])
def test_decode_new_kv_equals_the_separate_kernels(device, lens):
    """Fused and apart (``qk_norm_rope_`` storing k and v, then attention
    reading them from the cache) agree in fp16 within an ulp or two of the
    output: the same roundings, only the new key's place in the fp32 sums
    differs."""
    torch.manual_seed(7)
    heads, kv_heads, d, dtype = 4, 2, 32, torch.float16
    total = {str(i): n for i, n in enumerate(lens)}
    chunks = [(r, n - 1, n) for r, n in total.items()]
    cached = {r: n - 1 for r, n in total.items()}
    _, cache, meta = _step(heads, kv_heads, d, 16, chunks, total, device, dtype, cached)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, device=device).to(dtype)
    (q_norm, k_norm), rope = _norm_rope(d, device, dtype)
    positions = torch.tensor(lens, device=device) - 1
    norm_rope = QKNormRope(q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin, positions)
    runs = []
    for fused in (True, False):
        step_qkv, step_cache = qkv.clone(), cache.clone()
        q, k, v = step_qkv.split([heads, kv_heads, kv_heads], dim=1)
        new_kv = DecodeKV(k, v, meta.slot_mapping, norm_rope)
        if not fused:
            qk_norm_rope_(q, k, norm_rope, step_cache, v, meta.slot_mapping)
        out = triton_paged_attention(
            q, step_cache[0], step_cache[1], meta.block_table, meta.seq_lens,
            meta.query_start_loc, 1, d**-0.5, new_kv if fused else None,
        )  # fmt: skip
        runs.append((out, step_cache))
    (fused_out, fused_cache), (apart_out, apart_cache) = runs
    torch.testing.assert_close(fused_out, apart_out, atol=2e-3, rtol=2e-3)
    assert torch.equal(fused_cache.nan_to_num(), apart_cache.nan_to_num())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_seqs", [1, 5, 40])
def test_decode_new_kv_with_qwen3_heads_on_gpu(num_seqs):
    """Qwen3-30B-A3B's heads in bf16, from 32 splits per request to one."""
    lens = [1 + (97 * i + 511) % 700 for i in range(num_seqs)]
    _check_decode_new_kv("cuda", torch.bfloat16, lens, 32, 4, 128)


def test_new_kv_refusals_name_the_argument(device):
    q, cache, meta = _step(4, 2, 16, 4, [("a", 2, 3)], {"a": 3}, device)
    k = torch.randn(1, 2, 16, device=device)
    (q_norm, k_norm), rope = _norm_rope(16, device, torch.float32)
    positions = torch.tensor([2], device=device)
    norm_rope = QKNormRope(q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin, positions)

    def attend(max_query_len=1, **fields):
        new_kv = {"k": k, "v": k, "slot_mapping": meta.slot_mapping} | fields
        return triton_paged_attention(
            q, cache[0], cache[1], meta.block_table, meta.seq_lens,
            meta.query_start_loc, max_query_len, 1.0,
            DecodeKV(norm_rope=norm_rope, **new_kv),
        )  # fmt: skip

    with pytest.raises(ValueError, match="new_kv: expected a decode batch"):
        attend(max_query_len=2)
    with pytest.raises(ValueError, match=r"k: expected torch.float32 \[1, 2, 16\]"):
        attend(k=k[:, :1])
    with pytest.raises(ValueError, match="v: expected"):
        attend(v=k.half())
    with pytest.raises(ValueError, match="slot_mapping: expected contiguous"):
        attend(slot_mapping=meta.slot_mapping.int())
    with pytest.raises(ValueError, match="positions: expected"):
        norm_rope = QKNormRope(
            q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin, positions.int()
        )
        attend()


def test_q_as_a_view_of_the_fused_qkv_product(device):
    """The model passes q as columns of its one q/k/v GEMM's output: a token
    stride wider than heads x head_size."""
    torch.manual_seed(2)
    chunks = [("a", 13, 21), ("b", 5, 6)]
    q, cache, meta = _step(4, 2, 16, 4, chunks, {"a": 21, "b": 6}, device)
    tokens = q.shape[0]
    qkv = torch.randn(tokens, (4 + 2 * 2) * 16, device=device)
    qkv[:, : 4 * 16] = q.view(tokens, -1)
    strided = qkv[:, : 4 * 16].view(tokens, 4, 16)
    assert strided.stride(0) == qkv.shape[1]
    ref = paged_attention(q, cache, meta, 0.25)
    torch.testing.assert_close(paged_attention(strided, cache, meta, 0.25), ref)
    torch.testing.assert_close(_run(strided, cache, meta, 0.25), ref, atol=2e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("decode", [True, False])
def test_bf16_qwen3_heads_match_torch_on_gpu(decode):
    """Qwen3-30B-A3B's heads (32 query, 4 KV, 128 wide), cache blocks of 16,
    bf16: within bf16 rounding of the torch path (which rounds the scores
    to bf16 before the softmax; the kernel keeps them in fp32)."""
    torch.manual_seed(2)
    lens = {str(i): 100 + 37 * i for i in range(24)}
    chunks = [
        (r, n - 1 if decode or i % 2 else n - 60, n)
        for i, (r, n) in enumerate(lens.items())
    ]
    q, cache, meta = _step(32, 4, 128, 16, chunks, lens, "cuda", torch.bfloat16)
    ref = paged_attention(q.float(), cache.float(), meta, 128**-0.5)
    out = _run(q, cache, meta, 128**-0.5).float()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_prefetching_the_next_weight_changes_nothing_on_gpu(num_seqs):
    """Qwen3-30B-A3B's heads at decode (split KV: the combine runs) with its
    output projection's weight prefetched: the same bits out, the weight
    untouched."""
    torch.manual_seed(4)
    lens = {str(i): 600 - 111 * i for i in range(num_seqs)}
    chunks = [(r, n - 1, n) for r, n in lens.items()]
    q, cache, meta = _step(32, 4, 128, 16, chunks, lens, "cuda", torch.bfloat16)
    weight = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    before = weight.clone()
    plain = _run(q, cache, meta, 128**-0.5)
    # (the prefetch runs where kernels launch with PDL: Hopper on)
    assert prefetchable(weight) == pdl(q.device)
    assert num_kv_splits(num_seqs, 4, 1, q.device) > 1
    warmed = _run(q, cache, meta, 128**-0.5, prefetch=weight)
    assert torch.equal(warmed, plain) and torch.equal(weight, before)


def test_a_prefetch_on_another_device_is_refused(device):
    q, cache, meta = _step(4, 2, 16, 4, [("a", 2, 3)], {"a": 3}, device)
    elsewhere = torch.empty(1024, device="meta")
    with pytest.raises(ValueError, match=f"prefetch: expected a tensor on {device}"):
        _run(q, cache, meta, 1.0, prefetch=elsewhere)


def test_no_tokens_and_bad_metadata(device):
    q, cache, meta = _step(4, 2, 16, 4, [("a", 0, 3)], {"a": 3}, device)
    empty = triton_paged_attention(
        q[:0],
        cache[0],
        cache[1],
        meta.block_table[:0],
        meta.seq_lens[:0],
        meta.query_start_loc[:1],
        1,
        1.0,
    )
    assert empty.shape == (0, 64)
    with pytest.raises(ValueError, match="seq_lens: expected a contiguous 1-D int32"):
        triton_paged_attention(
            q,
            cache[0],
            cache[1],
            meta.block_table,
            meta.seq_lens.long(),
            meta.query_start_loc,
            3,
            1.0,
        )
    with pytest.raises(ValueError, match="key_cache: expected"):
        triton_paged_attention(
            q,
            cache[0, ..., :8],
            cache[1, ..., :8],
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            3,
            1.0,
        )
    with pytest.raises(ValueError, match="value_cache/key_cache: expected"):
        triton_paged_attention(
            q,
            cache[0],
            cache[1].transpose(1, 2).contiguous().transpose(1, 2),  # other strides
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            3,
            1.0,
        )
    with pytest.raises(ValueError, match="max_query_len: 1 bounds 1 requests"):
        triton_paged_attention(
            q,
            cache[0],
            cache[1],
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            1,
            1.0,
        )
    with pytest.raises(ValueError, match="query_start_loc/block_table"):
        triton_paged_attention(
            q,
            cache[0],
            cache[1],
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc[:1],
            3,
            1.0,
        )
