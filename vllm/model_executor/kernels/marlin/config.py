"""Host-side facts of the Marlin-style W4A16 GEMM: constants, tile configs
and the bounds they obey; the uint4 MoE decode kernels' tiles
(``moe_decode.py``).

A split-K grid is only correct when all of its slices are resident at once
(later slices wait on earlier ones under the tile's lock), so every config
chosen here keeps ``tiles x split_k`` within :func:`resident_programs`, which
is itself at most :func:`marlin_workspace_numel`: the locks of any chosen
config fit any valid workspace. Heuristics are cached per problem shape.
"""

import functools
from dataclasses import dataclass

import torch
import triton

from vllm.model_executor.kernels.common.device_info import num_sms

PACK = 8  # nibbles per int32 word
TILE_K = 128  # K step of the kernel; K and group sizes are multiples of it
MAX_TILES_PER_SM = 4  # lock counters per SM in the workspace
_REGS_PER_SM = 65536
_SMEM_PER_SM = 228 * 1024
MAX_GROUPED_EXPERTS = 1024  # experts per grouped call: one register vector


@dataclass(frozen=True)
class MarlinConfig:
    """Tile shape and launch parameters; K is always stepped by ``TILE_K``.

    (block_k = 64 with 8 warps and block_n = 128 gave wrong results on the
    H200 with Triton 3.6, so the K step is fixed at the verified 128.)
    """

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    group_n: int = 8


def marlin_workspace_numel(device: torch.device | str) -> int:
    """Int32 lock counters the kernel may use at most on ``device``.

    The caller allocates them zeroed once (e.g. ``torch.zeros(n,
    dtype=torch.int32)``); every call leaves them zero again.
    """
    return num_sms(torch.device(device)) * MAX_TILES_PER_SM


def resident_programs(cfg: MarlinConfig, device: torch.device) -> int:
    """Programs guaranteed resident at once (split-K slices wait on each other)."""
    by_regs = _REGS_PER_SM // (cfg.num_warps * 32 * 255)  # worst-case registers
    stage_bytes = cfg.block_n * TILE_K // 2 + TILE_K * cfg.block_m * 2
    # Pipeline stages plus room for a dequantized tile and the output tile.
    scratch = cfg.block_n * TILE_K * 2 + cfg.block_n * cfg.block_m * 4
    by_smem = _SMEM_PER_SM // (cfg.num_stages * stage_bytes + scratch)
    return num_sms(device) * max(1, min(by_regs, by_smem, MAX_TILES_PER_SM))


def _tile_for_m(m: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages, max split) for M rows.

    The fastest checked tiles per M range on the H200 (docs/marlin.md, v2).
    Small M streams weights: narrow tiles, deep pipelines, split-K up to the
    resident-program bound. Every split adds a serial hand-off through the
    lock, so from M > 16 on splits stop at 2.
    """
    if m <= 16:
        return 16, 64, 4, 6, 16
    if m <= 32:
        return 32, 64, 4, 4, 2
    if m <= 64:
        return 64, 64, 4, 4, 2
    if m <= 256:
        return 128, 128, 8, 3, 4
    return 256, 128, 8, 3, 1


def _largest_split(tiles: int, iters: int, max_split: int, limit: int) -> int:
    """Largest power-of-two split dividing ``iters`` with ``tiles x split <= limit``."""
    split = 1
    while (
        split * 2 <= max_split
        and tiles * split * 2 <= limit
        and iters % (split * 2) == 0
    ):
        split *= 2
    return split


@functools.lru_cache(maxsize=4096)
def default_config(m: int, n: int, k: int, device: torch.device) -> MarlinConfig:
    """The dense GEMM's config for ``[m, k] @ [k, n]``: the M-range tile, split
    K as far as the grid stays resident."""
    bm, bn, warps, stages, max_split = _tile_for_m(m)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    limit = resident_programs(MarlinConfig(bm, bn, 1, warps, stages), device)
    split = _largest_split(tiles, k // TILE_K, max_split, limit)
    return MarlinConfig(bm, bn, split, warps, stages)


def grouped_m_tiles(rows: int, experts: int, block_m: int) -> int:
    """Bound on the M-tiles of ``rows`` rows split among ``experts`` groups.

    sum_e cdiv(rows_e, block_m) <= rows / block_m + (non-empty groups), with at
    most min(experts, rows) groups non-empty.
    """
    return triton.cdiv(rows, block_m) + min(experts, rows)


@functools.lru_cache(maxsize=4096)
def grouped_config(
    rows: int, experts: int, n: int, k: int, device: torch.device
) -> MarlinConfig:
    """Tiles for the mean rows per non-empty expert (the split is unknown on
    the host); split-K only while the whole bounded grid is resident."""
    bm, bn, warps, stages, max_split = _tile_for_m(
        triton.cdiv(rows, min(experts, rows))
    )
    tiles = grouped_m_tiles(rows, experts, bm) * triton.cdiv(n, bn)
    # tiles x split <= resident programs <= marlin_workspace_numel: the
    # locks fit any valid workspace.
    limit = resident_programs(MarlinConfig(bm, bn, 1, warps, stages), device)
    split = _largest_split(tiles, k // TILE_K, max_split, limit)
    return MarlinConfig(bm, bn, split, warps, stages)


# Weight rows per GEMM2 program (topk rounded up to a power of two, times
# its columns): beyond this its products spill registers.
MAX_DOWN_ROWS = 128


@dataclass(frozen=True)
class MarlinDecodeConfig:
    """GEMM1's gate/up pairs, K step and warps per program; GEMM2's output
    columns (each with ``topk`` weight rows), K step and warps; a K step of
    ``32 x num_warps`` words (``block_k / 8``) at least."""

    gated_block_n: int
    gated_block_k: int
    gated_warps: int
    down_block_n: int
    down_block_k: int
    down_warps: int


def default_marlin_decode_config() -> MarlinDecodeConfig:
    """The fastest of 35 on the H200 at one token and within 3% of the
    fastest at 2 and 4 (``benchmark_moe_decode --weights w4a16 --sweep``):
    GEMM1 8 pairs x 512 in two warps, GEMM2 2 columns (16 weight rows at
    top-8) x 256 in one warp."""
    return MarlinDecodeConfig(8, 512, 2, 2, 256, 1)


def decode_fits_topk(topk: int) -> bool:
    """Whether the default config's GEMM2 program holds a token's ``topk``
    routes (at most :data:`MAX_DOWN_ROWS` weight rows: top-64)."""
    rows = triton.next_power_of_2(topk) * default_marlin_decode_config().down_block_n
    return rows <= MAX_DOWN_ROWS
