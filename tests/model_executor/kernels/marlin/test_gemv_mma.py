"""The W4A16 decode kernel on the tensor cores (``marlin/gemv_mma.py``)
against the exact product.

The kernel multiplies exact ``MAGIC + q`` weights and starts each K step's
sum from ``-(MAGIC + 8)`` times the activations' sum, so beyond the output's
16-bit rounding its error is fp32 accumulation over terms of up to ``(MAGIC
+ 8) * |x| * scale``: the bound below. A fragment or K-order mistake puts
errors of the output's own size everywhere. The kernel is Gluon with inline
PTX: it runs on NVIDIA GPUs only (CPU runs check its build for sm_90 and its
argument errors).
"""

import functools
import json

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    COMPILED,
    compiled_in_own_process,
    sass,
)
from tests.model_executor.kernels.marlin.test_gemm import _rel_err
from tests.model_executor.kernels.marlin.test_gemv import (
    _check,
    _exact,
    _problem,
    _workspace,
    replay_with_new_inputs,
)
from vllm.model_executor.kernels.marlin import marlin_gemm, unpack_weights
from vllm.model_executor.kernels.marlin.gemv_mma import (
    MMA_GEMV_MAX_M,
    MmaGemvConfig,
    _mma_gemv_kernel,
    default_mma_gemv_config,
)

MODULE = "tests.model_executor.kernels.marlin.test_gemv_mma"
# The largest unpacked weight, MAGIC + 15 UNIT, in units of UNIT.
LARGEST_PAIR = {torch.bfloat16: 128.0 + 15, torch.float16: 1024.0 / 16 + 15}


def _bound(a, scales, group_size, bound):
    """:func:`_exact`'s ``bound`` plus the offset's fp32 accumulation: 16
    roundings a step (8 MMAs, 8 for the offset; a tensor core may truncate:
    a unit of 2^-23) of sums up to the largest pair times |x| |scale|."""
    g = a.shape[1] if group_size == -1 else group_size
    s = scales.float().abs().t().repeat_interleave(g, dim=1)  # [N, K]
    magic_terms = LARGEST_PAIR[a.dtype] * (a.float().abs() @ s.t())
    return bound + 16 * 2.0**-23 * magic_terms


def _cuda(device):
    if device.type != "cuda":
        pytest.skip("Gluon with inline PTX: NVIDIA GPUs only")


def compile_kernels() -> None:
    """bf16 / fp16, group / channel scales, two configs (run in a process of
    its own by the test below): the MMAs in the PTX, and in the SASS the
    16-byte loads before the PDL wait (``ACQBULK``) and after it."""
    # Triton internals: imported here, so that a move fails this test only.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    args = ["a_ptr", "b_ptr", "s_ptr", "c_ptr", "M", "N", "K"]
    args += ["stride_am", "stride_bn", "stride_sg", "stride_cm"]
    for dtype in ("bf16", "fp16"):
        for group_size in (128, -1):
            for cfg, blocks in ((MmaGemvConfig(1, 1, 1), 1),
                                (MmaGemvConfig(2, 2, 4), 2)):  # fmt: skip
                ptr = f"*{dtype}"
                types = [ptr, "*i32", ptr, ptr] + ["i32"] * 7
                signature = dict(zip(args, types, strict=True))
                consts = {
                    "GROUP_SIZE": group_size,
                    "ROW_TILES": cfg.row_tiles,
                    "TILES_PER_WARP": cfg.tiles_per_warp,
                    "K_SPLIT": cfg.k_split,
                    "A_BLOCKS": blocks,
                    "FP16": dtype == "fp16",
                    "PDL": True,
                }
                signature |= dict.fromkeys(consts, "constexpr")
                aligned = {
                    (i,): [["tt.divisibility", 16]]
                    for i, name in enumerate(args)
                    if name.endswith("_ptr") or name in ("K", "stride_am", "stride_bn")
                }
                source = GluonASTSource(
                    _mma_gemv_kernel, signature, constexprs=consts, attrs=aligned
                )
                compiled = triton.compile(
                    source,
                    target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": cfg.num_warps},
                )
                ab = "bf16" if dtype == "bf16" else "f16"
                mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}"
                code = sass(compiled.asm["cubin"])
                before, _, after = code.partition("ACQBULK")
                loads = [before.count("LDG.E.128"), after.count("LDG.E.128")]
                mmas = compiled.asm["ptx"].count(mma)
                print(COMPILED, json.dumps([cfg.tiles_per_warp, blocks, mmas, loads]))


def resources(cubin: bytes) -> dict[str, int]:
    """What a thread of ``cubin``'s kernel takes, by cuobjdump's names:
    ``REG`` registers, ``LOCAL`` and ``STACK`` bytes (spills)."""
    usage = sass(cubin, "-res-usage").split("REG:", 1)[1].splitlines()[0]
    fields = dict(field.split(":") for field in ("REG:" + usage).split())
    return {name: int(value) for name, value in fields.items() if value.isdigit()}


def test_compiles_for_sm90_without_a_gpu():
    """Each build holds one K step's MMAs (8 per row tile of a warp, 8 for
    the offset, each for every block of 8 rows of A) and, as ptxas schedules
    it, loads the first step's words of rows g and g + 8 of each tile
    before the PDL wait, the activations only after it (the PDL contract,
    :mod:`~.common.pdl`)."""
    builds = compiled_in_own_process(MODULE)
    assert len(builds) == 8
    for tiles_per_warp, blocks, mmas, (before_wait, after_wait) in builds:
        assert mmas == (8 * tiles_per_warp + 8) * blocks
        assert before_wait == 2 * tiles_per_warp
        assert after_wait > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 13, MMA_GEMV_MAX_M])
@pytest.mark.parametrize(
    "config",
    [MmaGemvConfig(1, 1, 1), MmaGemvConfig(2, 1, 2), MmaGemvConfig(2, 2, 4),
     MmaGemvConfig(4, 2, 2)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize(
    "shape",
    # (N, K, group): N not a multiple of 16 or of a program's rows; one K
    # step (fewer steps than warps over K); steps not a multiple of the
    # split; groups of 256 and 384 (several steps a group); per channel.
    [(40, 384, 128), (8, 128, 128), (200, 1024, 128), (64, 512, 256),
     (24, 768, 384), (24, 640, -1)],
    ids=str,
)  # fmt: skip
def test_matches_exact_product(device, shape, config, m, dtype):
    _cuda(device)
    n, k, group_size = shape
    a, packed, scales, exact, bound = _problem(m, n, k, group_size, dtype, device)
    locks = _workspace(device)
    locks[0] = 1000  # poisoned: the kernel must not read or clear it
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    res = marlin_gemm(
        a, packed, scales, locks, group_size=group_size, size_n=n, size_k=k,
        out=out, config=config,
    )  # fmt: skip
    assert res is out
    _check(out, exact, _bound(a, scales, group_size, bound))
    assert int(locks[0]) == 1000 and int(locks[1:].abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activations_far_from_zero_mean(device, dtype):
    """Activations all positive, or centred on 6: the per-step offset (the
    largest pair times the activations' sum) no longer cancels by sign, so
    its fp32 accumulation error is as large as it gets."""
    _cuda(device)
    n, k = 64, 2048
    a, packed, scales, _, _ = _problem(4, n, k, 128, dtype, device)
    for shifted in (a.float().abs(), a.float() + 6):
        a = shifted.to(dtype)
        out = marlin_gemm(
            a, packed, scales, _workspace(device), group_size=128, size_n=n,
            size_k=k, config=MmaGemvConfig(2, 2, 4),
        )  # fmt: skip
        exact, bound = _exact(a, packed, scales, 128)
        _check(out, exact, _bound(a, scales, 128, bound))


@pytest.mark.parametrize("m", [3, 12])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_of_a_and_out_with_a_stride(device, dtype, m):
    """A and out as views with row strides past K and N: only their own
    columns are read and written (12 rows: in both blocks of A)."""
    _cuda(device)
    n, k = 48, 384
    a, packed, scales, exact, bound = _problem(m, n, k, 128, dtype, device)
    wide = torch.full((m, k + 128), float("inf"), dtype=a.dtype, device=device)
    wide[:, :k] = a
    out = torch.full((m, n + 8), 7.0, dtype=a.dtype, device=device)
    marlin_gemm(
        wide[:, :k], packed, scales, _workspace(device), group_size=128, size_n=n,
        size_k=k, out=out[:, :n], config=MmaGemvConfig(2, 1, 2),
    )  # fmt: skip
    _check(out[:, :n], exact, _bound(a, scales, 128, bound))
    assert bool((out[:, n:] == 7.0).all())


def test_bad_arguments_raise(device):
    n, k = 16, 256
    a, packed, scales, _, _ = _problem(
        MMA_GEMV_MAX_M + 1, n, k, 128, torch.float16, device
    )
    call = functools.partial(
        marlin_gemm, b_packed=packed, scales=scales, workspace=_workspace(device),
        group_size=128, size_n=n, size_k=k,
    )  # fmt: skip
    with pytest.raises(ValueError, match="a: at most 16 rows"):
        call(a, config=MmaGemvConfig(1, 1, 1))
    with pytest.raises(ValueError, match="config: k_split must be a power of two"):
        call(a[:1], config=MmaGemvConfig(1, 1, 3))
    with pytest.raises(ValueError, match="config: tiles_per_warp must divide"):
        call(a[:1], config=MmaGemvConfig(2, 4, 1))
    with pytest.raises(ValueError, match="config: tiles_per_warp must divide"):
        call(a[:1], config=MmaGemvConfig(8, 1, 4))  # 32 warps
    shifted = torch.zeros(1, k + 8, dtype=a.dtype, device=device)[:, 1 : k + 1]
    with pytest.raises(ValueError, match="a: an MmaGemvConfig reads 16-byte"):
        call(shifted, config=MmaGemvConfig(1, 1, 1))
    rows = torch.zeros(2, k + 4, dtype=a.dtype, device=device)[:, :k]  # 8-byte rows
    with pytest.raises(ValueError, match="a: an MmaGemvConfig reads 16-byte"):
        call(rows, config=MmaGemvConfig(1, 1, 1))
    words = torch.zeros(packed.numel() + 1, dtype=packed.dtype, device=device)
    words = words[1:].view(packed.shape)
    with pytest.raises(ValueError, match="b_packed: an MmaGemvConfig reads 16-byte"):
        call(a[:1], b_packed=words, config=MmaGemvConfig(1, 1, 1))
    if device.type == "cpu":
        with pytest.raises(ValueError, match="config: an MmaGemvConfig runs compiled"):
            call(a[:1], config=MmaGemvConfig(1, 1, 1))


@pytest.mark.parametrize(
    "m, n, k", [(2, 4096, 8192), (5, 4096, 8192), (12, 1024, 2048)]
)
def test_default_path_takes_unaligned_rows_elsewhere(device, m, n, k):
    """An A 2 bytes off 16-byte alignment, or with 8-byte rows, is no error
    for ``marlin_gemm`` without a config: it goes to a kernel that reads it.
    Each size is one the tensor cores would take with aligned rows; the
    tolerance is the tile GEMM's (bf16 weights, ``test_gemm.py``)."""
    if device.type == "cpu":
        n, k = 16, 256  # the interpreter: only the fallback's result is checked
    a, packed, scales, exact, _ = _problem(m, n, k, 128, torch.bfloat16, device)
    buf = torch.zeros(m * (k + 4) + 1, dtype=a.dtype, device=device)
    off_by_two = buf[1 : m * k + 1].view(m, k)
    eight_byte_rows = buf[: m * (k + 4)].view(m, k + 4)[:, :k]
    for view in (off_by_two, eight_byte_rows):
        view.copy_(a)
        out = marlin_gemm(
            view, packed, scales, _workspace(device), group_size=128, size_n=n,
            size_k=k,
        )  # fmt: skip
        assert _rel_err(out, exact) < 1e-2, view.stride()


GPU_SHAPES = [(4096, 4096), (8192, 8192), (28672, 4096), (4096, 14336), (5120, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("m", [1, 4, 8, 12, 16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_model_sizes(shape, m, group_size):
    n, k = shape
    dev = torch.device("cuda")
    a, packed, scales, exact, bound = _problem(m, n, k, group_size, torch.bfloat16, dev)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    marlin_gemm(
        a, packed, scales, _workspace(dev), group_size=group_size, size_n=n,
        size_k=k, out=out, config=default_mma_gemv_config(n),
    )  # fmt: skip
    _check(out, exact, _bound(a, scales, group_size, bound))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_inputs():
    m, n, k = 4, 8192, 8192
    dev = torch.device("cuda")
    a, packed, scales, _, _ = _problem(m, n, k, 128, torch.bfloat16, dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    gemm = functools.partial(
        marlin_gemm, b_packed=packed, scales=scales, workspace=_workspace(dev),
        group_size=128, size_n=n, size_k=k, out=out, config=default_mma_gemv_config(n),
    )  # fmt: skip

    def exact_and_bound():
        exact, bound = _exact(a, packed, scales, 128)
        return exact, _bound(a, scales, 128, bound)

    replay_with_new_inputs(gemm, a, out, exact_and_bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bound_catches_a_wrong_k_order(dtype):
    """The bound is tight enough to fail a kernel that pairs weights with
    the wrong activations: the product with the K order of each word's
    nibbles swapped falls outside it."""
    a, packed, scales, exact, bound = _problem(2, 48, 256, 128, dtype, "cpu")
    swapped = unpack_weights(packed).reshape(48, -1, 2, 4).flip(-1).reshape(48, 256)
    g = scales.float().t().repeat_interleave(128, dim=1)
    wrong = a.float() @ ((swapped.float() - 8) * g).t()
    limit = _bound(a, scales, 128, bound)
    assert not bool(((wrong - exact).abs() <= limit).all())
