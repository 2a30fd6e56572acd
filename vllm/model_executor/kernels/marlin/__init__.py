"""Marlin-style W4A16 GEMM in Triton: ``C[M, N] = A[M, K] @ dequant(B)^T``
(the grouped one on Hopper also on :mod:`~..grouped_gemm.hopper_plain`).

A and C are bf16 or fp16; B holds uint4 weights with per-group or per-channel
scales. ``config``: constants, tile heuristics and workspace sizing;
``kernels``: the Triton kernels; ``gemm``: the checked launchers (dense and
grouped by expert); ``packing``: offline quantization and repacking, and the
reference dequantization.
"""

from vllm.model_executor.kernels.marlin.config import (
    MAX_GROUPED_EXPERTS,
    MAX_TILES_PER_SM,
    PACK,
    TILE_K,
    MarlinConfig,
    marlin_workspace_numel,
)
from vllm.model_executor.kernels.marlin.gemm import (
    check_marlin_args,
    marlin_gemm,
    marlin_gemm_grouped,
)
from vllm.model_executor.kernels.marlin.packing import (
    dequantize_weights,
    quantize_weights,
    repack_weights,
    unpack_weights,
)

__all__ = [
    "MAX_GROUPED_EXPERTS",
    "MAX_TILES_PER_SM",
    "PACK",
    "TILE_K",
    "MarlinConfig",
    "check_marlin_args",
    "dequantize_weights",
    "marlin_gemm",
    "marlin_gemm_grouped",
    "marlin_workspace_numel",
    "quantize_weights",
    "repack_weights",
    "unpack_weights",
]
