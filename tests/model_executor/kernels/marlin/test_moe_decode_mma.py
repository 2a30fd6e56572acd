"""The uint4 experts' decode kernels on the tensor cores
(``marlin/moe_decode_mma.py``) against the plain-PyTorch reference, through
``marlin_moe_decode`` with an MmaMoeDecodeConfig.

Routing as in ``test_moe_decode.py``: a repeated expert, the first and last
expert, invalid ids and, under ``expert_map``, remote experts; ``act`` rows
of routes without a local expert stay poisoned. Gluon with inline PTX: the
kernels run on NVIDIA GPUs only (CPU runs check their build for sm_90 and
the argument errors).
"""

import itertools
import json
from typing import Any

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    COMPILED,
    compiled_in_own_process,
    sass,
)
from tests.model_executor.kernels.marlin.test_moe_decode import (
    POISON,
    _close,
    _local,
    _run,
    _run_routed,
    _weights,
)
from vllm.model_executor.kernels.marlin.moe_decode import (
    marlin_moe_decode,
    marlin_moe_decode_routed,
)
from vllm.model_executor.kernels.marlin.moe_decode_mma import (
    MmaMoeDecodeConfig,
    _down_sum_mma_kernel,
    _gated_mma_kernel,
    default_mma_moe_decode_config,
)
from vllm.model_executor.kernels.marlin.moe_decode_reference import (
    marlin_moe_decode_reference,
    marlin_moe_decode_routed_reference,
)

MODULE = "tests.model_executor.kernels.marlin.test_moe_decode_mma"
# bf16 outputs round at 2^-8; fp16 at 2^-11 (relative to the largest).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
CONFIGS = [
    default_mma_moe_decode_config(),
    MmaMoeDecodeConfig(1, 1, 1, 1, 1, 1),
    MmaMoeDecodeConfig(4, 2, 2, 2, 1, 2),
    # GEMM2's programs of 256 columns: the second one partial at hidden 384.
    MmaMoeDecodeConfig(1, 1, 1, 16, 8, 1),
]


def _cuda(device):
    if device.type != "cuda":
        pytest.skip("Gluon with inline PTX: NVIDIA GPUs only")


def compile_kernels() -> None:
    """Both kernels, bf16 and fp16, both packings, routing by ids and from
    logits (run in a process of its own by the test below): the MMAs in the
    PTX, and the loads before and after the PDL wait in the SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = default_mma_moe_decode_config()
    for dtype, w4a8, routed in itertools.product(
        ("bf16", "fp16"), (False, True), (False, True)
    ):
        fp16 = dtype == "fp16"
        ptr, scale = f"*{dtype}", "*fp32" if w4a8 else f"*{dtype}"
        common: dict[str, object] = dict(
            HAS_MAP=True, NIBBLES_IN_ORDER=w4a8, GROUP_SIZE=128, FP16=fp16, PDL=True,
            ROUTED=routed, BLOCK_E=128,
        )  # fmt: skip
        gated = common | dict(
            GATE_UP_INTERLEAVED=w4a8, MODE=1, ALPHA=1.702, LIMIT=7.0,
            ROW_TILES=cfg.gated_row_tiles, TILES_PER_WARP=cfg.gated_tiles_per_warp,
            K_SPLIT=cfg.gated_k_split,
        )  # fmt: skip
        down = common | dict(
            ROW_TILES=cfg.down_row_tiles, TILES_PER_WARP=cfg.down_tiles_per_warp,
            ROUTE_SPLIT=cfg.down_route_split, RENORMALIZE=True,
            BLOCK_R=8,
        )  # fmt: skip
        # Pointers by name: routing int32, route weights fp32, scales.
        types = {"ids_ptr": "*i32", "map_ptr": "*i32", "w_ptr": "*i32",
                 "weights_ptr": "*fp32", "s_ptr": scale}  # fmt: skip
        builds: list[tuple[Any, dict[str, object], int]] = [
            (_gated_mma_kernel, gated,
             cfg.gated_row_tiles // cfg.gated_tiles_per_warp * cfg.gated_k_split),
            (_down_sum_mma_kernel, down,
             cfg.down_row_tiles // cfg.down_tiles_per_warp * cfg.down_route_split),
        ]  # fmt: skip
        for kernel, consts, warps in builds:
            args = [p.name for p in kernel.params if not p.is_constexpr]
            signature = {
                name: types.get(name, ptr) if name.endswith("_ptr") else "i32"
                for name in args
            }
            signature |= dict.fromkeys(consts, "constexpr")
            # As a launch specializes them (the weights' strides are multiples
            # of K / 8 words, K of 128): the words' loads are 16 bytes.
            aligned = {
                (i,): [["tt.divisibility", 16]]
                for i, name in enumerate(args)
                if name.endswith("_ptr")
                or name in ("K", "inter", "hidden", "stride_we", "stride_wn")
            }
            source = GluonASTSource(kernel, signature, constexprs=consts, attrs=aligned)
            compiled = triton.compile(
                source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
            )
            ab = "f16" if fp16 else "bf16"
            mmas = compiled.asm["ptx"].count(f"m16n8k16.row.col.f32.{ab}.{ab}")
            code = sass(compiled.asm["cubin"])
            before, _, after = code.partition("ACQBULK")
            loads = [before.count("LDG"), before.count("LDG.E.128")]
            loads.append(after.count("LDG.E.128"))
            print(COMPILED, json.dumps([kernel.__name__, mmas, loads]))


def test_compiles_for_sm90_without_a_gpu():
    """GEMM1 (one K step of 2 row tiles a warp in its loop): 24 MMAs, and
    the PDL wait before any load (the routing is the previous kernel's).
    GEMM2 (one tile a warp, the first route peeled): 2 x 16 MMAs, and the
    first route's words of rows g and g + 8 loaded before the wait (with
    the routing, two launches back)."""
    builds = compiled_in_own_process(MODULE)
    assert len(builds) == 16
    for name, mmas, (loads_before, words_before, words_after) in builds:
        if name == "_gated_mma_kernel":
            assert (mmas, loads_before) == (24, 0)
        else:
            assert (mmas, words_before) == (32, 2)
        assert words_after > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("topk", [1, 3, 8])
@pytest.mark.parametrize("tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_matches_reference(device, config, tokens, topk, activation, dtype):
    # hidden 384: 3 K steps of GEMM1 over 4 or 2 warps, and a partial
    # GEMM2 program at 256 columns; inter 256: 2 K steps of GEMM2 and 16 /
    # 32 gate-up columns a program; top-3 and top-1 leave GEMM2's route
    # slices idle in some turns.
    _cuda(device)
    out, ref, act, ids, _ = _run(
        tokens, 384, 256, 6, topk, dtype, device, activation, config=config
    )
    _close(out, ref, TOLERANCE[dtype])
    untouched = ~_local(ids, 6, None).flatten().to(device)
    assert bool(torch.isnan(act[untouched]).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("config", CONFIGS[:3], ids=str)
def test_w4a8_packing_matches_reference(device, config, tokens, dtype):
    """TritonExpertsW4A8's packing: nibbles in column order (the activations
    paired to match), gate and up rows interleaved, fp32 scales [E, N,
    groups]."""
    _cuda(device)
    expert_map = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32)
    out, ref, act, ids, emap = _run(
        tokens, 384, 256, 3, 3, dtype, device, "swiglu", expert_map, config,
        w4a8=True,
    )  # fmt: skip
    _close(out, ref, TOLERANCE[dtype])
    untouched = ~_local(ids, 3, emap).flatten().to(device)
    assert bool(torch.isnan(act[untouched]).all())


@pytest.mark.parametrize("group_size", [128, 256])
@pytest.mark.parametrize("topk", [1, 4])
def test_expert_map_skips_remote_experts(device, topk, group_size):
    _cuda(device)
    expert_map = torch.tensor([-1, 0, 2, -1, 1, -1], dtype=torch.int32)
    out, ref, act, ids, _ = _run(
        3, 512, 256, 3, topk, torch.float16, device, expert_map=expert_map,
        config=CONFIGS[2], group_size=group_size,
    )  # fmt: skip
    _close(out, ref, TOLERANCE[torch.float16])
    untouched = ~_local(ids, 3, expert_map).flatten().to(device)
    assert bool(torch.isnan(act[untouched]).all())


def test_bad_inputs_raise(device):
    hidden, inter, experts, topk = 256, 128, 4, 2
    x = torch.randn(1, hidden, device=device).half()
    ids = torch.zeros(1, topk, dtype=torch.int32, device=device)
    tw = torch.rand(1, topk, device=device)
    act = torch.empty(topk, inter, dtype=x.dtype, device=device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=device)
    marlin = _weights(experts, hidden, inter, x.dtype, device)
    w13, s13, w2, s2 = marlin

    def call(weights=marlin, x=x, config=CONFIGS[0]):
        w13, s13, w2, s2 = weights
        marlin_moe_decode(x, ids, tw, w13, s13, w2, s2, None, "silu", 128, act, out,
                          config)  # fmt: skip

    with pytest.raises(ValueError, match="config: gated_k_split must be a power"):
        call(config=MmaMoeDecodeConfig(1, 1, 3, 1, 1, 1))  # gated_k_split
    with pytest.raises(ValueError, match="config: down_route_split must be a power"):
        call(config=MmaMoeDecodeConfig(1, 1, 1, 1, 1, 3))
    with pytest.raises(ValueError, match="config: gated_tiles_per_warp must divide"):
        call(config=MmaMoeDecodeConfig(1, 2, 1, 1, 1, 1))
    wide = torch.zeros(1, hidden + 8, dtype=x.dtype, device=device)
    with pytest.raises(ValueError, match="x: expected 16-byte aligned rows"):
        call(x=wide[:, 1 : hidden + 1])
    rows = torch.empty(topk, inter + 4, dtype=x.dtype, device=device)[:, :inter]
    with pytest.raises(ValueError, match="act: expected 16-byte aligned rows"):
        marlin_moe_decode(x, ids, tw, w13, s13, w2, s2, None, "silu", 128, rows,
                          out, CONFIGS[0])  # fmt: skip
    if device.type == "cpu":
        with pytest.raises(ValueError, match="config: an MmaMoeDecodeConfig runs"):
            call()


def test_default_path_takes_unaligned_rows_elsewhere(device):
    """Without a config, tokens 2 bytes off 16-byte alignment, or an ``act``
    scratch with 8-byte rows, go to the CUDA-core kernels instead of raising
    (on a CPU only that path's result is checked)."""
    tokens, hidden, inter, experts, topk = 3, 256, 128, 4, 2
    dtype = torch.float16
    w13, s13, w2, s2 = _weights(experts, hidden, inter, dtype, device)
    x = torch.randn(tokens, hidden, device=device).to(dtype) / 4
    shifted = torch.zeros(tokens * hidden + 1, dtype=dtype, device=device)
    x_shifted = shifted[1:].view(tokens, hidden)
    x_shifted.copy_(x)
    ids = torch.tensor([[0, 3], [1, 1], [2, 0]], dtype=torch.int32, device=device)
    tw = torch.rand(tokens, topk, device=device)
    args = (ids, tw, w13, s13, w2, s2, None, "silu", 128)
    act = torch.full((tokens * topk, inter), POISON, dtype=dtype, device=device)
    ref = marlin_moe_decode_reference(x, *args, act, torch.empty_like(x))
    wide = torch.full((tokens * topk, inter + 4), POISON, dtype=dtype, device=device)
    for x_in, act_in in ((x_shifted, act), (x, wide[:, :inter])):
        out = torch.full((tokens, hidden), POISON, dtype=dtype, device=device)
        marlin_moe_decode(x_in, *args, act_in, out)
        _close(out, ref, TOLERANCE[dtype])


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("topk", [1, 3, 8])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_routed_matches_reference(device, config, topk, renormalize):
    """Routing from the logits in both kernels: GEMM1 routes each of its
    route's rounds in every warp, GEMM2 the token's routes once and hands
    each warp slice its own per turn."""
    _cuda(device)
    out, ref, act, _ = _run_routed(
        3, 384, 256, 12, topk, torch.bfloat16, device, renormalize, config=config
    )
    _close(out, ref, TOLERANCE[torch.bfloat16])
    assert not bool(torch.isnan(act).any())  # every route local: all written


@pytest.mark.parametrize("experts", [6, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routed_ties_nan_and_signed_zero(device, dtype, experts):
    """The Gluon routing against the reference's on equal logits (lower ids
    first), NaN (last), -0.0 (ties with 0.0), a row of NaN, and rows of few
    distinct values; 6 experts (fewer than a warp's lanes) and 64."""
    _cuda(device)
    gen = torch.Generator().manual_seed(11)
    w13, s13, w2, s2 = _weights(experts, 256, 128, dtype, device)
    nan = float("nan")
    logits = (torch.randint(-2, 3, (6, experts), generator=gen) / 2).to(dtype)
    logits[0, :6] = torch.tensor([0.0, -0.0, 1.0, 0.0, -1.0, -0.0])
    logits[1, :6] = torch.tensor([nan, -2.0, -2.0, float("-inf"), -2.0, -3.0])
    logits[2] = 3.0
    logits[3] = nan
    logits = logits.to(device)
    x = (torch.randn(6, 256, generator=gen) / 4).to(device, dtype)
    for renormalize in (True, False):
        act = torch.full((6 * 3, 128), POISON, dtype=dtype, device=device)
        args = (x, logits, 3, renormalize, w13, s13, w2, s2, None, "silu", 128)
        out = marlin_moe_decode_routed(*args, act, torch.empty_like(x), CONFIGS[2])
        ref = marlin_moe_decode_routed_reference(
            *args, act.clone(), torch.empty_like(x)
        )
        rows = [0, 1, 2, 4, 5]  # the NaN row's weights are NaN in both
        _close(out[rows], ref[rows], TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_gpu_model_sizes(tokens):
    """Qwen3-30B-A3B's expert shapes, bf16, the default config."""
    dev = torch.device("cuda")
    out, ref, act, ids, _ = _run(
        tokens, 2048, 768, 128, 8, torch.bfloat16, dev,
        config=default_mma_moe_decode_config(),
    )  # fmt: skip
    _close(out, ref, 2e-2)
    untouched = ~_local(ids, 128, None).flatten().to(dev)
    assert bool(torch.isnan(act[untouched]).all())
