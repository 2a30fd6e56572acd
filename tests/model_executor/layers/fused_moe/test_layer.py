"""The FusedMoE layer: backend choice, slots, reload, compile, graphs, loaders."""

import functools
import logging
import re
import sys

import pytest
import torch

from tests.model_executor.layers.fused_moe.utils import (
    HOPPER,
    RELOAD_SCHEMES,
    SCHEMES,
    TOLERANCE,
    dequantized,
    layer_ids,
    load_random_weights,
    make_layer,
    moe_config,
    random_weights,
    relative_error,
)
from vllm.model_executor.kernels.common.rms_norm import rms_norm
from vllm.model_executor.layers.fused_moe import routing
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts import triton_moe
from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    GroupedMMExperts,
)
from vllm.model_executor.layers.fused_moe.experts.triton_fp8_moe import TritonExpertsFp8
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.layer import (
    AUTO_ORDER,
    FusedMoE,
    choose_experts_backend,
    make_experts,
)
from vllm.model_executor.layers.fused_moe.reference import fused_moe_reference
from vllm.model_executor.layers.fused_moe.routing import fused_topk
from vllm.utils import named_tensors
from vllm.v1.worker.ubatching import run_ubatches
from vllm.v1.worker.workspace import (
    init_workspace_manager,
    reset_workspace_manager,
    use_workspace_lane,
)


def test_auto_picks_the_fused_bf16_backend_where_it_runs(device):
    """Unquantized layers take ``triton`` on Hopper when their dims allow,
    ``grouped_mm`` elsewhere (other GPUs, the CPU, hidden_size 8 past a
    multiple of 16)."""
    for hidden, fused in ((128, HOPPER), (136, False)):
        moe = moe_config(device, hidden_size=hidden, intermediate_size=64)
        experts = make_experts(moe, *random_weights(moe, device))
        assert isinstance(experts, TritonExperts) == fused
        assert isinstance(experts, GroupedMMExperts) != fused


def test_auto_walks_the_order_and_names_every_refusal(device, monkeypatch, caplog):
    """W4A16 without humming-kernels runs on our Marlin; a layer no backend
    runs is refused with each backend's reason."""
    monkeypatch.setitem(sys.modules, "humming", None)  # import humming fails
    w4 = moe_config(
        "cpu", scheme=QuantScheme.W4A16_UINT4, hidden_size=256, intermediate_size=128
    )
    with caplog.at_level(logging.DEBUG, logger="vllm"):
        assert choose_experts_backend(w4, torch.device("cpu")) == "marlin"
    assert "humming-kernels" in caplog.text and "grouped_mm" in caplog.text
    odd = moe_config("cpu", scheme=QuantScheme.W4A16_UINT4, hidden_size=136)
    with pytest.raises(ValueError, match="no experts backend") as info:
        choose_experts_backend(odd, torch.device("cpu"))
    for name in AUTO_ORDER["cpu"]:
        assert f"{name}: " in str(info.value)
    assert "hidden_size: expected a multiple of 128, got 136" in str(info.value)
    w13, w2 = random_weights(w4, "cpu")
    with pytest.raises(ValueError, match="backend: expected one of"):
        make_experts(w4, w13, w2, "tensorrt")


@pytest.mark.parametrize("width_delta", [-4, 4])
def test_router_logits_of_the_wrong_width_are_refused(
    workspace_init, device, width_delta
):
    moe = moe_config(device, experts_per_token=2)
    layer = make_layer(moe, device)
    x = torch.randn(3, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(3, moe.num_experts + width_delta, device=device)
    expected = f"router_logits: expected [3, {moe.num_experts}]"
    with pytest.raises(ValueError, match=re.escape(expected)):
        layer(x, logits)
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, torch.randn(2, moe.num_experts, device=device))  # wrong token count
    out = layer(x, torch.randn(3, moe.num_experts, device=device))  # still serves
    assert out.shape == x.shape and not out.isnan().any()


def test_routing_by_the_gate_weight_equals_routing_by_its_logits(
    workspace_init, device
):
    """``gate_weight``: the router's GEMM in the layer (on a GPU fused with
    the routing at 1 token, ``skinny_gemm`` then the routing at 2; above,
    and on the CPU, ``F.linear`` then the routing) routes as its logits do;
    the fused kernel's counter is one lock buffer of the slot."""
    moe = moe_config(device, experts_per_token=4)
    layer = make_layer(moe, device, seed=8)
    gate = torch.randn(moe.num_experts, moe.hidden_size, device=device)
    gate = (gate / moe.hidden_size**0.5).to(moe.in_dtype)
    for tokens in (1, 2, 5):
        x = torch.randn(tokens, moe.hidden_size, device=device, dtype=moe.in_dtype)
        logits = (x.float() @ gate.float().T).to(x.dtype)  # both paths round
        # (a sum in another order may round a logit one bf16 step apart)
        torch.testing.assert_close(
            layer(x, gate_weight=gate), layer(x, logits), rtol=1e-2, atol=1e-2
        )
    counters = [
        r
        for slot in workspace_init.memory_report().slots
        for r in slot.resources
        if "router_topk" in str(r.key)
    ]
    assert len(counters) == (1 if device.type == "cuda" else 0)
    x = torch.randn(2, moe.hidden_size, device=device, dtype=moe.in_dtype)
    with pytest.raises(ValueError, match=r"^router_logits/gate_weight: .* got both"):
        layer(x, x @ gate.T, gate_weight=gate)
    with pytest.raises(ValueError, match=r"^router_logits/gate_weight: .* neither"):
        layer(x)
    expected = f"gate_weight: expected [{moe.num_experts}, {moe.hidden_size}]"
    with pytest.raises(ValueError, match=re.escape(expected)):
        layer(x, gate_weight=gate[:, :-8])


@pytest.mark.parametrize("routed", [True, False])
def test_the_normed_forward_equals_the_norm_then_the_layer(
    workspace_init, device, monkeypatch, routed
):
    """``forward_normed``: the residual add and RMSNorm taken into the layer
    (the GPU dispatch on any device: at 1 token inside the router's kernel,
    at 2 and 5 the norm's kernel first) give the layer's output on the
    normalized rows and the sum, a new tensor, with the residual left as it
    was; whether the experts' decode kernels route from the logits
    (``routed``) or take top-k ids."""
    fused: list[int] = []
    router = "rms_norm_router_logits" if routed else "rms_norm_router_topk"
    real = getattr(routing, router)

    def counted(x, *args):
        fused.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(routing, "runs_gpu_kernels", lambda t: True)
    monkeypatch.setattr(triton_moe, "runs_gpu_kernels", lambda t: True)
    monkeypatch.setattr(routing, router, counted)
    moe = moe_config(device, experts_per_token=4)
    layer = make_layer(moe, device, backend="triton", seed=9)
    assert layer.kernel is not None
    if not routed:
        monkeypatch.setattr(layer.kernel.experts, "routes_from_logits", lambda t: False)
    routed_calls: list[int] = []
    forward_routed = layer.kernel.forward_routed

    def counted_routed(x, *args):
        routed_calls.append(x.shape[0])
        return forward_routed(x, *args)

    monkeypatch.setattr(layer.kernel, "forward_routed", counted_routed)
    gate = torch.randn(moe.num_experts, moe.hidden_size, device=device)
    gate = (gate / moe.hidden_size**0.5).to(moe.in_dtype)
    norm_weight = torch.rand(moe.hidden_size, device=device).to(moe.in_dtype) + 0.5
    for tokens in (1, 2, 5):
        x, residual = (
            torch.randn(tokens, moe.hidden_size, device=device, dtype=moe.in_dtype)
            for _ in range(2)
        )
        before = residual.clone()
        out, total = layer.forward_normed(x, residual, norm_weight, 1e-6, gate)
        normed, expected_total = rms_norm(x, norm_weight, 1e-6, residual)
        assert torch.equal(residual, before)
        assert expected_total is not None and torch.equal(total, expected_total)
        # (at 1 token the fp32 sum of squares runs in another order: a
        # normalized value may round one bf16 step apart)
        expected = layer(normed, gate_weight=gate)
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert fused == [1]
    assert routed_calls == ([1, 2, 5] if routed else [])
    x = x[:1]
    expected_msg = f"gate_weight: expected [{moe.num_experts}, {moe.hidden_size}]"
    with pytest.raises(ValueError, match=re.escape(expected_msg)):
        layer.forward_normed(x, x, norm_weight, 1e-6, gate[:, :-8])
    with pytest.raises(ValueError, match=r"^residual: expected"):
        layer.forward_normed(x, x[:, :-8], norm_weight, 1e-6, gate)
    with pytest.raises(ValueError, match=r"^norm_weight: expected"):
        layer.forward_normed(x, x, norm_weight[:-8], 1e-6, gate)


def test_opcheck_the_layer_ops(workspace_init, device):
    moe = moe_config(device, experts_per_token=4)
    layer = make_layer(moe, device, seed=10)
    gate = torch.randn(moe.num_experts, moe.hidden_size, device=device)
    gate = (gate / moe.hidden_size**0.5).to(moe.in_dtype)
    norm_weight = torch.rand(moe.hidden_size, device=device).to(moe.in_dtype) + 0.5
    for tokens in (1, 3):
        x, residual = (
            torch.randn(tokens, moe.hidden_size, device=device, dtype=moe.in_dtype)
            for _ in range(2)
        )
        torch.library.opcheck(
            torch.ops.vllm.moe_forward.default, (x, None, gate, layer.layer_name)
        )
        torch.library.opcheck(
            torch.ops.vllm.moe_forward_normed.default,
            (x, residual, norm_weight, 1e-6, gate, layer.layer_name),
        )


def test_eight_layers_four_slots_four_scratches(device):
    reset_workspace_manager()
    manager = init_workspace_manager(device, num_ubatches=2, num_lanes=2)
    try:
        moe = moe_config(device)
        layers = [make_layer(moe, device, seed=i) for i in range(8)]
        hidden = torch.randn(16, moe.hidden_size, device=device, dtype=moe.in_dtype)
        logits = torch.randn(16, moe.num_experts, device=device)

        def run_all(lane: int) -> torch.Tensor:
            with use_workspace_lane(lane):
                x = hidden
                for layer in layers:
                    x = layer(x, logits)
                return x

        outs = [
            o
            for lane in (0, 1)
            for o in run_ubatches([functools.partial(run_all, lane)] * 2)
        ]
        for o in outs[1:]:
            torch.testing.assert_close(o, outs[0], rtol=0, atol=0)  # bit-reproducible
        report = manager.memory_report()
        assert len(report.resources_of_type("MoEPermuteScratch")) == 4
        assert all(
            len([r for r in s.resources if r.type_name == "MoEPermuteScratch"]) == 1
            for s in report.slots
        )
        # Nothing per layer: no tensor of a layer or its experts shares storage
        # with what the manager owns (arenas, scratches, lock buffers).
        managed = {
            t.untyped_storage().data_ptr()
            for slot in manager._slots
            for t in ([slot.arena] if slot.arena is not None else [])
            + [t for _, t in named_tensors(slot.tensors)]
            + [t for _, t in named_tensors(slot.objects)]
        }
        assert managed
        for layer in layers:
            owned = [t for _, t in named_tensors(layer)] + [
                t for _, t in named_tensors(layer.kernel)
            ]
            assert owned
            assert not managed & {t.untyped_storage().data_ptr() for t in owned}
    finally:
        reset_workspace_manager()


@pytest.mark.parametrize("backend", list(RELOAD_SCHEMES))
def test_reload_after_lock(workspace_init, device, backend):
    # Marlin keeps its weights in nested objects and needs 128-multiples.
    moe = moe_config(
        device,
        scheme=RELOAD_SCHEMES[backend],
        experts_per_token=2,
        intermediate_size=128,
    )
    layer = make_layer(moe, device, backend, seed=1)
    hidden = torch.randn(12, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(12, moe.num_experts, device=device)
    before = layer(hidden, logits)
    bytes_before = workspace_init.memory_report().total_bytes
    assert layer.kernel is not None
    experts = layer.kernel.experts
    storage = {k: v.data_ptr() for k, v in named_tensors(experts)}
    assert storage
    workspace_init.lock()
    load_random_weights(layer, seed=2)
    layer.process_weights_after_loading()  # rebuilds the experts
    after = layer(hidden, logits)
    # The new weights went into the old storage (graphs captured before the
    # reload keep reading valid, now updated, weights).
    assert layer.kernel.experts is experts
    assert {k: v.data_ptr() for k, v in named_tensors(experts)} == storage
    assert workspace_init.memory_report().total_bytes == bytes_before
    assert relative_error(after, before.double().cpu()) > 0.1  # new weights in use
    fresh = make_layer(moe, device, backend, seed=2)
    torch.testing.assert_close(after, fresh(hidden, logits), rtol=0, atol=0)


class TwoLayerBlock(torch.nn.Module):
    def __init__(self, moe: FusedMoEConfig, device):
        super().__init__()
        self.gate = torch.nn.Linear(moe.hidden_size, moe.num_experts, device=device)
        self.first = make_layer(moe, device, seed=3)
        self.second = make_layer(moe, device, seed=4)

    def forward(self, x):
        # Both layers route on the block's input: the second layer's input
        # differs between compiled and eager by bf16 rounding, and routing on
        # it would flip near-tied experts (the outputs would then differ by
        # whole expert contributions, not by rounding).
        logits = self.gate(x.float())
        x = x + self.first(x, logits)
        return x + self.second(x, logits)


def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    torch.manual_seed(0)  # the gate's weights: not whatever tests ran before
    reset_workspace_manager()
    manager = init_workspace_manager(device, num_lanes=2)
    try:
        with torch.no_grad():  # inference, as in a runner
            moe = moe_config(device, experts_per_token=4)
            block = TwoLayerBlock(moe, device)
            x = torch.randn(10, moe.hidden_size, device=device, dtype=moe.in_dtype)
            expected = block(x)
            compiled = torch.compile(block, fullgraph=True)
            with torch._dynamo.config.patch(error_on_recompile=True):
                torch.testing.assert_close(compiled(x), expected, rtol=1e-2, atol=1e-2)
                with use_workspace_lane(1):  # another slot, same compiled graph
                    torch.testing.assert_close(
                        compiled(x), expected, rtol=1e-2, atol=1e-2
                    )
        # The lookups ran at execution time: each lane got its own scratch.
        scratches = manager.memory_report().resources_of_type("MoEPermuteScratch")
        assert len(scratches) == 2
    finally:
        reset_workspace_manager()
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(RELOAD_SCHEMES))
def test_graph_captured_before_reload_uses_new_weights(workspace_init, backend):
    moe = moe_config("cuda", scheme=RELOAD_SCHEMES[backend])
    layer = make_layer(moe, "cuda", backend, seed=6)
    hidden = torch.randn(32, moe.hidden_size, device="cuda", dtype=moe.in_dtype)
    logits = torch.randn(32, moe.num_experts, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(hidden, logits)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = layer(hidden, logits)
    workspace_init.lock()
    load_random_weights(layer, seed=7)
    layer.process_weights_after_loading()
    fresh = make_layer(moe, "cuda", backend, seed=7)
    stream.wait_stream(torch.cuda.current_stream())
    # Both on the capture stream, in order: they share its workspace and its
    # lock buffers (which exist only there after lock).
    with torch.cuda.stream(stream):
        graph.replay()
        expected = fresh(hidden, logits)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [*SCHEMES, "triton_w4a8"])
def test_cuda_graph_replay_with_new_routing(workspace_init, backend):
    moe = moe_config("cuda", scheme=RELOAD_SCHEMES[backend])
    layer = make_layer(moe, "cuda", backend, seed=5)
    hidden = torch.randn(64, moe.hidden_size, device="cuda", dtype=moe.in_dtype)
    logits = torch.randn(64, moe.num_experts, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(hidden, logits)
    stream.synchronize()
    workspace_init.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = layer(hidden, logits)
    for _ in range(3):
        hidden.copy_(torch.randn_like(hidden))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, layer(hidden, logits), rtol=0, atol=0)
        assert layer.kernel is not None
        w13, w2 = dequantized(layer.kernel.experts, layer.w13_weight, layer.w2_weight)
        weights, ids = fused_topk(hidden, logits, moe.experts_per_token, True)
        ref = fused_moe_reference(hidden, w13, w2, weights, ids, None)
        assert relative_error(out, ref) < TOLERANCE[backend]


def test_bad_configs(device):
    with pytest.raises(ValueError, match="experts_per_token"):
        moe_config(device, experts_per_token=0)
    with pytest.raises(ValueError, match="ep_size"):
        moe_config(device, ep_size=17, num_experts=16)  # more ranks than experts
    with pytest.raises(ValueError, match="in_dtype"):
        FusedMoEConfig(8, 2, 128, 64, in_dtype=torch.float64)
    with pytest.raises(ValueError, match="activation"):
        FusedMoEConfig(8, 2, 128, 64, activation="gelu")
    moe = moe_config(device)
    w13, w2 = random_weights(moe, device)
    with pytest.raises(ValueError, match="quant_config"):
        CutlassExpertsFp8.from_unquantized(moe, w13, w2)
    with pytest.raises(ValueError, match="w13"):
        GroupedMMExperts(moe, w13.float(), w2)
    fp8 = moe_config(device, scheme=QuantScheme.FP8_PER_TOKEN, hidden_size=136)
    w13, w2 = random_weights(fp8, device)
    with pytest.raises(ValueError, match="hidden_size"):
        CutlassExpertsFp8.from_unquantized(fp8, w13, w2)
    with pytest.raises(ValueError, match="hidden_size"):
        TritonExpertsFp8.from_unquantized(fp8, w13, w2)
    with pytest.raises(ValueError, match="backend"):
        FusedMoE(moe, prefix="bad.backend", backend="tensorrt", device=device)


def test_missing_expert_shards_are_refused(device):
    moe = moe_config(device, experts_per_token=2)
    layer = FusedMoE(moe, prefix=f"test.partial.{next(layer_ids)}", device=device)
    load_random_weights(layer, seed=0)
    layer.process_weights_after_loading()  # complete: fine
    fp8 = moe_config(device, scheme=QuantScheme.FP8_PER_TOKEN, experts_per_token=2)
    layer = FusedMoE(fp8, prefix=f"test.partial.{next(layer_ids)}", device=device)
    k, i = fp8.hidden_size, fp8.intermediate_size
    for e in range(fp8.num_experts):
        layer.weight_loader(torch.randn(i, k, device=device), "w1", e)
        layer.weight_loader(torch.randn(k, i, device=device), "w2", e)
    with pytest.raises(ValueError, match="expert shards were not loaded"):
        layer.process_weights_after_loading()  # every w3 is missing


def test_stacked_loader_matches_per_shard_loading(workspace_init, device):
    moe = moe_config(device, ep_size=4, experts_per_token=2)
    per_shard = make_layer(moe, device, seed=8)
    gen = torch.Generator().manual_seed(8)
    k, i = moe.hidden_size, moe.intermediate_size
    w13 = torch.empty(moe.num_experts, 2 * i, k)
    w2 = torch.empty(moe.num_experts, k, i)
    for e in range(moe.num_experts):  # the draw order of load_random_weights
        w13[e, :i] = torch.randn(i, k, generator=gen) / k**0.5
        w13[e, i:] = torch.randn(i, k, generator=gen) / k**0.5
        w2[e] = torch.randn(k, i, generator=gen) / i**0.5
    stacked = FusedMoE(moe, prefix=f"test.stacked.{next(layer_ids)}", device=device)
    stacked.stacked_weight_loader(w13.to(device), w2.to(device))
    stacked.process_weights_after_loading()
    # The prepared experts' weights, whichever backend "auto" picked.
    assert stacked.kernel is not None and per_shard.kernel is not None
    prepared = dict(named_tensors(stacked.kernel.experts))
    expected = dict(named_tensors(per_shard.kernel.experts))
    assert prepared.keys() == expected.keys() and prepared
    for name, t in prepared.items():
        assert torch.equal(t, expected[name]), name
    with pytest.raises(ValueError, match="w2: expected stacked"):
        stacked.stacked_weight_loader(w13.to(device), w2[:1].to(device))
