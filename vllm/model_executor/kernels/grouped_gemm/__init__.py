"""Grouped GEMMs over expert-contiguous rows (the permute's layout), for the
MoE expert layers: fp8 w8a8 with per-row and per-channel scales, or bf16 /
fp16, plain or with the permute and the gated activation fused in.

Experts backend names: ``triton`` and ``triton_fp8`` run these GEMMs (Triton
kernels, and on Hopper the warp-specialized Gluon ones); ``cutlass`` runs
``torch._scaled_grouped_mm`` (CUTLASS inside) and ``grouped_mm``
``torch._grouped_mm``.

Modules: :mod:`.api` (the calls and their argument checks), :mod:`.dispatch`
(which kernel runs a call, and the Triton tiles), :mod:`.layout` (the
interleaved w13 and group-scaled activations), :mod:`.triton_kernels`,
:mod:`.hopper_common` / :mod:`.hopper_plain` / :mod:`.hopper_gated` (the
warp-specialized Gluon kernels for sm90), :mod:`.reference` (plain PyTorch:
the oracle and the CPU path), and :mod:`.decode` (decode batches: the two
expert GEMMs route by route, without the sort). Callers use the names re-exported here.
"""

from vllm.model_executor.kernels.grouped_gemm.api import (
    grouped_gemm,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_gated,
)
from vllm.model_executor.kernels.grouped_gemm.decode import (
    DECODE_MAX_TOKENS,
    DecodeConfig,
    moe_decode,
    moe_decode_reference,
    moe_decode_routed,
    moe_decode_routed_reference,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import (
    GroupedGemmConfig,
    MoEGemmKernels,
    default_config,
    default_gated_config,
    moe_gemm_kernels,
    takes_gluon,
    takes_gluon_gated,
)
from vllm.model_executor.kernels.grouped_gemm.layout import (
    act_groups,
    deinterleave_gate_up,
    interleave_gate_up,
)
from vllm.model_executor.kernels.grouped_gemm.reference import (
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
    grouped_gemm_gated_reference,
    grouped_gemm_reference,
    quantize_groups_reference,
)

__all__ = [
    "DECODE_MAX_TOKENS",
    "DecodeConfig",
    "GroupedGemmConfig",
    "MoEGemmKernels",
    "act_groups",
    "default_config",
    "default_gated_config",
    "deinterleave_gate_up",
    "grouped_gemm",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_gated",
    "grouped_gemm_fp8_gated_reference",
    "grouped_gemm_fp8_reference",
    "grouped_gemm_gated",
    "grouped_gemm_gated_reference",
    "grouped_gemm_reference",
    "interleave_gate_up",
    "moe_decode",
    "moe_decode_reference",
    "moe_decode_routed",
    "moe_decode_routed_reference",
    "moe_gemm_kernels",
    "quantize_groups_reference",
    "takes_gluon",
    "takes_gluon_gated",
]
