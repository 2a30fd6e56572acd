"""The attention layer of the models.

In a batched step (:func:`vllm.forward_context.set_forward_context` with
paged-attention metadata) it stores the step's keys and values in its KV
cache, bound with :func:`bind_kv_cache`, and attends per request: in
Triton on CUDA, in plain PyTorch (the oracle) on CPU. Called
outside such a step it runs one sequence without a cache (all ``T`` tokens
attend to those before them): a model's plain forward, e.g. for checks.

Qwen3's per-head q/k norm + RoPE (``norm_rope``, Triton only) runs in the
attention kernel in decode steps, and before it, in one kernel with the
cache store, otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import current_attn_metadata
from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.qk_norm_rope import QKNormRope, qk_norm_rope_
from vllm.v1.attention.backends.torch_paged import (
    PagedAttentionMetadata,
    attend,
    paged_attention,
    write_kv_cache,
)
from vllm.v1.attention.backends.triton_paged import DecodeKV, triton_paged_attention


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={num_heads}, got "
                f"{num_kv_heads}"
            )
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads, self.scale = num_kv_heads, scale
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        norm_rope: QKNormRope | None = None,
        prefetch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q`` [T, heads, head_size], ``k``/``v`` [T, kv_heads, head_size]
        -> [T, heads * head_size]. ``norm_rope``: ``q`` and ``k`` (heads at
        unit stride, a power-of-two size) still need it, on the Triton path;
        they may be left normalized and rotated in place, or as they were.
        ``prefetch``: the weight of the GEMM that follows (the output
        projection), warmed in L2 while the attention runs, on the Triton
        path where it may (:mod:`~.kernels.common.l2_prefetch`)."""
        meta = current_attn_metadata()
        if meta is None:
            if norm_rope is not None:
                qk_norm_rope_(q, k, norm_rope)
            return attend(q, k, v, self.scale, 0)
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("attention: a batched step needs a bound KV cache")
        new_kv = None
        if norm_rope is None:
            write_kv_cache(cache, k, v, meta.slot_mapping)
        elif self.fuses_norm_rope(meta):
            new_kv = DecodeKV(k, v, meta.slot_mapping, norm_rope)
        else:  # the norms, rotations and cache store in one kernel
            qk_norm_rope_(
                q, k, norm_rope, kv_cache=cache, v=v, slot_mapping=meta.slot_mapping
            )
        if new_kv is None and not runs_gpu_kernels(q):
            return paged_attention(q, cache, meta, self.scale)
        return triton_paged_attention(
            q,
            cache[0],
            cache[1],
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            self.scale,
            new_kv,
            prefetch=prefetch,
        )

    @staticmethod
    def fuses_norm_rope(meta: PagedAttentionMetadata) -> bool:
        """Whether the attention kernel applies ``norm_rope`` (and stores the
        keys and values) itself: in decode batches, saving a launch."""
        return meta.max_query_len == 1


def bind_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int
) -> list[torch.Tensor]:
    """Give every attention layer of ``model`` its cache, [2, num_blocks,
    block_size, kv_heads, head_size] in the model's dtype and device
    (zeroed: unwritten slots are never read, but stay finite)."""
    caches = []
    param = next(model.parameters())
    for layer in model.modules():
        if isinstance(layer, Attention):
            shape = (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
            caches.append(layer.kv_cache)
    return caches
