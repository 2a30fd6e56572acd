"""The uint4 experts' decode kernels (``marlin/moe_decode.py``) against the
plain-PyTorch reference, on MarlinExperts' packing and on TritonExpertsW4A8's.

Routing repeats an expert within a token, routes to the first and the last
expert, and carries invalid ids (negative, past E) and, under
``expert_map``, remote experts; ``act`` rows of routes without a local
expert must stay untouched (poisoned). CPU runs use fp16 (the interpreter's
bf16 rounds by truncation) at tiny sizes; ``gpu`` tests use model sizes.
The kernels routing from the router's logits themselves: the same.
"""

import functools
import json

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    COMPILED,
    asm_for_sm90,
    compiled_in_own_process,
)
from tests.model_executor.kernels.marlin.test_gemv_mma import resources
from vllm.model_executor.kernels.common.topk_softmax import top_routes_reference
from vllm.model_executor.kernels.grouped_gemm.layout import interleave_gate_up
from vllm.model_executor.kernels.grouped_gemm.w4a8 import quantize_w4
from vllm.model_executor.kernels.marlin import quantize_weights, repack_weights
from vllm.model_executor.kernels.marlin.config import (
    MarlinDecodeConfig,
    decode_fits_topk,
    default_marlin_decode_config,
)
from vllm.model_executor.kernels.marlin.moe_decode import (
    _down_sum_kernel,
    _gated_kernel,
    marlin_moe_decode,
    marlin_moe_decode_routed,
)
from vllm.model_executor.kernels.marlin.moe_decode_mma import (
    MmaMoeDecodeConfig,
    default_mma_moe_decode_config,
)
from vllm.model_executor.kernels.marlin.moe_decode_reference import (
    marlin_moe_decode_reference,
    marlin_moe_decode_routed_reference,
)

MODULE = "tests.model_executor.kernels.marlin.test_moe_decode"
POISON = float("nan")


def _pack(w: torch.Tensor, dtype: torch.dtype, group_size: int = 128):
    packed, scales = [], []
    for e in range(w.shape[0]):
        q, s = quantize_weights(w[e], group_size)
        packed.append(repack_weights(q))
        scales.append(s.to(dtype))
    return torch.stack(packed), torch.stack(scales)


def _ids(tokens: int, topk: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Random routes plus, where room, a repeated expert, experts 0 and E-1,
    and invalid ids -1 and E."""
    ids = torch.randint(0, experts, (tokens, topk), generator=gen)
    special = [0, experts - 1, -1, experts]
    for t in range(tokens):
        ids[t, t % topk] = special[t % len(special)]
        if topk > 1:
            ids[t, (t + 1) % topk] = ids[t, (t + 2) % topk]  # a repeat
    return ids.to(torch.int32)


def _weights(experts, hidden, inter, dtype, device, seed=0, group_size=128,
             w4a8=False):  # fmt: skip
    """Packed w13, its scales, w2, its scales: drawn and packed on ``device``
    as MarlinExperts holds them, or (``w4a8``) as TritonExpertsW4A8 does."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device)
    w2 = torch.randn(experts, hidden, inter, generator=gen, device=device) / 8
    if w4a8:
        return (*quantize_w4(interleave_gate_up(w13)), *quantize_w4(w2))
    return (*_pack(w13, dtype, group_size), *_pack(w2, dtype, group_size))


def _run(tokens, hidden, inter, experts, topk, dtype, device, activation="silu",
         expert_map=None, config=None, seed=0, group_size=128,
         w4a8=False):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    w13, s13, w2, s2 = _weights(experts, hidden, inter, dtype, device, seed,
                                group_size, w4a8)  # fmt: skip
    num_ids = experts if expert_map is None else len(expert_map)
    ids = _ids(tokens, topk, num_ids, gen)
    x = (torch.randn(tokens, hidden, generator=gen) / 4).to(dtype)
    tw = torch.rand(tokens, topk, generator=gen)
    x, ids, tw, w13, s13, w2, s2 = (
        t.to(device) for t in (x, ids, tw, w13, s13, w2, s2)
    )
    weights = (w13, s13, w2, s2)
    emap = None if expert_map is None else expert_map.to(device)
    act = torch.full((tokens * topk, inter), POISON, dtype=dtype, device=device)
    out = torch.full((tokens, hidden), POISON, dtype=dtype, device=device)
    ref = torch.full_like(out, POISON)
    marlin_moe_decode(
        x, ids, tw, *weights, emap, activation, group_size, act, out, config
    )
    marlin_moe_decode_reference(x, ids, tw, *weights, emap, activation, group_size,
                                act.clone(), ref)  # fmt: skip
    return out, ref, act, ids, emap


def _local(ids: torch.Tensor, experts: int, expert_map) -> torch.Tensor:
    """Whether each route has a local expert."""
    ids = ids.long().cpu()
    num_ids = experts if expert_map is None else len(expert_map)
    valid = (ids >= 0) & (ids < num_ids)
    if expert_map is not None:
        mapped = expert_map.cpu().long()[ids.clamp(0, num_ids - 1)]
        valid &= mapped >= 0
    return valid


def _close(out, ref, tolerance):
    assert not torch.isnan(out).any()
    scale = ref.float().abs().max().clamp_min(1e-6)
    assert float((out.float() - ref.float()).abs().max() / scale) < tolerance


CPU_CONFIG = MarlinDecodeConfig(8, 256, 1, 4, 256, 1)


@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize(
    "config", [CPU_CONFIG, MarlinDecodeConfig(256, 256, 1, 32, 512, 2)], ids=str
)
def test_matches_reference(device, config, tokens, activation):
    # hidden 384: GEMM1's K steps end in a masked tail; the wide config's
    # tiles are partial (GEMM1: 256 pairs of 256; GEMM2: 32 columns of 384
    # hidden, 4 x 32 rows for top-3, and one masked K step of 512 over 256);
    # inter 256: two scale groups along GEMM2's K
    out, ref, act, ids, _ = _run(
        tokens, 384, 256, 5, 3, torch.float16, device, activation, config=config
    )
    _close(out, ref, 2e-3)
    untouched = ~_local(ids, 5, None).flatten()
    assert bool(torch.isnan(act[untouched.to(act.device)]).all())


@pytest.mark.parametrize("topk", [1, 4])
def test_expert_map_skips_remote_experts(device, topk):
    expert_map = torch.tensor([-1, 0, 2, -1, 1, -1], dtype=torch.int32)
    out, ref, act, ids, _ = _run(
        3, 256, 128, 3, topk, torch.float16, device, expert_map=expert_map,
        config=CPU_CONFIG,
    )  # fmt: skip
    _close(out, ref, 2e-3)
    local = _local(ids, 3, expert_map).flatten().to(act.device)
    assert bool(torch.isnan(act[~local]).all())
    assert not bool(torch.isnan(act[local]).any())


def test_group_not_a_power_of_two(device):
    """Group 384 against K steps of 256: a step's scale lanes straddle
    groups (the general lane formula, not the hoisted one)."""
    out, ref, *_ = _run(
        2, 768, 384, 3, 2, torch.float16, device, config=CPU_CONFIG, group_size=384
    )
    _close(out, ref, 2e-3)


@pytest.mark.parametrize(
    "hidden, config",
    [
        (384, MarlinDecodeConfig(8, 256, 1, 4, 512, 2)),  # masked K steps
        (512, MarlinDecodeConfig(8, 256, 1, 4, 256, 1)),  # EVEN_K in both
    ],
    ids=["masked", "even"],
)
@pytest.mark.parametrize("tokens", [1, 3])
def test_w4a8_packing_matches_reference(device, tokens, hidden, config):
    """TritonExpertsW4A8's weights (nibbles in column order, gate and up rows
    interleaved, fp32 scales [E, N, K / 128]) on the same kernels: partial
    tiles, K steps masked or not, remote experts under a map."""
    expert_map = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32)
    out, ref, act, ids, emap = _run(
        tokens, hidden, 256, 3, 3, torch.float16, device, "swiglu", expert_map,
        config, w4a8=True,
    )  # fmt: skip
    _close(out, ref, 2e-3)
    untouched = ~_local(ids, 3, emap).flatten().to(act.device)
    assert bool(torch.isnan(act[untouched]).all())


def _needs_cuda_for(config, device):
    if isinstance(config, MmaMoeDecodeConfig) and device.type != "cuda":
        pytest.skip("the tensor-core kernels run on NVIDIA GPUs only")


BOTH_KERNELS = [CPU_CONFIG, default_mma_moe_decode_config()]


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("config", BOTH_KERNELS, ids=str)
def test_strided_inputs_and_scratch(device, config, ids_dtype):
    """x, topk_ids, topk_weights, act and out as row slices of wider
    buffers: each is read and written through its own row stride."""
    _needs_cuda_for(config, device)
    tokens, hidden, inter, experts, topk = 3, 256, 256, 4, 2
    w13, s13, w2, s2 = _weights(experts, hidden, inter, torch.float16, device)
    gen = torch.Generator().manual_seed(4)
    wide = functools.partial(torch.zeros, device=device)
    x = wide(tokens, hidden + 64, dtype=torch.float16)
    x[:, :hidden] = torch.randn(tokens, hidden, generator=gen).half().to(device)
    ids = wide(tokens, topk + 3, dtype=ids_dtype)
    ids[:, :topk] = _ids(tokens, topk, experts, gen).to(device)
    tw = wide(tokens, topk + 1)
    tw[:, :topk] = torch.rand(tokens, topk, generator=gen).to(device)
    act = wide(tokens * topk, inter + 32, dtype=torch.float16)
    out = torch.full((tokens, hidden + 16), POISON, dtype=torch.float16, device=device)
    ref = torch.empty(tokens, hidden, dtype=torch.float16, device=device)
    args = (x[:, :hidden], ids[:, :topk], tw[:, :topk], w13, s13, w2, s2, None,
            "silu", 128)  # fmt: skip
    marlin_moe_decode(*args, act[:, :inter], out[:, :hidden], config)
    marlin_moe_decode_reference(
        x[:, :hidden].contiguous(), ids[:, :topk].contiguous(),
        tw[:, :topk].contiguous(), *args[3:], act[:, :inter], ref,
    )  # fmt: skip
    _close(out[:, :hidden], ref, 2e-3)
    assert bool((act[:, inter:] == 0).all()) and bool(out[:, hidden:].isnan().all())


@pytest.mark.parametrize("config", BOTH_KERNELS, ids=str)
def test_token_without_local_routes_gets_zeros(device, config):
    _needs_cuda_for(config, device)
    gen = torch.Generator().manual_seed(1)
    w13, s13 = _pack(torch.randn(2, 256, 128, generator=gen), torch.float16)
    w2, s2 = _pack(torch.randn(2, 128, 128, generator=gen), torch.float16)
    x = torch.randn(1, 128).half()
    ids = torch.tensor([[-1, 2]], dtype=torch.int32)  # nothing valid
    x, ids, tw, w13, s13, w2, s2 = (
        t.to(device) for t in (x, ids, torch.rand(1, 2), w13, s13, w2, s2)
    )
    out = torch.full((1, 128), POISON, dtype=torch.float16, device=device)
    act = torch.full((2, 128), POISON, dtype=torch.float16, device=device)
    marlin_moe_decode(x, ids, tw, w13, s13, w2, s2, None, "silu", 128, act, out, config)
    assert bool((out == 0).all())


def test_bad_inputs_raise(device):
    gen = torch.Generator().manual_seed(2)
    w13, s13 = _pack(torch.randn(2, 256, 128, generator=gen), torch.float16)
    w2, s2 = _pack(torch.randn(2, 128, 128, generator=gen), torch.float16)
    x, ids, tw = (
        torch.randn(1, 128).half(),
        torch.zeros(1, 2, dtype=torch.int32),
        (torch.rand(1, 2)),
    )
    x, ids, tw, w13, s13, w2, s2 = (
        t.to(device) for t in (x, ids, tw, w13, s13, w2, s2)
    )
    act = torch.empty(2, 128, dtype=torch.float16, device=device)
    out = torch.empty(1, 128, dtype=torch.float16, device=device)
    call = functools.partial(marlin_moe_decode, x, ids, tw)
    rest = (None, "silu", 128, act, out, CPU_CONFIG)
    with pytest.raises(ValueError, match="w13_scales"):
        call(w13, s13.float(), w2, s2, *rest)
    with pytest.raises(ValueError, match=r"^w2:"):
        call(w13, s13, w2[:, :64], s2, *rest)
    with pytest.raises(ValueError, match="group_size"):
        call(w13, s13, w2, s2, None, "silu", 96, act, out)
    with pytest.raises(ValueError, match="activation"):
        call(w13, s13, w2, s2, None, "gelu", 128, act, out)
    with pytest.raises(ValueError, match=r"^act:"):
        call(w13, s13, w2, s2, None, "silu", 128, act[:1], out)
    with pytest.raises(ValueError, match="group_size"):
        call(w13, s13, w2, s2, None, "silu", 0, act, out)
    # Nothing to read: the kernels would read expert 0's rows out of bounds.
    with pytest.raises(ValueError, match=r"^w13: .*one expert"):
        call(w13[:0], s13[:0], w2[:0], s2[:0], *rest)
    with pytest.raises(ValueError, match=r"^w13: .*gate/up pair"):
        call(w13[:, :0], s13[:, :, :0], w2[:, :, :0], s2[:, :0], *rest)
    with pytest.raises(ValueError, match=r"^x: .*H > 0"):
        marlin_moe_decode(x[:, :0], ids, tw, w13[:, :, :0], s13[:, :0], w2[:, :0],
                          s2[:, :, :0], *rest)  # fmt: skip
    with pytest.raises(ValueError, match=r"^topk_ids: .*topk > 0"):
        marlin_moe_decode(x, ids[:, :0], tw[:, :0], w13, s13, w2, s2, *rest)
    # W4A8's packing: group 128 only, fp32 scales [E, N, groups], whole words.
    q13, q13s, q2, q2s = _weights(2, 128, 128, None, device, w4a8=True)
    with pytest.raises(ValueError, match=r"^group_size: expected 128 for W4A8"):
        call(q13, q13s, q2, q2s, None, "silu", 256, act, out)
    with pytest.raises(ValueError, match=r"^w13_scales: .*torch.float32 \[2, 256, 1\]"):
        call(q13, q13s.half(), q2, q2s, *rest)
    with pytest.raises(ValueError, match=r"^w2_scales: .*torch.float32 \[2, 128, 1\]"):
        call(q13, q13s, q2, q2s.transpose(1, 2), *rest)  # Marlin's layout
    shifted = torch.empty(q13.numel() + 2, dtype=torch.uint8, device=device)
    shifted = shifted[2:].view(q13.shape).copy_(q13)
    with pytest.raises(ValueError, match=r"^w13: .*4-byte boundary, got offset 2"):
        call(shifted, q13s, q2, q2s, *rest)
    for bad in (
        (4, 256, 2, 8, 256, 1),  # 32 lanes x 2 warps need 512 columns
        (0, 256, 1, 8, 256, 1),
        (4, 256, 1, 8, 256, 3),
        (4, 256, 1, 3, 256, 1),  # 2 x 3 rows: not a power of two
        (4, 256, 1, 128, 256, 1),  # 2 x 128 rows: past MAX_DOWN_ROWS
    ):
        with pytest.raises(ValueError, match="config"):
            call(w13, s13, w2, s2, None, "silu", 128, act, out,
                 MarlinDecodeConfig(*bad))  # fmt: skip


def test_decode_fits_topk_up_to_64():
    """The default GEMM2 program's rows (MAX_DOWN_ROWS) hold top-64 at most:
    the experts take their sorted path beyond it."""
    assert decode_fits_topk(1) and decode_fits_topk(8) and decode_fits_topk(64)
    assert not decode_fits_topk(65)


def compile_kernels() -> None:
    """GEMM1 and GEMM2 in the shipped tiles (bf16, group scales, inline
    PTX) built for sm_90 (run in a process of its own by the test below):
    their resources."""
    cfg = default_marlin_decode_config()
    common = dict(HAS_MAP=False, NIBBLES_IN_ORDER=False, GROUP_SIZE=128, ASM=True,
                  PDL=True, ROUTED=False, BLOCK_E=128, EVEN_K=True)  # fmt: skip
    gated = common | dict(
        GATE_UP_INTERLEAVED=False, MODE=0, ALPHA=1.702, LIMIT=7.0,
        BLOCK_N=cfg.gated_block_n, BLOCK_K=cfg.gated_block_k, BLOCK_R=8,
    )  # fmt: skip
    down = common | dict(TOPK=8, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
                         RENORMALIZE=False)  # fmt: skip
    pointers = {"ids_ptr": "*i32", "map_ptr": "*i32", "w_ptr": "*i32",
                "weights_ptr": "*fp32", "topk_weights_ptr": "*fp32"}  # fmt: skip
    for kernel, consts, warps in (
        (_gated_kernel, gated, cfg.gated_warps),
        (_down_sum_kernel, down, cfg.down_warps),
    ):
        cubin = asm_for_sm90(
            kernel, consts, pointers,
            ("K", "inter", "hidden", "stride_x", "stride_act", "stride_we",
             "stride_se"),
            warps,
        )["cubin"]  # fmt: skip
        usage = resources(cubin)
        print(COMPILED, json.dumps([usage[name] for name in ("REG", "LOCAL", "STACK")]))


def test_compiles_for_sm90_without_a_gpu():
    """Both GEMMs build for sm_90 with their inline PTX (which the
    interpreter never runs)."""
    builds = compiled_in_own_process(MODULE)
    assert len(builds) == 2
    for registers, _, _ in builds:
        assert 0 < registers <= 255
    # GEMM2 takes 241 registers without spilling on Triton 3.6 (the GPU
    # machine's); Triton 3.9 spills 32 bytes of stack at 255, so spills
    # are not asserted here.


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 7, 8])
def test_gpu_model_sizes(tokens):
    """Qwen3-30B-A3B's expert shapes, bf16, the shipped config."""
    dev = torch.device("cuda")
    out, ref, act, ids, _ = _run(tokens, 2048, 768, 128, 8, torch.bfloat16, dev)
    _close(out, ref, 2e-2)
    untouched = ~_local(ids, 128, None).flatten().to(dev)
    assert bool(torch.isnan(act[untouched]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, default_mma_moe_decode_config()], ids=str)
def test_gpu_cuda_graph_replay_with_new_routing(config):
    dev = torch.device("cuda")
    tokens, hidden, inter, experts, topk = 2, 2048, 768, 128, 8
    w13, s13, w2, s2 = _weights(experts, hidden, inter, torch.bfloat16, dev, seed=3)
    x = torch.randn(tokens, hidden, device=dev).bfloat16()
    ids = torch.zeros(tokens, topk, dtype=torch.int32, device=dev)
    tw = torch.rand(tokens, topk, device=dev)
    act = torch.empty(tokens * topk, inter, dtype=torch.bfloat16, device=dev)
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
    call = functools.partial(marlin_moe_decode, x, ids, tw, w13, s13, w2, s2, None,
                             "silu", 128, act, out, config)  # fmt: skip
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
        marlin_moe_decode_reference(x, ids, tw, w13, s13, w2, s2, None, "silu", 128,
                                    act, ref)  # fmt: skip
        _close(out, ref, 2e-2)


def _distinct_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """16-bit logits without ties (multiples of 1/8): one correct routing."""
    rows = [torch.randperm(experts, generator=gen) for _ in range(tokens)]
    return ((torch.stack(rows) - experts / 2) / 8).half()


def _run_routed(tokens, hidden, inter, experts, topk, dtype, device, renormalize,
                expert_map=None, config=None, w4a8=False):  # fmt: skip
    gen = torch.Generator().manual_seed(tokens + topk)
    w13, s13, w2, s2 = _weights(experts, hidden, inter, dtype, device, w4a8=w4a8)
    num_ids = experts if expert_map is None else len(expert_map)
    logits = _distinct_logits(tokens, num_ids, gen).to(device, dtype)
    x = (torch.randn(tokens, hidden, generator=gen) / 4).to(device, dtype)
    emap = None if expert_map is None else expert_map.to(device)
    act = torch.full((tokens * topk, inter), POISON, dtype=dtype, device=device)
    out = torch.full((tokens, hidden), POISON, dtype=dtype, device=device)
    args = (x, logits, topk, renormalize, w13, s13, w2, s2, emap, "silu", 128)
    marlin_moe_decode_routed(*args, act, out, config)
    ref = marlin_moe_decode_routed_reference(*args, act.clone(), torch.empty_like(out))
    return out, ref, act, logits


@pytest.mark.parametrize("config", BOTH_KERNELS, ids=str)
@pytest.mark.parametrize("w4a8", [False, True], ids=["marlin", "w4a8"])
@pytest.mark.parametrize("mapped", [False, True])
def test_routed_matches_reference(device, w4a8, mapped, config):
    """Routing from the logits in both kernels: the reference's routing
    (softmax top-k, renormalized or not), local experts only under a map
    (their act rows written, the others' left poisoned)."""
    _needs_cuda_for(config, device)
    expert_map = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32) if mapped else None
    for renormalize in (True, False):
        out, ref, act, logits = _run_routed(
            2, 256, 128, 3, 3, torch.float16, device, renormalize, expert_map,
            config, w4a8,
        )  # fmt: skip
        _close(out, ref, 2e-3)
        _, ids = top_routes_reference(logits, 3, renormalize)
        local = _local(ids, 3, expert_map).flatten().to(act.device)
        assert bool(torch.isnan(act[~local]).all())
        assert not bool(torch.isnan(act[local]).any())


def test_routed_bad_inputs_are_named(device):
    w13, s13, w2, s2 = _weights(2, 128, 128, torch.float16, device)
    x = torch.randn(1, 128, device=device).half()
    logits = torch.randn(1, 2, device=device).half()
    act = torch.empty(2, 128, dtype=torch.float16, device=device)
    out = torch.empty(1, 128, dtype=torch.float16, device=device)
    weights = (w13, s13, w2, s2)
    too_many = torch.zeros(1025, dtype=torch.int32, device=device)
    for name, bad_logits, topk, emap in (
        ("logits", logits.float(), 2, None),  # 16-bit only: the packed keys
        ("logits", logits[:, :1], 2, None),
        ("topk", logits, 3, None),
        ("act", logits, 2, None),  # 1 row for 2 routes
        ("expert_map", logits, 2, too_many),
    ):
        with pytest.raises(ValueError, match=f"^{name}: "):
            marlin_moe_decode_routed(x, bad_logits, topk, True, *weights, emap,
                                     "silu", 128, act[:1], out, CPU_CONFIG)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, default_mma_moe_decode_config()], ids=str)
def test_gpu_routed_graph_replay_with_new_logits(config):
    """Model sizes, bf16, new logits each replay."""
    dev = torch.device("cuda")
    tokens, hidden, inter, experts, topk = 2, 2048, 768, 128, 8
    w13, s13, w2, s2 = _weights(experts, hidden, inter, torch.bfloat16, dev, seed=4)
    x = torch.randn(tokens, hidden, device=dev).bfloat16()
    logits = torch.zeros(tokens, experts, dtype=torch.bfloat16, device=dev)
    act = torch.empty(tokens * topk, inter, dtype=torch.bfloat16, device=dev)
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
    args = (x, logits, topk, True, w13, s13, w2, s2, None, "silu", 128, act)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        marlin_moe_decode_routed(*args, out, config)  # compile outside capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        marlin_moe_decode_routed(*args, out, config)
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        logits.copy_(_distinct_logits(tokens, experts, gen))
        out.fill_(POISON)
        graph.replay()
        ref = marlin_moe_decode_routed_reference(*args, torch.empty_like(out))
        _close(out, ref, 2e-2)
