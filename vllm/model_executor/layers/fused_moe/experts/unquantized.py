"""Unquantized (bf16/fp16) experts' weights and workspaces.

The base of the ``grouped_mm`` and ``triton`` backends, which differ in
their pipeline (``apply``) and may re-lay w13 out for their kernels. Both
need two workspaces of rows: [R, K] (workspace13: the permuted tokens, or
GEMM2's rows) and [R, I] (workspace2: the activation).
"""

from __future__ import annotations

from typing import Self

import torch

from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, QuantScheme
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    Shape,
    check_tensors,
)


class UnquantizedExperts(FusedMoEExperts):
    supported_schemes = (QuantScheme.UNQUANTIZED,)

    def __init__(
        self, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> None:
        super().__init__(moe)
        self.check_supported(moe, w13.device)
        el = moe.num_local_experts
        check_tensors(
            ("w13", w13, (el, moe.w13_rows, moe.hidden_size), moe.in_dtype),
            ("w2", w2, (el, moe.hidden_size, moe.intermediate_size), moe.in_dtype),
        )

    @classmethod
    def from_unquantized(
        cls, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> Self:
        return cls(moe, w13, w2)

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
    ) -> tuple[Shape, Shape, Shape]:
        itemsize = self.moe.in_dtype.itemsize
        rows = M * topk
        return (rows * K * itemsize,), (rows * (N // 2) * itemsize,), (M, K)
