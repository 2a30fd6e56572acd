"""Quantized grouped-GEMM experts on the humming-kernels package (``humming``).

Weights are quantized and repacked once (:meth:`HummingGroupedExperts.
from_unquantized`); both expert GEMMs run humming's ``grouped_contiguous``
GEMM over rows grouped by local expert, with our ``expert_first_token_offset``
as the expert layout. Per call:

- normal path: ``moe_prepare_scatter`` fills the index metadata, then
  humming's scatter kernel (quantizing for fp8 activations) writes each
  token's rows straight to their permuted positions in workspace13;
- prequantized path (block FP8): the fp8 rows and their [M, K/128] scales are
  permuted with ``moe_permute`` into the same workspace13 buffer;
- GEMM1 -> workspace2; gated activation (+ re-quantization) -> workspace13;
  GEMM2 -> workspace2; ``moe_unpermute`` reduces into the output.

``humming`` is imported lazily, so this module imports on CPU-only machines.
The permute scratch and the Stream-K lock buffer come from the workspace
manager inside :meth:`HummingGroupedExperts.apply`; the object holds weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.kernels.common.activation_quant import (
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
)
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, QuantScheme
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    Shape,
    carve,
    check_tensors,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_permute,
    moe_prepare_scatter,
    moe_unpermute,
)
from vllm.utils import align_up
from vllm.v1.worker.workspace import ALIGNMENT, get_lock_buffer

_FP8 = torch.float8_e4m3fn
_GEMM_TYPE = "grouped_contiguous"
_COMPUTE_CONFIG = json.dumps({"gemm_type": _GEMM_TYPE})

# Humming pads N and K of the repacked weights; activations keep the real K.
_PAD_N = 256
_PAD_K = 128

# (upper bound, sample) in expanded rows: one kernel per bucket, chosen by
# humming's heuristics at the sample size. Few buckets keep JIT time short
# (each distinct kernel compiles in seconds on first use).
_ROW_BUCKETS = ((64, 64), (1024, 512), (1 << 30, 8192))

# Stream-K semaphores: a kernel needs (ctas + ctas / 10) x locks-per-tile, with
# ctas = ctas-per-SM x SMs (145 on an H200 with one CTA per SM).
_LOCKS_PER_SM = 8
HUMMING_LOCKS_KEY = "humming_locks"

# ``binary_split`` activations: a = gate (first half), b = up (second half).
_ACTIVATION_IMPLS = {
    "silu": "a / (1.0f + expf(-a)) * b",
    "swiglu": (
        f"fminf(a, {SWIGLU_LIMIT}f) / (1.0f + expf(-{SWIGLU_ALPHA}f * "
        f"fminf(a, {SWIGLU_LIMIT}f))) * "
        f"(fminf(fmaxf(b, -{SWIGLU_LIMIT}f), {SWIGLU_LIMIT}f) + 1.0f)"
    ),
}


@dataclass(frozen=True)
class _SchemeSpec:
    b_dtype: str
    bs_dtype: str | None  # None: the activation dtype (16-bit group scales)
    weight_group: int  # along K; 0 = one scale per output channel
    weight_group_n: int  # along N; > 0 = block scales
    fp8_activations: bool
    input_group: int  # activation scale group along K; 0 = per token
    multiple: int  # hidden and intermediate sizes must be multiples of this
    min_sm: int


_SCHEMES = {
    QuantScheme.W4A16_UINT4: _SchemeSpec("uint4", None, 128, 0, False, 0, 128, 80),
    QuantScheme.W4A16_MXFP4: _SchemeSpec(
        "float4e2m1", "float8e8m0", 32, 0, False, 0, 32, 80
    ),
    QuantScheme.FP8_PER_TOKEN: _SchemeSpec("float8e4m3", None, 0, 0, True, 0, 16, 89),
    QuantScheme.FP8_BLOCK: _SchemeSpec(
        "float8e4m3", "float32", 128, 128, True, 128, 128, 89
    ),
}

_HUMMING_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_weights(moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor) -> None:
    el = moe.num_local_experts
    check_tensors(
        ("w13", w13, (el, moe.w13_rows, moe.hidden_size), None),
        ("w2", w2, (el, moe.hidden_size, moe.intermediate_size), None),
    )
    if w2.device != w13.device:
        raise ValueError(f"w2: expected device {w13.device}, got {w2.device}")


class _HummingGemm:
    """One grouped GEMM: repacked weights, humming layer config, kernel table."""

    def __init__(
        self,
        w: torch.Tensor,
        moe: FusedMoEConfig,
        spec: _SchemeSpec,
    ) -> None:
        from humming.schema import HummingInputSchema, HummingWeightSchema
        from humming.transform import (
            prepare_fp16_e8m0_scale,
            prepare_layer_config,
            transform_humming_tensors,
        )

        act = _HUMMING_DTYPES[moe.in_dtype]
        num_experts, self.shape_n, self.shape_k = w.shape
        self.weight_schema = HummingWeightSchema(
            b_dtype=spec.b_dtype,
            bs_dtype=spec.bs_dtype or act,
            weight_scale_group_size=spec.weight_group,
            weight_scale_group_size_n=spec.weight_group_n,
        )
        input_schema = HummingInputSchema(
            a_dtype="float8e4m3" if spec.fp8_activations else act,
            input_scale_group_size=spec.input_group,
        )
        # Compact quantized weights: the source of dequantized_weights().
        self.quantized = HummingWeightSchema.quant_tensor(
            w.contiguous(), self.weight_schema, moe.in_dtype
        )
        config = prepare_layer_config(
            shape_n=self.shape_n,
            shape_k=self.shape_k,
            weight_schema=self.weight_schema,
            input_schema=input_schema,
            num_experts=num_experts,
            pad_n_to_multiple=_PAD_N,
            pad_k_to_multiple=_PAD_K,
            torch_dtype=moe.in_dtype,
            device=w.device,
        )
        config, tensors = prepare_fp16_e8m0_scale(config, self.quantized)
        self.config = config
        self.tensors: dict[str, torch.Tensor] = transform_humming_tensors(
            config, tensors
        )
        self.tuning = self._tuning_table(w.device)
        mode = config.input_quant_mode
        self.input_dtype = _FP8 if mode.should_quantize else moe.in_dtype
        self.has_group_scale = bool(mode.has_group_scale)
        self.has_token_scale = bool(mode.has_token_scale)

    def _tuning_table(self, device: torch.device) -> str:
        """Row intervals -> kernel config, as humming's launcher table (JSON)."""
        from humming.tune import get_heuristics_config

        table: list[list[Any]] = []
        lower = 0
        for upper, sample in _ROW_BUCKETS:
            config = get_heuristics_config(
                self.config, shape_m=sample, gemm_type=_GEMM_TYPE, device=device
            )
            if table and table[-1][2] == config:
                table[-1][1] = upper
            else:
                table.append([lower, upper, config])
            lower = upper
        return json.dumps(table)

    def input_groups(self) -> int:
        """Activation scale columns per row (0 for 16-bit activations)."""
        if self.has_group_scale:
            return self.shape_k // self.config.input_scale_group_size
        return 1 if self.has_token_scale else 0

    def input_nbytes(self, rows: int) -> int:
        data = rows * self.shape_k * self.input_dtype.itemsize
        return align_up(data, ALIGNMENT) + rows * self.input_groups() * 4

    def input_views(
        self, workspace: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(activations [rows, K], fp32 scales [rows, groups] or None)."""
        data = carve(workspace, (rows, self.shape_k), self.input_dtype)
        groups = self.input_groups()
        if not groups:
            return data, None
        offset = align_up(data.nbytes, ALIGNMENT)
        return data, carve(workspace, (rows, groups), torch.float32, offset)

    def scale_kwargs(self, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``process_input`` keyword for this GEMM's activation scales."""
        if scale is None:
            return {}
        return {"group_scales" if self.has_group_scale else "token_scales": scale}

    def run(
        self,
        inputs: torch.Tensor,
        input_scale: torch.Tensor | None,
        outputs: torch.Tensor,
        expert_first_token_offset: torch.Tensor,
        locks: torch.Tensor,
    ) -> None:
        from humming.forward import humming_forward

        t = self.tensors
        humming_forward(
            self.config,
            inputs,
            weight=t["weight"],
            weight_scale=t.get("weight_scale"),
            zero_point=t.get("zero_point"),
            weight_scale_2=t.get("weight_scale_2"),
            outputs=outputs,
            input_scale=input_scale,
            expert_layout=expert_first_token_offset,
            locks=locks,
            compute_config=_COMPUTE_CONFIG,
            tuning_config=self.tuning,
        )

    def dequantized(self) -> torch.Tensor:
        return self.weight_schema.dequant_tensors(self.quantized).float()


class HummingGroupedExperts(FusedMoEExperts):
    """Experts whose two GEMMs run humming's quantized grouped GEMM.

    Build with :meth:`from_unquantized`. Workspace layout, for R = M x topk
    expanded rows (byte workspaces, typed views carved per call):

    - workspace13: the input of GEMM1 ([R, K] activations, then fp32 scales
      at the next 256-byte boundary), later reused for the input of GEMM2
      ([R, I] activation output and its scales);
    - workspace2: the output of GEMM1 ([R, 2I]), later that of GEMM2 ([R, K]).

    Rows of non-local or invalid routes sit at or past the last expert
    offset; humming neither reads nor writes them, and buffers have R rows so
    any scatter target stays in bounds.
    """

    supported_schemes = tuple(_SCHEMES)

    def __init__(
        self,
        moe: FusedMoEConfig,
        gemm1: _HummingGemm,
        gemm2: _HummingGemm,
        num_sms: int,
    ) -> None:
        super().__init__(moe)
        self.gemm1 = gemm1
        self.gemm2 = gemm2
        self.num_locks = num_sms * _LOCKS_PER_SM
        self.activation_impl = _ACTIVATION_IMPLS[moe.activation]

    @classmethod
    def unsupported(cls, moe: FusedMoEConfig, device: torch.device) -> str | None:
        """Needs the humming-kernels package and a CUDA device new enough for
        the scheme, a 16-bit activation dtype and sizes the scheme tiles."""
        reason = super().unsupported(moe, device)
        if reason is not None:
            return reason
        scheme = moe.quant_config.scheme
        spec = _SCHEMES[scheme]
        if moe.activation not in _ACTIVATION_IMPLS:
            return (
                f"moe.activation: HummingGroupedExperts supports "
                f"{list(_ACTIVATION_IMPLS)}, got {moe.activation!r}"
            )
        for name, size in (
            ("hidden_size", moe.hidden_size),
            ("intermediate_size", moe.intermediate_size),
        ):
            if size % spec.multiple:
                return (
                    f"moe.{name}: {scheme.value} with humming needs a multiple of "
                    f"{spec.multiple}, got {size}"
                )
        try:
            import humming  # noqa: F401
        except ImportError as e:
            return (
                "moe.quant_config: HummingGroupedExperts needs the humming-kernels "
                f"package (import humming failed: {e})"
            )
        if device.type != "cuda" or not torch.cuda.is_available():
            return (
                f"w13: humming kernels need weights on a CUDA device (sm75+), got "
                f"{device} (CUDA available: {torch.cuda.is_available()})"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor < max(spec.min_sm, 75):
            return (
                f"w13: {scheme.value} with {moe.in_dtype} activations needs "
                f"sm{spec.min_sm}+ for humming, {device} is sm{major}{minor}"
            )
        return None

    @classmethod
    def from_unquantized(
        cls, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> HummingGroupedExperts:
        """Quantize w13 [E_local, 2I, K] and w2 [E_local, K, I] per the scheme."""
        _check_weights(moe, w13, w2)
        cls.check_supported(moe, w13.device)
        spec = _SCHEMES[moe.quant_config.scheme]
        num_sms = torch.cuda.get_device_properties(w13.device).multi_processor_count
        with torch.cuda.device(w13.device):
            gemm1 = _HummingGemm(w13, moe, spec)
            gemm2 = _HummingGemm(w2, moe, spec)
        return cls(moe, gemm1, gemm2, num_sms)

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w13, w2) as the kernels see them, for reference checks."""
        return self.gemm1.dequantized(), self.gemm2.dequantized()

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
    ) -> tuple[Shape, Shape, Shape]:
        rows = M * topk
        bytes13 = max(self.gemm1.input_nbytes(rows), self.gemm2.input_nbytes(rows))
        bytes2 = rows * max(N, K) * self.moe.in_dtype.itemsize
        return (bytes13,), (bytes2,), (M, K)

    def _locks(self, device: torch.device) -> torch.Tensor:
        """Stream-K semaphores of this (slot, stream); zero between calls."""
        return get_lock_buffer(HUMMING_LOCKS_KEY, self.num_locks, device)

    def _check_inputs(
        self, hidden_states: torch.Tensor, a1q_scale: torch.Tensor | None
    ) -> None:
        moe = self.moe
        expected = _FP8 if moe.quant_config.prequantized else moe.in_dtype
        if (
            hidden_states.dim() != 2
            or hidden_states.shape[1] != moe.hidden_size
            or hidden_states.dtype != expected
        ):
            raise ValueError(
                f"hidden_states: expected [M, {moe.hidden_size}] {expected}, got "
                f"{tuple(hidden_states.shape)} {hidden_states.dtype}"
            )
        if moe.quant_config.prequantized:
            groups = moe.hidden_size // moe.quant_config.block_size
            if a1q_scale is None or tuple(a1q_scale.shape) != (
                hidden_states.shape[0],
                groups,
            ):
                got = None if a1q_scale is None else tuple(a1q_scale.shape)
                raise ValueError(
                    f"a1q_scale: expected [{hidden_states.shape[0]}, {groups}] fp32 "
                    f"block scales, got {got}"
                )

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        a1q_scale: torch.Tensor | None,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
    ) -> None:
        from humming.forward import may_process_input

        self._check_inputs(hidden_states, a1q_scale)
        moe = self.moe
        num_tokens, topk = topk_ids.shape
        rows = num_tokens * topk
        if rows == 0:
            return  # no rows: humming's kernel table has no interval for M=0
        device = hidden_states.device
        scratch = self.permute_scratch(device)
        gemm1, gemm2 = self.gemm1, self.gemm2
        in1, in1_scale = gemm1.input_views(workspace13, rows)
        if moe.quant_config.prequantized:
            # fp8 rows and their block scales move together; in1 is fp8-typed.
            _, in1_scale, offsets, inv, _ = moe_permute(
                hidden_states,
                a1q_scale,
                topk_ids,
                moe.num_experts,
                moe.num_local_experts,
                expert_map,
                permuted_hidden_states=in1,
                scratch=scratch,
                permuted_a1q_scale=in1_scale,
            )
        else:
            offsets, inv = moe_prepare_scatter(topk_ids, expert_map, scratch)
            # Quantize (fp8) and scatter each route to its permuted row.
            may_process_input(
                gemm1.config,
                hidden_states.contiguous(),
                outputs=in1,
                layout="scatter",
                scatter_idx=inv.view(num_tokens, topk),
                num_valid_tokens=offsets[-1:],
                **gemm1.scale_kwargs(in1_scale),
            )
        locks = self._locks(device)
        gemm1_out = carve(workspace2, (rows, moe.w13_rows), moe.in_dtype)
        gemm1.run(in1, in1_scale, gemm1_out, offsets, locks)

        # in1 is dead after GEMM1: the activation output takes its place.
        in2, in2_scale = gemm2.input_views(workspace13, rows)
        may_process_input(
            gemm2.config,
            gemm1_out,
            outputs=in2,
            activation_type="binary_split",
            activation_impl=self.activation_impl,
            num_valid_tokens=offsets[-1:],
            **gemm2.scale_kwargs(in2_scale),
        )
        gemm2_out = carve(workspace2, (rows, moe.hidden_size), moe.in_dtype)
        gemm2.run(in2, in2_scale, gemm2_out, offsets, locks)
        moe_unpermute(output, gemm2_out, topk_weights, inv, offsets)
