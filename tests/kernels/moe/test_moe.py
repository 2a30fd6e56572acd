"""Experts backends through the modular kernel, and the FusedMoE layer.

Every backend is compared with a dense float64 reference on its own
dequantized weights. CPU runs the reference loops at small sizes; CUDA runs
``torch._grouped_mm`` / ``torch._scaled_grouped_mm`` at model sizes.
"""

import functools
from typing import Any

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe_reference
from vllm.model_executor.kernels.grouped_gemm import (
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_reference,
)
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts import triton_fp8_moe, triton_moe
from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    GroupedMMExperts,
)
from vllm.model_executor.layers.fused_moe.experts.triton_fp8_moe import TritonExpertsFp8
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.layer import FusedMoE, make_experts
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.routing import fused_topk
from vllm.utils import named_tensors
from vllm.v1.worker.ubatching import run_ubatches
from vllm.v1.worker.workspace import (
    init_workspace_manager,
    reset_workspace_manager,
    use_workspace_lane,
)

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)
SCHEMES = {
    "grouped_mm": QuantScheme.UNQUANTIZED,
    # bf16 on our kernels: Hopper's, or their references on the CPU.
    **({"triton": QuantScheme.UNQUANTIZED} if HOPPER or not CUDA else {}),
    "cutlass": QuantScheme.FP8_PER_TOKEN,
    "triton_fp8": QuantScheme.FP8_PER_TOKEN,
}
# Relative error; fp8 quantizes twice.
TOLERANCE = {"grouped_mm": 2e-2, "triton": 2e-2, "cutlass": 0.1, "triton_fp8": 0.1}


def moe_config(
    device, ep_size=1, scheme=QuantScheme.UNQUANTIZED, **kw
) -> FusedMoEConfig:
    dims: dict[str, Any] = (
        {"num_experts": 32, "hidden_size": 2048, "intermediate_size": 768}
        if torch.device(device).type == "cuda"
        else {"num_experts": 16, "hidden_size": 128, "intermediate_size": 64}
    )
    dims.update(kw)
    return FusedMoEConfig(
        experts_per_token=dims.pop("experts_per_token", 8),
        ep_size=ep_size,
        ep_rank=ep_size // 2,
        quant_config=FusedMoEQuantConfig(scheme),
        **dims,
    )


def random_weights(moe: FusedMoEConfig, device):
    el, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
    w13 = (torch.randn(el, 2 * i, k, device=device) / k**0.5).to(moe.in_dtype)
    w2 = (torch.randn(el, k, i, device=device) / i**0.5).to(moe.in_dtype)
    return w13, w2


def dequantized(experts, w13, w2):
    if isinstance(experts, GroupedMMExperts):
        return w13, w2
    return experts.dequantized_weights()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_backend(backend, tokens, topk, ep_size, device, **dims):
    moe = moe_config(device, ep_size, SCHEMES[backend], experts_per_token=topk, **dims)
    w13, w2 = random_weights(moe, device)
    experts = make_experts(moe, w13, w2, backend)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(tokens, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(tokens, moe.num_experts, device=device)
    topk_weights, topk_ids = fused_topk(hidden, logits, topk, renormalize=True)
    expert_map = moe.make_expert_map(device)
    out = kernel.forward(hidden, topk_weights, topk_ids, expert_map)
    dq13, dq2 = dequantized(experts, w13, w2)
    ref = torch_moe_reference(hidden, dq13, dq2, topk_weights, topk_ids, expert_map)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert not bool(out.isnan().any())
    if ep_size > 1 and bool((ref == 0).all()):
        assert bool((out == 0).all())  # no local route at all
        return
    assert relative_error(out, ref) < TOLERANCE[backend]


@pytest.mark.parametrize("backend", list(SCHEMES))
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_backend_cpu(workspace_init, backend, tokens, topk, ep_size):
    if CUDA:
        pytest.skip("CPU path")
    torch.manual_seed(tokens * 10 + topk + ep_size)
    check_backend(backend, tokens, topk, ep_size, "cpu")


@pytest.mark.parametrize("ep_size", [1, 4])
def test_triton_fp8_kernel_in_the_pipeline_cpu(workspace_init, monkeypatch, ep_size):
    """CPU tensors normally take the GEMM's reference; here the Triton kernel
    itself (interpreted) runs inside the experts pipeline."""
    if CUDA:
        pytest.skip("the GPU tests run the kernel")
    calls = []

    def interpreted(kernel):
        def run(*args):
            calls.append(kernel)
            return kernel(*args)

        return run

    for name, kernel in (
        ("grouped_gemm_fp8_gated_reference", grouped_gemm_fp8_gated),
        ("grouped_gemm_fp8_reference", grouped_gemm_fp8),
    ):
        monkeypatch.setattr(triton_fp8_moe, name, interpreted(kernel))
    torch.manual_seed(ep_size)
    check_backend("triton_fp8", 7, 2, ep_size, "cpu")
    assert calls == [grouped_gemm_fp8_gated, grouped_gemm_fp8]


@pytest.mark.parametrize("ep_size", [1, 4])
@pytest.mark.parametrize("topk", [1, 8])
def test_triton_fp8_group_quantized_path_cpu(
    workspace_init, monkeypatch, ep_size, topk
):
    """Where both GEMMs take the Hopper kernels, GEMM1 writes its activation
    in fp8 with per-group scales and GEMM2 takes them (no pass between):
    that pipeline on the references (intermediate 208: a full and a partial
    group), against the dense reference."""
    if CUDA:
        pytest.skip("the GPU tests run it where the Hopper kernels apply")
    scales = []

    def gemm2(a, a_scale, *args):
        scales.append(a_scale.shape)
        return grouped_gemm_fp8_reference(a, a_scale, *args)

    monkeypatch.setattr(triton_fp8_moe, "takes_gluon_groups", lambda *args: True)
    monkeypatch.setattr(triton_fp8_moe, "grouped_gemm_fp8_reference", gemm2)
    torch.manual_seed(ep_size + topk)
    check_backend("triton_fp8", 64, topk, ep_size, "cpu", intermediate_size=208)
    assert scales == [(64 * topk, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs sm90")
@pytest.mark.parametrize("ep_size", [1, 4])
def test_triton_fp8_takes_the_group_path_on_hopper(
    workspace_init, monkeypatch, ep_size
):
    """At 1024 tokens (top-8, 32 experts: 256 routes per expert) the layer's
    GEMM2 gets group scales from GEMM1; the layer matches the reference."""
    scales = []

    def gemm2(a, a_scale, *args):
        scales.append(a_scale.shape)
        return grouped_gemm_fp8(a, a_scale, *args)

    monkeypatch.setattr(triton_fp8_moe, "grouped_gemm_fp8", gemm2)
    torch.manual_seed(ep_size)
    check_backend("triton_fp8", 1024, 8, ep_size, "cuda")
    assert scales == [(1024 * 8, 768 // 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(SCHEMES))
@pytest.mark.parametrize("tokens", [1, 7, 64, 1024])
@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_backend_gpu(workspace_init, backend, tokens, topk, ep_size):
    torch.manual_seed(tokens * 10 + topk + ep_size)
    check_backend(backend, tokens, topk, ep_size, "cuda")


@pytest.mark.parametrize("backend", list(SCHEMES))
def test_swiglu_activation(workspace_init, device, backend):
    torch.manual_seed(0)
    moe = moe_config(
        device, scheme=SCHEMES[backend], activation="swiglu", experts_per_token=2
    )
    w13, w2 = random_weights(moe, device)
    experts = make_experts(moe, w13, w2, backend)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(9, moe.hidden_size, device=device, dtype=moe.in_dtype) * 4
    topk_weights, topk_ids = fused_topk(
        hidden, torch.randn(9, moe.num_experts, device=device), 2, True
    )
    out = kernel.forward(hidden, topk_weights, topk_ids)
    dq13, dq2 = dequantized(experts, w13, w2)
    ref = torch_moe_reference(hidden, dq13, dq2, topk_weights, topk_ids, None, "swiglu")
    assert relative_error(out, ref) < TOLERANCE[backend]


@pytest.mark.parametrize("backend", list(SCHEMES))
@pytest.mark.parametrize("ep_size", [1, 4])
def test_zero_tokens(workspace_init, device, backend, ep_size):
    moe = moe_config(device, ep_size, SCHEMES[backend], experts_per_token=2)
    w13, w2 = random_weights(moe, device)
    experts = make_experts(moe, w13, w2, backend)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.empty(0, moe.hidden_size, device=device, dtype=moe.in_dtype)
    topk_weights, topk_ids = fused_topk(
        hidden, torch.empty(0, moe.num_experts, device=device), 2, True
    )
    out = kernel.forward(hidden, topk_weights, topk_ids, moe.make_expert_map(device))
    assert out.shape == (0, moe.hidden_size) and out.dtype == moe.in_dtype


def test_auto_picks_the_fused_bf16_backend_where_it_runs(device):
    """Unquantized layers take ``triton`` on Hopper when their dims allow,
    ``grouped_mm`` elsewhere (other GPUs, the CPU, hidden_size 8 past a
    multiple of 16)."""
    for hidden, fused in ((128, HOPPER), (136, False)):
        moe = moe_config(device, hidden_size=hidden, intermediate_size=64)
        experts = make_experts(moe, *random_weights(moe, device))
        assert isinstance(experts, TritonExperts) == fused
        assert isinstance(experts, GroupedMMExperts) != fused


def test_triton_refuses_what_its_kernels_cannot_run(monkeypatch):
    moe = moe_config("cpu")
    assert TritonExperts.unsupported(moe, torch.device("cpu")) is None
    bad = moe_config("cpu", hidden_size=136)
    with pytest.raises(ValueError, match="hidden_size/intermediate_size: expected"):
        TritonExperts(bad, *random_weights(bad, "cpu"))
    monkeypatch.setattr(triton_moe, "is_hopper", lambda device: False)
    monkeypatch.setattr(triton_moe, "capability", lambda device: (8, 0))
    reason = TritonExperts.unsupported(moe, torch.device("cuda"))
    assert reason is not None and "Hopper GPU (sm90)" in reason and "(8, 0)" in reason


UNQUANTIZED = [b for b, scheme in SCHEMES.items() if scheme == QuantScheme.UNQUANTIZED]


@pytest.mark.parametrize("backend", UNQUANTIZED)
def test_strided_hidden_states(workspace_init, device, backend):
    """A column slice of a wider tensor (as a fused QKV-style split leaves
    it) gives what its contiguous copy gives."""
    torch.manual_seed(11)
    moe = moe_config(device, experts_per_token=2)
    w13, w2 = random_weights(moe, device)
    kernel = FusedMoEModularKernel(
        MoEPrepareAndFinalizeNoEP(), make_experts(moe, w13, w2, backend)
    )
    wide = torch.randn(9, moe.hidden_size + 8, device=device, dtype=moe.in_dtype)
    hidden = wide[:, 8:]
    assert not hidden.is_contiguous()
    weights, ids = fused_topk(
        hidden, torch.randn(9, moe.num_experts, device=device), 2, True
    )
    out = kernel.forward(hidden, weights, ids)
    torch.testing.assert_close(out, kernel.forward(hidden.contiguous(), weights, ids))


def test_fused_topk(device):
    torch.manual_seed(1)
    logits = torch.randn(5, 16, device=device)
    weights, ids = fused_topk(torch.empty(5, 8, device=device), logits, 3, True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, device=device))
    probs = logits.softmax(-1)
    assert torch.equal(ids.long(), probs.topk(3).indices)
    raw, _ = fused_topk(torch.empty(5, 8, device=device), logits, 3, False)
    torch.testing.assert_close(raw, probs.topk(3).values)
    with pytest.raises(ValueError, match="topk"):
        fused_topk(torch.empty(5, 8, device=device), logits, 17, True)


# -- layers on the shared workspace ----------------------------------------------


_layer_ids = iter(range(10**9))


def make_layer(moe: FusedMoEConfig, device, backend="auto", seed=0) -> FusedMoE:
    torch.manual_seed(seed)
    layer = FusedMoE(
        moe,
        prefix=f"test.layers.{next(_layer_ids)}.mlp",
        backend=backend,
        device=device,
    )
    load_random_weights(layer, seed)
    layer.process_weights_after_loading()
    return layer


def load_random_weights(layer: FusedMoE, seed: int) -> None:
    moe = layer.moe
    gen = torch.Generator().manual_seed(seed)
    k, i = moe.hidden_size, moe.intermediate_size
    for e in range(moe.num_experts):
        for shard, shape, fan_in in (
            ("w1", (i, k), k),
            ("w3", (i, k), k),
            ("w2", (k, i), i),
        ):
            w = torch.randn(shape, generator=gen) / fan_in**0.5
            layer.weight_loader(w.to(layer.device), shard, e)


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


RELOAD_SCHEMES = {**SCHEMES, "marlin": QuantScheme.W4A16_UINT4}


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
        x = x + self.first(x, self.gate(x.float()))
        return x + self.second(x, self.gate(x.float()))


def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
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
@pytest.mark.parametrize("backend", list(SCHEMES))
def test_cuda_graph_replay_with_new_routing(workspace_init, backend):
    moe = moe_config("cuda", scheme=SCHEMES[backend])
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
        ref = torch_moe_reference(hidden, w13, w2, weights, ids, None)
        assert relative_error(out, ref) < TOLERANCE[backend]


# -- bad configs -------------------------------------------------------------------


def test_bad_configs(device):
    with pytest.raises(ValueError, match="experts_per_token"):
        moe_config(device, experts_per_token=0)
    with pytest.raises(ValueError, match="ep_size"):
        moe_config(device, ep_size=3)
    with pytest.raises(ValueError, match="in_dtype"):
        FusedMoEConfig(8, 2, 128, 64, in_dtype=torch.float32)
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
    layer = FusedMoE(moe, prefix=f"test.partial.{next(_layer_ids)}", device=device)
    load_random_weights(layer, seed=0)
    layer.process_weights_after_loading()  # complete: fine
    fp8 = moe_config(device, scheme=QuantScheme.FP8_PER_TOKEN, experts_per_token=2)
    layer = FusedMoE(fp8, prefix=f"test.partial.{next(_layer_ids)}", device=device)
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
    stacked = FusedMoE(moe, prefix=f"test.stacked.{next(_layer_ids)}", device=device)
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


def test_bad_inputs_are_named(workspace_init, device):
    moe = moe_config(device, experts_per_token=2)
    kernel = FusedMoEModularKernel(
        MoEPrepareAndFinalizeNoEP(), GroupedMMExperts(moe, *random_weights(moe, device))
    )
    x = torch.randn(3, moe.hidden_size, device=device, dtype=moe.in_dtype)
    w, ids = fused_topk(x, torch.randn(3, moe.num_experts, device=device), 2, True)
    for args, name in (
        ((x.float(), w, ids), "hidden_states"),
        ((x[:, :-8], w, ids), "hidden_states"),
        ((x, w, ids[:, :1]), "topk_ids"),
        ((x, w, ids.float()), "topk_ids"),
        ((x, w.double(), ids), "topk_weights"),
        ((x, w[:2], ids), "topk_weights"),
    ):
        with pytest.raises(ValueError, match=name):
            kernel.forward(*args)
