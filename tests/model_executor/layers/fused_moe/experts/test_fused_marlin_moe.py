"""MarlinExperts (uint4 W4A16) through the modular kernel.

Compared with the dense float64 reference on the experts' own dequantized
weights. On CPU both GEMM paths run: the plain-PyTorch reference (what CPU
tensors use) and the Triton kernel under TRITON_INTERPRET (forced, to cover
the CUDA path's plumbing); ``gpu`` tests run the kernel at model sizes.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts import fused_marlin_moe
from vllm.model_executor.layers.fused_moe.experts.fused_marlin_moe import (
    MarlinExperts,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.reference import fused_moe_reference
from vllm.model_executor.layers.fused_moe.routing import fused_topk
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    MARLIN_WORKSPACE_KEY,
    get_marlin_workspace,
)
from vllm.utils import canonical_device
from vllm.v1.worker.workspace import WorkspaceManager

CUDA = torch.cuda.is_available()
W4A16 = FusedMoEQuantConfig(QuantScheme.W4A16_UINT4)


def moe_config(device, topk: int = 2, ep_size: int = 1, **kw) -> FusedMoEConfig:
    dims: dict[str, Any] = (
        {"num_experts": 32, "hidden_size": 2048, "intermediate_size": 768}
        if torch.device(device).type == "cuda"
        else {"num_experts": 16, "hidden_size": 256, "intermediate_size": 128}
    )
    dims.update(kw)
    return FusedMoEConfig(
        experts_per_token=topk,
        ep_size=ep_size,
        ep_rank=1 if ep_size > 1 else 0,
        quant_config=W4A16,
        **dims,
    )


def random_weights(moe: FusedMoEConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    el, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
    w13 = (torch.randn(el, 2 * i, k, device=device) / k**0.5).to(moe.in_dtype)
    w2 = (torch.randn(el, k, i, device=device) / i**0.5).to(moe.in_dtype)
    return w13, w2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def use_kernel(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    monkeypatch.setattr(fused_marlin_moe, "runs_gpu_kernels", lambda a: kernel)


def spy_workspaces(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Records the lock buffer of every grouped-kernel call."""
    seen: list[torch.Tensor] = []
    gemm: Callable[..., torch.Tensor] = fused_marlin_moe.marlin_gemm_grouped

    def spy(*args, **kwargs) -> torch.Tensor:
        seen.append(args[4])
        return gemm(*args, **kwargs)

    monkeypatch.setattr(fused_marlin_moe, "marlin_gemm_grouped", spy)
    return seen


def check_moe(moe: FusedMoEConfig, tokens: int, device, tolerance: float) -> None:
    w13, w2 = random_weights(moe, device)
    experts = MarlinExperts.from_unquantized(moe, w13, w2)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(tokens, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(tokens, moe.num_experts, device=device)
    topk_weights, topk_ids = fused_topk(
        hidden, logits, moe.experts_per_token, renormalize=True
    )
    expert_map = moe.make_expert_map(device)
    out = kernel.forward(hidden, topk_weights, topk_ids, expert_map)
    dq13, dq2 = experts.dequantized_weights()
    ref = fused_moe_reference(hidden, dq13, dq2, topk_weights, topk_ids, expert_map)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert not bool(out.isnan().any())
    if bool((ref == 0).all()):
        assert bool((out == 0).all())  # no local route at all
    else:
        assert relative_error(out, ref) < tolerance
    assert int(get_marlin_workspace(device).abs().sum()) == 0


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("ep_size", [1, 4])
@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 8, 64])  # 8: the decode path's last
def test_marlin_moe_cpu(
    workspace_init, monkeypatch, tokens: int, topk: int, ep_size: int, kernel: bool
):
    if CUDA:
        pytest.skip("CPU sizes")
    torch.manual_seed(tokens * 10 + topk + ep_size)
    use_kernel(monkeypatch, kernel)
    seen = spy_workspaces(monkeypatch)
    check_moe(moe_config("cpu", topk, ep_size), tokens, "cpu", 2e-2)
    # Decode batches take the route-by-route kernels, not the grouped GEMMs
    # (nor, on a CPU, the grouped tensor-core kernels).
    sorted_path = kernel and tokens > MarlinExperts.decode_max_tokens
    assert len(seen) == (2 if sorted_path else 0)
    assert all(locks is get_marlin_workspace("cpu") for locks in seen)


def test_locks_from_manager_not_experts(
    workspace_init: WorkspaceManager, monkeypatch, device
):
    """The lock buffer is the slot's stream-scoped marlin workspace; nothing
    lock- or scratch-like lives on the experts, so they rebuild after lock."""
    torch.manual_seed(0)
    use_kernel(monkeypatch, True)
    moe = moe_config(device, topk=2)
    w13, w2 = random_weights(moe, device)
    experts = MarlinExperts.from_unquantized(moe, w13, w2)
    # the sorted path: the one with locks
    experts.decode_max_tokens = experts.grouped_max_tokens = 0
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(5, moe.hidden_size, device=device, dtype=moe.in_dtype)
    weights, ids = fused_topk(
        hidden, torch.randn(5, moe.num_experts, device=device), 2, True
    )
    before = kernel.forward(hidden, weights, ids)

    report = workspace_init.memory_report()
    # Keys of stream-scoped tensors: ((MARLIN_WORKSPACE_KEY, device), stream).
    locks = {
        r.key: r.nbytes
        for r in report.resources_of_type("Tensor")
        if isinstance(r.key, tuple)
        and r.key[0] == (MARLIN_WORKSPACE_KEY, str(canonical_device(device)))
    }
    buffer = get_marlin_workspace(device)
    assert list(locks.values()) == [buffer.nbytes] and int(buffer.abs().sum()) == 0
    assert all(isinstance(k, tuple) and k[1][0] == "stream" for k in locks)
    for value in vars(experts).values():
        if isinstance(value, torch.Tensor):
            assert value.dim() == 3  # packed weights and scales only
            assert value.untyped_storage().data_ptr() != buffer.data_ptr()

    total = workspace_init.memory_report().total_bytes
    workspace_init.lock()
    rebuilt = MarlinExperts.from_unquantized(moe, w13, w2)
    rebuilt.decode_max_tokens = rebuilt.grouped_max_tokens = 0
    after = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), rebuilt).forward(
        hidden, weights, ids
    )
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert workspace_init.memory_report().total_bytes == total
    assert int(buffer.abs().sum()) == 0


def test_workspace_shapes_cover_every_view(device):
    moe = moe_config(device, topk=8)
    experts = MarlinExperts.from_unquantized(moe, *random_weights(moe, device))
    (ws13,), (ws2,), out = experts.workspace_shapes(
        3, moe.w13_rows, moe.hidden_size, 8, moe.num_experts, moe.num_local_experts
    )
    rows, k, i, size = 24, moe.hidden_size, moe.intermediate_size, 2
    assert ws13 == rows * max(k, i) * size and ws2 == rows * max(2 * i, k) * size
    assert out == (3, k)
    assert experts.workspace_dtype(moe.in_dtype) == torch.uint8


def test_bad_configs(device):
    with pytest.raises(ValueError, match="hidden_size"):
        MarlinExperts.from_unquantized(
            moe_config(device, hidden_size=192),
            *random_weights(moe_config(device, hidden_size=192), device),
        )
    bad_inter = moe_config(device, intermediate_size=64)
    with pytest.raises(ValueError, match="intermediate_size"):
        MarlinExperts.from_unquantized(bad_inter, *random_weights(bad_inter, device))
    moe = moe_config(device)
    w13, w2 = random_weights(moe, device)
    unquantized = FusedMoEConfig(
        moe.num_experts, 2, moe.hidden_size, moe.intermediate_size
    )
    with pytest.raises(ValueError, match="quant_config"):
        MarlinExperts.from_unquantized(unquantized, w13, w2)
    with pytest.raises(ValueError, match="w13"):
        MarlinExperts.from_unquantized(moe, w13[:, :-1], w2)
    with pytest.raises(ValueError, match="w2"):
        MarlinExperts.from_unquantized(moe, w13, w2.to(torch.int32))
    experts = MarlinExperts.from_unquantized(moe, w13, w2)
    with pytest.raises(ValueError, match="w13_packed"):
        MarlinExperts(
            moe,
            experts.w13_packed.to(torch.int64),
            experts.w13_scales,
            experts.w2_packed,
            experts.w2_scales,
        )
    with pytest.raises(ValueError, match="w2_scales"):
        MarlinExperts(
            moe,
            experts.w13_packed,
            experts.w13_scales,
            experts.w2_packed,
            experts.w2_scales.float(),
        )
    hidden = torch.randn(2, moe.hidden_size, device=device)  # fp32: unsupported
    weights, ids = fused_topk(
        hidden, torch.randn(2, moe.num_experts, device=device), 2, True
    )
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    with pytest.raises(ValueError, match="hidden_states"):
        kernel.forward(hidden, weights, ids)


# -- GPU: model sizes ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("ep_size", [1, 4])
@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64, 1024])
def test_marlin_moe_gpu(workspace_init, tokens: int, topk: int, ep_size: int):
    torch.manual_seed(tokens * 10 + topk + ep_size)
    check_moe(moe_config("cuda", topk, ep_size), tokens, "cuda", 2e-2)


@pytest.mark.gpu
# the decode kernels, the grouped kernels, the sorted path
@pytest.mark.parametrize("tokens", [4, 64, 128])
def test_gpu_cuda_graph_replay_with_new_routing(workspace_init, tokens: int):
    torch.manual_seed(5)
    moe = moe_config("cuda", topk=8)
    experts = MarlinExperts.from_unquantized(moe, *random_weights(moe, "cuda"))
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(tokens, moe.hidden_size, device="cuda", dtype=moe.in_dtype)
    logits = torch.randn(tokens, moe.num_experts, device="cuda")

    def run() -> torch.Tensor:
        weights, ids = fused_topk(hidden, logits, 8, renormalize=True)
        return kernel.forward(hidden, weights, ids)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and allocate outside capture
    stream.synchronize()
    workspace_init.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = run()
    for _ in range(3):
        hidden.copy_(torch.randn_like(hidden))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):  # same stream: the same lock buffer
            expected = run()
        stream.synchronize()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    if tokens > experts.grouped_max_tokens:  # the sorted path takes locks
        with torch.cuda.stream(stream):
            assert int(get_marlin_workspace("cuda").abs().sum()) == 0
