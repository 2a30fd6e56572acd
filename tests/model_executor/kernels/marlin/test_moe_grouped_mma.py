"""The uint4 experts' grouped tensor-core kernels
(``marlin/moe_grouped_mma.py``): sorted by ``moe_prepare_scatter``, run,
unpermuted, against the decode kernels' plain-PyTorch reference.

Routing as in ``test_moe_decode.py`` (a repeated expert, the first and last
expert, invalid ids and, under ``expert_map``, remote experts), and batches
where an expert holds more routes than one pass of 8 A rows; ``act``
and ``down`` rows of routes without a local expert stay poisoned. Gluon
with inline PTX: the kernels run on NVIDIA GPUs only (CPU runs check their
build for sm_90 and the argument errors).
"""

import functools
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
from tests.model_executor.kernels.marlin.test_gemv_mma import resources
from tests.model_executor.kernels.marlin.test_moe_decode import (
    POISON,
    _close,
    _ids,
    _weights,
)
from vllm.model_executor.kernels.marlin.moe_decode_reference import (
    marlin_moe_decode_reference,
)
from vllm.model_executor.kernels.marlin.moe_grouped_mma import (
    GroupedMmaConfig,
    _grouped_down_kernel,
    _grouped_gated_kernel,
    default_grouped_mma_config,
    marlin_moe_grouped,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    MoEPermuteScratch,
    moe_prepare_scatter,
    moe_unpermute,
)

MODULE = "tests.model_executor.kernels.marlin.test_moe_grouped_mma"
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
CONFIGS = [
    default_grouped_mma_config(),
    GroupedMmaConfig(1, 1, 1, 1, 1, 1),
    # GEMM2's programs of 256 columns: the second one partial at hidden 384.
    GroupedMmaConfig(2, 1, 4, 16, 8, 1),
]


Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _packed(*args: Any) -> Weights:
    """``_weights(*args)``: w13, its scales, w2, its scales."""
    w13, s13, w2, s2 = _weights(*args)
    return w13, s13, w2, s2


def _cuda(device):
    if device.type != "cuda":
        pytest.skip("Gluon with inline PTX: NVIDIA GPUs only")


def _grouped(x, ids, tw, weights: Weights, expert_map, activation, group_size,
             config):  # fmt: skip
    """The layer's pipeline: sort, both kernels into poisoned ``act`` and
    ``down``, unpermute into a poisoned output."""
    (tokens, hidden), topk = x.shape, ids.shape[1]
    rows, inter = tokens * topk, weights[0].shape[1] // 2
    scratch = MoEPermuteScratch(
        len(weights[0]) if expert_map is None else len(expert_map),
        len(weights[0]),
        x.device,
    )
    offsets, inv = moe_prepare_scatter(ids, expert_map, scratch)
    act = torch.full((rows, inter), POISON, dtype=x.dtype, device=x.device)
    down = torch.full((rows, hidden), POISON, dtype=x.dtype, device=x.device)
    marlin_moe_grouped(
        x, scratch.permuted_idx[:rows], offsets, topk, *weights, activation,
        group_size, act, down, config,
    )  # fmt: skip
    out = torch.full_like(x, POISON)
    moe_unpermute(out, down, tw, inv, offsets)
    return out, act, down, int(offsets[-1])


def _run(tokens, hidden, inter, experts, topk, dtype, device, activation="silu",
         expert_map=None, config=None, seed=0, group_size=128,
         w4a8=False):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    weights = _packed(experts, hidden, inter, dtype, device, seed, group_size, w4a8)
    num_ids = experts if expert_map is None else len(expert_map)
    ids = _ids(tokens, topk, num_ids, gen).to(device)
    x = (torch.randn(tokens, hidden, generator=gen) / 4).to(dtype).to(device)
    tw = torch.rand(tokens, topk, generator=gen).to(device)
    emap = None if expert_map is None else expert_map.to(device)
    out, act, down, local_rows = _grouped(
        x, ids, tw, weights, emap, activation, group_size, config
    )
    ref = torch.empty_like(out)
    marlin_moe_decode_reference(x, ids, tw, *weights, emap, activation, group_size,
                                act.clone(), ref)  # fmt: skip
    _close(out, ref, TOLERANCE[dtype])
    # Rows of routes without a local expert are never written; the others are.
    for t in (act, down):
        assert not bool(torch.isnan(t[:local_rows]).any())
        assert bool(torch.isnan(t[local_rows:]).all())


def compile_kernels() -> None:
    """Both kernels at the default config, bf16 and fp16, both packings (run
    in a process of its own by the test below): MMAs in the PTX, spills,
    and the loads before the PDL wait in the SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = default_grouped_mma_config()
    for dtype, w4a8 in itertools.product(("bf16", "fp16"), (False, True)):
        fp16 = dtype == "fp16"
        ptr, scale = f"*{dtype}", "*fp32" if w4a8 else f"*{dtype}"
        common: dict[str, object] = dict(
            NIBBLES_IN_ORDER=w4a8, GROUP_SIZE=128, FP16=fp16, PDL=True,
        )  # fmt: skip
        gated = common | dict(
            GATE_UP_INTERLEAVED=w4a8, MODE=1, ALPHA=1.702, LIMIT=7.0,
            ROW_TILES=cfg.gated_row_tiles, TILES_PER_WARP=cfg.gated_tiles_per_warp,
            K_SPLIT=cfg.gated_k_split,
        )  # fmt: skip
        down = common | dict(
            ROW_TILES=cfg.down_row_tiles, TILES_PER_WARP=cfg.down_tiles_per_warp,
            K_SPLIT=cfg.down_k_split,
        )  # fmt: skip
        types = {"perm_ptr": "*i32", "offsets_ptr": "*i64", "w_ptr": "*i32",
                 "s_ptr": scale}  # fmt: skip
        builds: list[tuple[Any, dict[str, object], int]] = [
            (_grouped_gated_kernel, gated,
             cfg.gated_row_tiles // cfg.gated_tiles_per_warp * cfg.gated_k_split),
            (_grouped_down_kernel, down,
             cfg.down_row_tiles // cfg.down_tiles_per_warp * cfg.down_k_split),
        ]  # fmt: skip
        for kernel, consts, warps in builds:
            args = [p.name for p in kernel.params if not p.is_constexpr]
            signature = {
                name: types.get(name, ptr) if name.endswith("_ptr") else "i32"
                for name in args
            }
            signature |= dict.fromkeys(consts, "constexpr")
            # As a launch specializes them (sizes of 128s, 16-byte rows; the
            # scales' strides may be 1).
            unaligned = ("topk", "stride_sn", "stride_sg")
            aligned = {
                (i,): [["tt.divisibility", 16]]
                for i, name in enumerate(args)
                if name not in unaligned
            }
            source = GluonASTSource(kernel, signature, constexprs=consts, attrs=aligned)
            compiled = triton.compile(
                source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
            )
            ab = "f16" if fp16 else "bf16"
            mmas = compiled.asm["ptx"].count(f"m16n8k16.row.col.f32.{ab}.{ab}")
            before = sass(compiled.asm["cubin"]).partition("ACQBULK")[0]
            usage = resources(compiled.asm["cubin"])
            spills = usage.get("LOCAL", 0) + usage.get("STACK", 0)
            print(
                COMPILED,
                json.dumps([kernel.__name__, mmas, before.count("LDG"), spills]),
            )


def test_compiles_for_sm90_without_a_gpu():
    """A K step per warp of GEMM1 (2 row tiles) is 8 offset MMAs and 16 for
    the tiles; GEMM2 (one tile a warp) 8 + 8. GEMM1 loads nothing before
    the PDL wait (the sort is the previous kernel's); GEMM2 loads its
    expert's offsets and first words before it. No build spills."""
    builds = compiled_in_own_process(MODULE)
    assert len(builds) == 8
    for name, mmas, loads_before, spills in builds:
        if name == "_grouped_gated_kernel":
            assert (mmas, loads_before) == (24, 0)
        else:
            assert (mmas, loads_before) == (16, 4)
        assert spills == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("tokens, topk", [(1, 3), (7, 1), (16, 4), (33, 5)])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_matches_reference(device, config, tokens, topk, activation, dtype):
    # 6 experts: at 33 tokens x top-5 an expert holds ~27 routes (passes
    # of 8 A rows with a partial last); hidden 384: 3 K steps of GEMM1
    # and a partial GEMM2 program at 256 columns; inter 256: 2 K steps of
    # GEMM2 and 16 / 32 gate-up columns a program.
    _cuda(device)
    _run(tokens, 384, 256, 6, topk, dtype, device, activation, config=config)


@pytest.mark.parametrize("w4a8", [False, True])
def test_partial_column_tiles(device, w4a8):
    """Intermediate 384 over GEMM1's programs of 256 gate/up columns: the
    second program's columns past I are computed from repeated rows and
    not stored."""
    _cuda(device)
    _run(11, 256, 384, 4, 4, torch.bfloat16, device,
         config=GroupedMmaConfig(32, 2, 1, 1, 1, 1), w4a8=w4a8)  # fmt: skip


@pytest.mark.parametrize("tokens", [3, 20])
@pytest.mark.parametrize("config", CONFIGS[:3], ids=str)
def test_w4a8_packing_matches_reference(device, config, tokens):
    """TritonExpertsW4A8's packing (nibbles in column order, gate and up rows
    interleaved, fp32 scales [E, N, groups]), remote experts under a map."""
    _cuda(device)
    expert_map = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32)
    _run(tokens, 384, 256, 3, 3, torch.bfloat16, device, "swiglu", expert_map,
         config, w4a8=True)  # fmt: skip


@pytest.mark.parametrize("group_size", [128, 256])
def test_expert_map_and_group_sizes(device, group_size):
    _cuda(device)
    expert_map = torch.tensor([-1, 0, 2, -1, 1, -1], dtype=torch.int32)
    _run(9, 512, 256, 3, 4, torch.float16, device, expert_map=expert_map,
         config=CONFIGS[0], group_size=group_size)  # fmt: skip


def test_bad_inputs_raise(device):
    hidden, inter, experts, topk, tokens = 256, 128, 4, 2, 3
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    weights = _packed(experts, hidden, inter, torch.bfloat16, device)
    perm = torch.zeros(tokens * topk, dtype=torch.int32, device=device)
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=device)
    act = torch.empty(tokens * topk, inter, dtype=torch.bfloat16, device=device)
    down = torch.empty(tokens * topk, hidden, dtype=torch.bfloat16, device=device)
    call = functools.partial(marlin_moe_grouped, x, perm, offsets, topk, *weights)
    with pytest.raises(ValueError, match=r"offsets: expected contiguous torch\.int64"):
        marlin_moe_grouped(x, perm, offsets.int(), topk, *weights, "silu", 128, act,
                           down)  # fmt: skip
    with pytest.raises(ValueError, match="permuted_idx: expected contiguous"):
        marlin_moe_grouped(x, perm.long(), offsets, topk, *weights, "silu", 128, act,
                           down)  # fmt: skip
    with pytest.raises(ValueError, match=r"down: expected a \[>= 6, 256\]"):
        call("silu", 128, act, down[:, :128])
    with pytest.raises(ValueError, match=r"act: expected a \[>= 6, 128\] tensor"):
        call("silu", 128, act.half(), down)
    with pytest.raises(ValueError, match="activation: expected one of"):
        call("gelu", 128, act, down)
    with pytest.raises(ValueError, match="group_size: expected"):
        call("silu", 64, act, down)
    with pytest.raises(ValueError, match="topk: expected >= 1, got 0"):
        marlin_moe_grouped(x, perm, offsets, 0, *weights, "silu", 128, act, down)
    with pytest.raises(ValueError, match=r"permuted_idx: expected contiguous .*\[9\]"):
        marlin_moe_grouped(x, perm, offsets, 3, *weights, "silu", 128, act, down)
    with pytest.raises(ValueError, match="config: gated_row_tiles must be a power"):
        call("silu", 128, act, down, GroupedMmaConfig(3, 1, 1, 1, 1, 1))
    if device.type != "cuda":
        with pytest.raises(ValueError, match="config: expected a GroupedMmaConfig"):
            call("silu", 128, act, down)
    else:  # no tokens: nothing to launch, nothing written
        down.fill_(POISON)
        marlin_moe_grouped(x[:0], perm[:0], offsets, topk, *weights, "silu", 128,
                           act, down)  # fmt: skip
        assert bool(torch.isnan(down).all())


@pytest.mark.gpu
@pytest.mark.parametrize("w4a8", [False, True])
@pytest.mark.parametrize("tokens", [8, 16, 33, 64])
def test_gpu_model_sizes(tokens, w4a8):
    """Qwen3-30B-A3B's expert shapes, bf16, the default configs."""
    _run(tokens, 2048, 768, 128, 8, torch.bfloat16, torch.device("cuda"),
         w4a8=w4a8)  # fmt: skip


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_routing():
    dev = torch.device("cuda")
    tokens, hidden, inter, experts, topk = 16, 2048, 768, 128, 8
    weights = _packed(experts, hidden, inter, torch.bfloat16, dev, 3)
    x = torch.randn(tokens, hidden, device=dev).bfloat16()
    ids = torch.zeros(tokens, topk, dtype=torch.int32, device=dev)
    tw = torch.rand(tokens, topk, device=dev)
    scratch = MoEPermuteScratch(experts, experts, dev)
    rows = tokens * topk
    act = torch.empty(rows, inter, dtype=torch.bfloat16, device=dev)
    down = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(x)

    def call() -> None:
        offsets, inv = moe_prepare_scatter(ids, None, scratch)
        marlin_moe_grouped(x, scratch.permuted_idx[:rows], offsets, topk, *weights,
                           "silu", 128, act, down)  # fmt: skip
        moe_unpermute(out, down, tw, inv, offsets)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()  # compile outside capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    for seed in range(2):
        ids.copy_(_ids(tokens, topk, experts, torch.Generator().manual_seed(seed)))
        out.fill_(POISON)
        graph.replay()
        ref = torch.empty_like(out)
        marlin_moe_decode_reference(x, ids, tw, *weights, None, "silu", 128,
                                    act.clone(), ref)  # fmt: skip
        _close(out, ref, 2e-2)
