"""Which kernel runs a grouped GEMM call, and the Triton kernels' tiles: the
one place that decides.

Two kernels exist per GEMM: the Triton kernels (:mod:`.triton_kernels`: fp8
operands with per-row scales, any CUDA GPU and the interpreter) and the
warp-specialized Gluon kernels for Hopper (:mod:`.hopper_plain`,
:mod:`.hopper_gated`: also 16-bit operands, per-group activation scales and
an fp8 gated output, sm90 only). A call the Triton kernels can run takes
the Hopper kernel where its default tiles are 128 rows high, no explicit
``config`` forces the Triton tiles, and the kernel can run it
(:func:`takes_gluon`, :func:`takes_gluon_gated`). A call only the Hopper
kernel can run takes it or is refused (:func:`plain_kernel`,
:func:`gated_kernel`).

An expert layer decides once per call, before GEMM1, which kernel each of
its GEMMs runs (:func:`moe_gemm_kernels`); where both take the Hopper
kernels it hands GEMM1 an fp8 output with group scales and GEMM2 those
scales. It passes its choice to the launchers (``kernel=``), which then only
check that the chosen kernel can run the call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from vllm.model_executor.kernels.common.device_info import capability, is_hopper
from vllm.model_executor.kernels.grouped_gemm.hopper_common import BLOCK_M


class Kernel(enum.Enum):
    TRITON = "triton"  # .triton_kernels
    HOPPER = "hopper"  # .hopper_plain / .hopper_gated


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiles of the Triton kernels."""

    block_m: int
    block_n: int  # the gated GEMM: output columns (a 2 x block_n product tile)
    block_k: int
    num_warps: int
    num_stages: int


def default_config(rows: int, num_experts: int) -> GroupedGemmConfig:
    """The fastest checked tiles on the H200 (benchmark_grouped_gemm_fp8
    --sweep): short row groups waste less of a 64-row tile; above 64 rows
    per expert, 128 x 256 tiles halve the A re-reads."""
    if rows <= 64 * num_experts:
        return GroupedGemmConfig(64, 256, 128, 4, 4)
    return GroupedGemmConfig(128, 256, 128, 8, 4)


def default_gated_config(rows: int, num_experts: int) -> GroupedGemmConfig:
    """The fastest checked on the H200 (benchmark_grouped_gemm_fp8 --sweep):
    below a row per expert (decode) 64 x 128 product tiles spread the weight
    reads over more SMs; 64 x 256 up to 32 rows per expert, 128 x 256
    above."""
    if rows < num_experts:
        return GroupedGemmConfig(64, 64, 128, 4, 4)
    if rows <= 32 * num_experts:
        return GroupedGemmConfig(64, 128, 128, 4, 4)
    return GroupedGemmConfig(128, 128, 128, 8, 4)


def hopper_supports(device: torch.device, n: int, out: torch.Tensor) -> bool:
    """Whether the Hopper kernels can run a call: a Hopper GPU (sm90), and an
    ``out`` [R, n] whose rows a TMA box can store (16-byte aligned start and
    rows)."""
    return (
        is_hopper(device)
        and n * out.element_size() % 16 == 0
        and out.data_ptr() % 16 == 0
    )


def hopper_supports_gated(a: torch.Tensor, inter: int, out: torch.Tensor) -> bool:
    """Whether the gated Hopper kernel can run the call:
    :func:`hopper_supports`, and token rows that 16-byte copies can read. The
    callers check K a multiple of 16 with ``w13``: the compiler proves the
    rows 16-byte aligned only from that."""
    return hopper_supports(a.device, inter, out) and a.data_ptr() % 16 == 0


def _gluon_tiles(config: GroupedGemmConfig | None, default: GroupedGemmConfig) -> bool:
    # The Gluon kernels replace the default 128-row tiles, never a config.
    return config is None and default.block_m == BLOCK_M.value


def takes_gluon(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
) -> bool:
    """Whether an fp8 plain GEMM with per-row scales runs the Hopper kernel:
    no explicit ``config``, 128-row default tiles, a call it supports."""
    return _gluon_tiles(
        config, default_config(a.shape[0], w.shape[0])
    ) and hopper_supports(a.device, w.shape[1], out)


def takes_gluon_gated(
    a: torch.Tensor,
    w13: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
) -> bool:
    """:func:`takes_gluon` for the gated GEMM (``out`` [R, I])."""
    return _gluon_tiles(
        config, default_gated_config(out.shape[0], w13.shape[0])
    ) and hopper_supports_gated(a, out.shape[1], out)


@dataclass(frozen=True)
class MoEGemmKernels:
    """The kernels of an expert layer's two fp8 GEMMs for one call."""

    gemm1: Kernel
    gemm2: Kernel

    @property
    def group_scales(self) -> bool:
        """Both run the Hopper kernels, so GEMM1 writes its activation in fp8
        with per-group scales and GEMM2 reads them (no pass between)."""
        return self.gemm1 is Kernel.HOPPER and self.gemm2 is Kernel.HOPPER


def moe_gemm_kernels(
    a: torch.Tensor,
    w13: torch.Tensor,
    act: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
) -> MoEGemmKernels:
    """The layer's decision: GEMM1 (tokens ``a``, ``w13``, into ``act``
    [R, I]) and GEMM2 (``act``, ``w2``, into ``out``) with per-row scales,
    each on the Hopper kernel where it takes the call."""
    gemm1 = Kernel.HOPPER if takes_gluon_gated(a, w13, act) else Kernel.TRITON
    gemm2 = Kernel.HOPPER if takes_gluon(act, w2, out) else Kernel.TRITON
    return MoEGemmKernels(gemm1, gemm2)


def plain_kernel(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None,
    needs_hopper: str | None,
    kernel: Kernel | None,
) -> Kernel:
    """The kernel for a checked plain call: ``kernel`` when the caller chose
    it (checked to run the call), else the one :func:`takes_gluon` picks.
    ``needs_hopper`` says what of the call only the Hopper kernel takes (e.g.
    "per-group a_scale"), or None; such a call is refused, naming the
    argument, where that kernel does not take it."""
    n = w.shape[1]
    if kernel is not None:
        _check_choice(kernel, needs_hopper, a.device, n, out, config)
        return kernel
    if needs_hopper is None:
        return Kernel.HOPPER if takes_gluon(a, w, out, config) else Kernel.TRITON
    _require_hopper(needs_hopper, a.device, n, out, config)
    if a.element_size() == 1 and not takes_gluon(a, w, out, config):
        raise _triton_tiles(needs_hopper, default_config(a.shape[0], w.shape[0]))
    return Kernel.HOPPER


def gated_kernel(
    a: torch.Tensor,
    w13: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None,
    needs_hopper: str | None,
    kernel: Kernel | None,
) -> Kernel:
    """:func:`plain_kernel` for a checked gated call (token rows ``a`` that
    the Hopper kernel gathers checked by the caller)."""
    inter = out.shape[1]
    if kernel is not None:
        _check_choice(kernel, needs_hopper, a.device, inter, out, config)
        return kernel
    if needs_hopper is None:
        hopper = takes_gluon_gated(a, w13, out, config)
        return Kernel.HOPPER if hopper else Kernel.TRITON
    _require_hopper(needs_hopper, a.device, inter, out, config)
    if a.element_size() == 1 and not takes_gluon_gated(a, w13, out, config):
        raise _triton_tiles(needs_hopper, default_gated_config(out.shape[0], len(w13)))
    return Kernel.HOPPER


def _check_choice(
    kernel: Kernel,
    needs_hopper: str | None,
    device: torch.device,
    n: int,
    out: torch.Tensor,
    config: GroupedGemmConfig | None,
) -> None:
    """Refuse a caller's kernel that cannot run the call (never re-choose)."""
    if kernel is Kernel.HOPPER:
        _require_hopper(needs_hopper or "kernel=Kernel.HOPPER", device, n, out, config)
    elif needs_hopper is not None:
        raise ValueError(f"kernel: Kernel.TRITON does not take {needs_hopper}")


def _triton_tiles(why: str, tiles: GroupedGemmConfig) -> ValueError:
    # An fp8 call takes the Hopper kernel only where its default tiles are
    # the Hopper kernel's 128 rows (takes_gluon); these are not.
    return ValueError(
        f"a: {why} needs the Hopper kernel, which takes fp8 calls whose default "
        f"tiles are {BLOCK_M.value} rows high, but this call's are {tiles}"
    )


def _require_hopper(
    why: str,
    device: torch.device,
    n: int,
    out: torch.Tensor,
    config: GroupedGemmConfig | None,
) -> None:
    """Raise naming the argument that keeps the Hopper kernel from a call
    that needs it for ``why``."""
    if config is not None:
        raise ValueError(
            f"config: expected None for {why}, which only the Hopper kernel "
            f"takes (its tiles are fixed), got {config}"
        )
    if not is_hopper(device):
        raise ValueError(
            f"a: expected a tensor on a Hopper GPU (sm90) for {why}, got "
            f"{device} (capability {capability(device)})"
        )
    if not hopper_supports(device, n, out):
        raise ValueError(
            f"out: expected a 16-byte aligned start and rows (TMA stores) for "
            f"{why}, got {n} {out.dtype} columns at {out.data_ptr():#x}"
        )
