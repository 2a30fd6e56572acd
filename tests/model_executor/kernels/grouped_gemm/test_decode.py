"""The route-by-route decode kernels against their plain-PyTorch reference:
poisoned outputs, repeated / first / last / invalid / non-local experts,
fp8 weights with channel scales (CUDA), graph replay with new routing.
uint4 weights refused by name (``marlin/moe_decode.py`` decodes them).
The kernels routing from logits themselves: the same, plus ties and NaN."""

import json

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    COMPILED,
    asm_for_sm90,
    compiled_in_own_process,
)
from tests.model_executor.kernels.marlin.test_gemv_mma import resources
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE, per_channel_quant_fp8
from vllm.model_executor.kernels.common.topk_softmax import top_routes_reference
from vllm.model_executor.kernels.grouped_gemm import (
    DecodeConfig,
    interleave_gate_up,
    moe_decode,
    moe_decode_reference,
    moe_decode_routed,
    moe_decode_routed_reference,
)
from vllm.model_executor.kernels.grouped_gemm.decode import (
    _decode_down_kernel,
    _decode_gated_kernel,
    default_decode_config,
)
from vllm.model_executor.kernels.grouped_gemm.w4a8 import quantize_w4

MODULE = "tests.model_executor.kernels.grouped_gemm.test_decode"
# CPU (interpreter) sizes stay tiny; CUDA runs qwen3-30b-a3b's.
CPU_DIMS = dict(experts=6, hidden=64, inter=48, topk=3)
CUDA_DIMS = dict(experts=128, hidden=2048, inter=768, topk=8)
SMALL_TILES = DecodeConfig(16, 32, 16, 32)  # several K steps at CPU sizes


def dims(device):
    return CUDA_DIMS if device.type == "cuda" else CPU_DIMS


def make_weights(device, dtype, experts, hidden, inter, fp8=False):
    w13 = torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=device) / inter**0.5
    w13 = interleave_gate_up(w13)
    if fp8:
        (w13, w13_scale), (w2, w2_scale) = map(per_channel_quant_fp8, (w13, w2))
        return w13, w13_scale, w2, w2_scale
    return w13.to(dtype), None, w2.to(dtype), None


def routing(tokens, experts, topk, device, generator=None):
    """Distinct experts per token, the first and last among them."""
    ids = torch.stack(
        [torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)]
    )
    if tokens:
        ids[0, 0], ids[-1, -1] = 0, experts - 1
    weights = torch.rand(tokens, topk, generator=generator)
    return ids.to(device, torch.int32), weights.to(device)


def run_both(x, ids, weights, w13, w13_scale, w2, w2_scale, expert_map, config):
    tokens, hidden = x.shape
    act = torch.full((ids.numel(), w13.shape[1] // 2), float("nan"), device=x.device)
    act = act.to(x.dtype)
    out = torch.full((tokens, hidden), float("nan"), device=x.device, dtype=x.dtype)
    args = (x, ids, weights, w13, w13_scale, w2, w2_scale, expert_map, "silu", act)
    got = moe_decode(*args, out, config)
    ref = moe_decode_reference(*args, torch.empty_like(out))
    return got, ref


def tolerance(dtype):
    return {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}[dtype]


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 7, 16, 64])
def test_matches_reference(device, tokens):
    if device.type == "cpu" and tokens > 7:
        pytest.skip("interpreter: small sizes only")
    torch.manual_seed(tokens)
    d = dims(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w13, _, w2, _ = make_weights(device, dtype, d["experts"], d["hidden"], d["inter"])
    x = torch.randn(tokens, d["hidden"], device=device, dtype=dtype)
    ids, weights = routing(tokens, d["experts"], d["topk"], device)
    config = SMALL_TILES if device.type == "cpu" else None
    got, ref = run_both(x, ids, weights, w13, None, w2, None, None, config)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=tolerance(dtype), rtol=tolerance(dtype))


def test_invalid_and_non_local_experts_add_nothing(device):
    torch.manual_seed(1)
    hidden, inter, topk = 64, 48, 3  # 8 global experts, 4 local
    w13, _, w2, _ = make_weights(device, torch.float32, 4, hidden, inter)
    x = torch.randn(4, hidden, device=device)
    # Rank 1 of 2: global experts 4..7 are local 0..3.
    expert_map = torch.tensor([-1] * 4 + [0, 1, 2, 3], dtype=torch.int32)
    ids = torch.tensor(
        [[4, 7, 0], [1, 2, 3], [-1, 8, 5], [5, 5, 6]],  # row 1: no local route
        dtype=torch.int32,
    )
    weights = torch.rand(4, topk)
    got, ref = run_both(
        x, ids.to(device), weights.to(device), w13, None, w2, None,
        expert_map.to(device), SMALL_TILES,
    )  # fmt: skip
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (got[1] == 0).all() and (got[[0, 2, 3]].abs().sum(1) > 0).all()
    # Without a map, a route to a single expert equals that expert's share.
    ids = torch.tensor([[2, -3, 99]], dtype=torch.int32, device=device)
    one = torch.ones(1, topk, device=device)
    got, ref = run_both(x[:1], ids, one, w13, None, w2, None, None, SMALL_TILES)
    alone, _ = run_both(
        x[:1], ids[:, :1], one[:, :1], w13, None, w2, None, None, SMALL_TILES
    )
    torch.testing.assert_close(got, alone)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_uint4_weights_are_refused(device):
    x = torch.randn(1, 128, device=device)
    ids, weights = routing(1, 2, 2, device)
    w13, s13 = quantize_w4(torch.randn(2, 64, 128, device=device))
    w2, s2 = quantize_w4(torch.randn(2, 128, 128, device=device))
    with pytest.raises(ValueError, match=r"^w13: .* or fp8 weights, got torch.uint8"):
        run_both(x, ids, weights, w13, s13, w2, s2, None, None)


def test_non_multiple_sizes_and_fp16(device):
    torch.manual_seed(2)
    hidden, inter = 40, 24  # neither a multiple of the tiles
    w13, _, w2, _ = make_weights(device, torch.float16, 5, hidden, inter)
    x = torch.randn(3, hidden, device=device, dtype=torch.float16)
    ids, weights = routing(3, 5, 2, device)
    got, ref = run_both(x, ids, weights, w13, None, w2, None, None, SMALL_TILES)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_no_tokens_launches_nothing(device):
    w13, _, w2, _ = make_weights(device, torch.float32, 4, 64, 48)
    x = torch.empty(0, 64, device=device)
    ids = torch.empty(0, 2, dtype=torch.int32, device=device)
    out = torch.empty(0, 64, device=device)
    act = torch.empty(0, 48, device=device)
    weights = torch.empty(0, 2, device=device)
    moe_decode(x, ids, weights, w13, None, w2, None, None, "silu", act, out)


def test_bad_arguments_are_named(device):
    w13, _, w2, _ = make_weights(device, torch.float32, 4, 64, 48)
    x = torch.randn(2, 64, device=device)
    ids, weights = routing(2, 4, 2, device)
    act, out = torch.empty(4, 48, device=device), torch.empty(2, 64, device=device)
    good = dict(
        x=x, topk_ids=ids, topk_weights=weights, w13=w13, w13_scale=None, w2=w2,
        w2_scale=None, expert_map=None, activation="silu", act=act, out=out,
    )  # fmt: skip
    for name, bad in (
        ("w2", w2[:, :32]),
        ("w13_scale", torch.ones(4, 96, device=device)),  # scales for 16-bit weights
        ("topk_weights", weights.double()),
        ("act", act[:3]),
        ("out", out.half()),
        ("activation", "gelu"),
        ("expert_map", torch.zeros(4, dtype=torch.int64, device=device)),
    ):
        with pytest.raises(ValueError, match=name):
            moe_decode(**(good | {name: bad}))


def compile_kernels() -> None:
    """Both kernels at one token's tiles (fp8 weights with scales) built for
    sm_90 (run in a process of its own by the test below): their resources."""
    cfg = default_decode_config(1, FP8_DTYPE)
    common = dict(HAS_MAP=False, HAS_SCALE=True, PDL=True, ROUTED=False, BLOCK_E=128)
    gated = common | dict(MODE=0, ALPHA=1.702, LIMIT=7.0, BLOCK_N=cfg.gated_block_n,
                          BLOCK_K=cfg.gated_block_k, BLOCK_R=8)  # fmt: skip
    down = common | dict(BLOCK_R=8, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
                         RENORMALIZE=False)  # fmt: skip
    pointers = {"ids_ptr": "*i32", "map_ptr": "*i32", "w_ptr": "*fp8e4nv",
                "w_scale_ptr": "*fp32", "topk_weights_ptr": "*fp32"}  # fmt: skip
    for kernel, consts in ((_decode_gated_kernel, gated), (_decode_down_kernel, down)):
        cubin = asm_for_sm90(
            kernel, consts, pointers,
            ("K", "inter", "hidden", "stride_x", "stride_act", "stride_out"),
            cfg.num_warps,
        )["cubin"]  # fmt: skip
        usage = resources(cubin)
        print(COMPILED, json.dumps([usage[name] for name in ("REG", "LOCAL", "STACK")]))


def test_compiles_for_sm90_without_a_gpu():
    """Both kernels build for sm_90 at one token's tiles, without spilling
    registers."""
    builds = compiled_in_own_process(MODULE)
    assert len(builds) == 2
    for registers, local, stack in builds:
        assert 0 < registers <= 255
        assert local == stack == 0  # no spills (69 and 112 registers, Triton 3.6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 and graphs: CUDA")
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])  # each default tile config
def test_fp8_weights_and_graph_replay(tokens):
    torch.manual_seed(3)
    device = torch.device("cuda")
    d = CUDA_DIMS
    w13, s13, w2, s2 = make_weights(device, None, 128, 2048, 768, fp8=True)
    assert w13.dtype == FP8_DTYPE
    x = torch.randn(tokens, 2048, device=device, dtype=torch.bfloat16)
    ids, weights = routing(tokens, d["experts"], d["topk"], device)
    act = torch.empty(tokens * 8, 768, device=device, dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    args = (x, ids, weights, w13, s13, w2, s2, None, "silu", act, out)
    moe_decode(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_decode(*args)
    for seed in range(2):  # new tokens and routing each replay
        g = torch.Generator().manual_seed(seed)
        new_ids, new_weights = routing(tokens, d["experts"], d["topk"], "cpu", g)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        x.copy_(torch.randn(x.shape, generator=g))
        out.fill_(float("nan"))
        graph.replay()
        ref = moe_decode_reference(*args[:-1], torch.empty_like(out))
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def distinct_logits(tokens, experts, generator=None):
    """bf16 logits without ties (exact multiples of 1/8), so that every
    correct routing is the reference's."""
    rows = [torch.randperm(experts, generator=generator) for _ in range(tokens)]
    return ((torch.stack(rows) - experts / 2) / 8).to(torch.bfloat16)


def run_routed(x, logits, topk, renormalize, weights, expert_map=None, config=None):
    w13, w13_scale, w2, w2_scale = weights
    tokens, hidden = x.shape
    act = torch.full((tokens * topk, w13.shape[1] // 2), float("nan"), device=x.device)
    out = torch.full((tokens, hidden), float("nan"), device=x.device, dtype=x.dtype)
    args = (x, logits, topk, renormalize, w13, w13_scale, w2, w2_scale, expert_map,
            "silu", act.to(x.dtype))  # fmt: skip
    got = moe_decode_routed(*args, out, config)
    return got, moe_decode_routed_reference(*args, torch.empty_like(out))


@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routed_matches_reference(device, tokens, renormalize):
    if device.type == "cpu" and tokens > 3:
        pytest.skip("interpreter: small sizes only")
    torch.manual_seed(10 + tokens)
    d = dims(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = make_weights(device, dtype, d["experts"], d["hidden"], d["inter"])
    x = torch.randn(tokens, d["hidden"], device=device, dtype=dtype)
    logits = distinct_logits(tokens, d["experts"]).to(device)
    config = SMALL_TILES if device.type == "cpu" else None
    got, ref = run_routed(x, logits, d["topk"], renormalize, weights, config=config)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=tolerance(dtype), rtol=tolerance(dtype))
    # The routing is the ids-and-weights kernels' on the reference's routing.
    ref_weights, ref_ids = top_routes_reference(logits, d["topk"], renormalize)
    w13, w13_scale, w2, w2_scale = weights
    same, _ = run_both(x, ref_ids, ref_weights, w13, w13_scale, w2, w2_scale, None,
                       config)  # fmt: skip
    torch.testing.assert_close(got, same, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routed_ties_nan_and_signed_zero(device, dtype):
    """Equal logits route to the lower ids first, NaN last, -0.0 ties with
    0.0: hand-made rows, then random rows of few distinct values."""
    torch.manual_seed(11)
    weights = make_weights(device, torch.float32, 6, 64, 48)
    x = torch.randn(4, 64, device=device)
    logits = torch.tensor(
        [
            [0.0, -0.0, 1.0, 0.0, -1.0, -0.0],  # 0.0 and -0.0 tie: lower ids first
            [float("nan"), -2.0, -2.0, float("-inf"), -2.0, -3.0],  # NaN last
            [3.0, 3.0, 3.0, 3.0, 3.0, 3.0],  # all tie
            [-0.5, 8.0, 2.0, -0.25, 0.5, 1.5],
        ],
        dtype=dtype,
    ).to(device)
    got, ref = run_routed(x, logits, 3, True, weights, config=SMALL_TILES)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    _, ids = top_routes_reference(logits, 3, True)
    assert ids.tolist() == [[2, 0, 1], [1, 2, 4], [0, 1, 2], [1, 2, 5]]
    tied = (torch.randint(-2, 3, (4, 6)) / 2).to(device, dtype)
    got, ref = run_routed(x, tied, 4, False, weights, config=SMALL_TILES)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_routed_non_local_experts_add_nothing(device):
    torch.manual_seed(12)
    weights = make_weights(device, torch.float32, 4, 64, 48)
    x = torch.randn(3, 64, device=device)
    # Rank 1 of 2: global experts 4..7 are local 0..3.
    expert_map = torch.tensor([-1] * 4 + [0, 1, 2, 3], dtype=torch.int32, device=device)
    logits = distinct_logits(3, 8).to(device)
    logits[1, 4:] = -8.0  # token 1 routes to remote experts only
    got, ref = run_routed(x, logits, 2, False, weights, expert_map, SMALL_TILES)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (got[1] == 0).all() and (got[[0, 2]].abs().sum(1) > 0).all()


def test_routed_bad_arguments_are_named(device):
    w13, _, w2, _ = make_weights(device, torch.float32, 4, 64, 48)
    x = torch.randn(2, 64, device=device)
    act, out = torch.empty(4, 48, device=device), torch.empty(2, 64, device=device)
    logits = distinct_logits(2, 4).to(device)
    good = dict(
        x=x, logits=logits, topk=2, renormalize=True, w13=w13, w13_scale=None,
        w2=w2, w2_scale=None, expert_map=None, activation="silu", act=act, out=out,
    )  # fmt: skip
    too_many = torch.zeros(1025, dtype=torch.int32, device=device)
    for name, change in (
        ("logits", dict(logits=logits.float())),  # keys hold 16-bit logits only
        ("logits", dict(logits=logits[:, :3])),
        ("logits", dict(logits=logits[:1])),
        ("topk", dict(topk=5)),
        ("act", dict(topk=3)),  # 2 tokens x 3 routes > act's 4 rows
        ("expert_map", dict(expert_map=too_many)),
    ):
        with pytest.raises(ValueError, match=f"^{name}: "):
            moe_decode_routed(**(good | change))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 and graphs: CUDA")
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_routed_fp8_graph_replay(tokens):
    torch.manual_seed(13)
    device, d = torch.device("cuda"), CUDA_DIMS
    w13, s13, w2, s2 = make_weights(device, None, 128, 2048, 768, fp8=True)
    x = torch.randn(tokens, 2048, device=device, dtype=torch.bfloat16)
    logits = distinct_logits(tokens, d["experts"]).to(device)
    act = torch.empty(tokens * 8, 768, device=device, dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    args = (x, logits, 8, True, w13, s13, w2, s2, None, "silu", act, out)
    moe_decode_routed(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_decode_routed(*args)
    for seed in range(2):  # new tokens and logits each replay
        g = torch.Generator().manual_seed(seed)
        logits.copy_(distinct_logits(tokens, d["experts"], g))
        x.copy_(torch.randn(x.shape, generator=g))
        out.fill_(float("nan"))
        graph.replay()
        ref = moe_decode_routed_reference(*args[:-1], torch.empty_like(out))
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
