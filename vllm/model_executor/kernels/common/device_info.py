"""Device facts the kernel launchers size their grids and pick kernels by."""

from __future__ import annotations

import functools

import torch
import triton

# Program-count bound under TRITON_INTERPRET (no SMs on CPU): small, so that
# CPU tests still give each persistent program several tiles.
CPU_SMS = 8


def runs_gpu_kernels(t: torch.Tensor) -> bool:
    """Whether callers run the GPU kernels on ``t`` (CUDA tensors: ours in
    Triton or Gluon, or torch's CUDA ops) or the plain-PyTorch references
    (CPU: the fallback path and the test oracle).

    The one place that makes this choice; Triton kernels themselves still run
    on CPU tensors under ``TRITON_INTERPRET=1``, which is how tests reach them.
    """
    return t.is_cuda


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``CPU_SMS`` off CUDA)."""
    return _cuda_sms(_index(device)) if device.type == "cuda" else CPU_SMS


@functools.cache  # host time per GEMM call matters; SM counts never change
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def l2_bytes(device: torch.device) -> int:
    """L2 cache bytes of CUDA ``device``."""
    return _cuda_l2_bytes(_index(device))


@functools.cache  # asked per launch; never changes
def _cuda_l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability of ``device`` (None off CUDA)."""
    return _cuda_capability(_index(device)) if device.type == "cuda" else None


def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm90 GPU (the Gluon kernels' target)."""
    return capability(device) == (9, 0)


@functools.cache  # asked on every GEMM call; never changes
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def persistent_programs(
    device: torch.device, rows: int, num_experts: int, block_m: int, n_tiles: int
) -> int:
    """Programs of a persistent grouped GEMM: one per SM at most, and no more
    than its (row tile, N tile) pairs can need. At most min(E, R) experts
    have rows, each with one partial row tile."""
    row_tiles = -(-rows // block_m) + min(num_experts, rows)
    return min(num_sms(device), row_tiles * n_tiles)


def inline_ptx(device: torch.device, kernel: triton.runtime.KernelInterface) -> bool:
    """Whether ``kernel`` may use inline PTX on ``device``: compiled (not
    the interpreter's, whatever the environment says now) for an NVIDIA GPU."""
    return (
        isinstance(kernel, triton.runtime.JITFunction)
        and device.type == "cuda"
        and not torch.version.hip
    )
