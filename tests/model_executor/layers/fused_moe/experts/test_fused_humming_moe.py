"""HummingGroupedExperts (humming-kernels grouped GEMMs) through the modular kernel.

GPU tests compare every scheme with the dense float64 reference on the
experts' own dequantized weights, and check where buffers live: activations
in workspace13, Stream-K locks in the workspace manager. They need the
``humming`` package; every distinct kernel config JIT-compiles once (seconds),
so the dims and the set of row counts stay small. CPU tests cover the errors.
"""

import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts import fused_humming_moe
from vllm.model_executor.layers.fused_moe.experts.fused_humming_moe import (
    HUMMING_LOCKS_KEY,
    HummingGroupedExperts,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    MoEPermuteScratch,
)
from vllm.model_executor.layers.fused_moe.reference import fused_moe_reference
from vllm.v1.worker.workspace import WorkspaceManager, reset_workspace_manager

NUM_EXPERTS, HIDDEN, INTER = 32, 2048, 768
TOLERANCE = {  # relative error against the dequantized weights
    QuantScheme.W4A16_UINT4: 2e-2,
    QuantScheme.W4A16_MXFP4: 2e-2,
    QuantScheme.FP8_PER_TOKEN: 6e-2,  # activations are quantized too
    QuantScheme.FP8_BLOCK: 6e-2,
}
SCHEME_IDS = [s.value for s in TOLERANCE]


def moe_config(
    scheme: QuantScheme,
    ep: bool = False,
    activation: str = "silu",
    topk: int = 8,
    **dims: Any,
) -> FusedMoEConfig:
    sizes: dict[str, Any] = {
        "num_experts": NUM_EXPERTS,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
    }
    sizes.update(dims)
    return FusedMoEConfig(
        experts_per_token=topk,
        activation=activation,
        ep_size=4 if ep else 1,
        ep_rank=1 if ep else 0,
        quant_config=FusedMoEQuantConfig(scheme),
        **sizes,
    )


def random_weights(
    moe: FusedMoEConfig, device: torch.device | str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    el, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
    w13 = torch.randn(el, 2 * i, k, generator=gen) / k**0.5
    w2 = torch.randn(el, k, i, generator=gen) / i**0.5
    return w13.to(device, torch.bfloat16), w2.to(device, torch.bfloat16)


@functools.cache
def cached_experts(
    scheme: QuantScheme, ep: bool, activation: str = "silu", topk: int = 8
) -> tuple[HummingGroupedExperts, torch.Tensor, torch.Tensor]:
    """Experts plus their dequantized weights as CPU float64 (reference input).

    The weights depend on neither ``topk`` nor the call: one set per scheme."""
    moe = moe_config(scheme, ep, activation, topk)
    experts = HummingGroupedExperts.from_unquantized(moe, *random_weights(moe, "cuda"))
    w13, w2 = experts.dequantized_weights()
    return experts, w13.cpu().double(), w2.cpu().double()


def routing(
    num_tokens: int, topk: int, num_experts: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token and softmax weights (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    weights = torch.randn(num_tokens, topk, generator=gen).softmax(dim=-1)
    return ids.to("cuda", torch.int32), weights.cuda()


def run_and_check(
    experts: HummingGroupedExperts,
    w13: torch.Tensor,
    w2: torch.Tensor,
    num_tokens: int,
    seed: int = 0,
) -> float:
    moe = experts.moe
    topk = moe.experts_per_token
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(num_tokens, moe.hidden_size, generator=gen)
    hidden = hidden.to("cuda", torch.bfloat16)
    ids, weights = routing(num_tokens, topk, moe.num_experts, seed)
    expert_map = moe.make_expert_map("cuda")
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    out = kernel.forward(hidden, weights, ids, expert_map)
    ref = fused_moe_reference(
        hidden,
        w13,
        w2,
        weights,
        ids,
        None if expert_map is None else expert_map.cpu(),
        moe.activation,
    )
    out64 = out.double().cpu()
    assert torch.isfinite(out64).all()
    if ref.norm() == 0:  # every route non-local: every row must be zero
        assert out64.abs().max() == 0
        return 0.0
    return float((out64 - ref).norm() / ref.norm())


# -- accuracy ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("ep", [False, True], ids=["no_ep", "ep4"])
@pytest.mark.parametrize("scheme", list(TOLERANCE), ids=SCHEME_IDS)
def test_matches_reference(
    workspace_init: WorkspaceManager, scheme: QuantScheme, ep: bool
) -> None:
    pytest.importorskip("humming")
    errors = {}
    for topk in (1, 2, 8):
        experts, w13, w2 = cached_experts(scheme, ep, topk=topk)
        for num_tokens in (1, 7, 64, 1024):
            errors[num_tokens, topk] = run_and_check(
                experts, w13, w2, num_tokens, seed=num_tokens * 10 + topk
            )
    worst = max(errors.values())
    assert worst < TOLERANCE[scheme], errors


@pytest.mark.gpu
def test_swiglu_activation(workspace_init: WorkspaceManager) -> None:
    pytest.importorskip("humming")
    for num_tokens, topk in ((7, 2), (64, 8)):
        experts, w13, w2 = cached_experts(
            QuantScheme.W4A16_UINT4, False, "swiglu", topk
        )
        error = run_and_check(experts, w13, w2, num_tokens)
        assert error < TOLERANCE[QuantScheme.W4A16_UINT4]


# -- where buffers live --------------------------------------------------------


def _inside(view: torch.Tensor, workspace: torch.Tensor) -> bool:
    start = workspace.data_ptr()
    return start <= view.data_ptr() and (
        view.data_ptr() + view.nbytes <= start + workspace.numel()
    )


@pytest.fixture
def record_workspaces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.Tensor]]:
    """workspace13 of every HummingGroupedExperts.apply call."""
    seen: list[torch.Tensor] = []
    apply = HummingGroupedExperts.apply

    def spy(self: HummingGroupedExperts, *args: Any) -> None:
        seen.append(args[6])
        apply(self, *args)

    monkeypatch.setattr(HummingGroupedExperts, "apply", spy)
    yield seen


@pytest.mark.gpu
def test_prequantized_fp8_permutes_into_workspace13(
    workspace_init: WorkspaceManager,
    record_workspaces: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("humming")
    permuted: list[torch.Tensor] = []
    moe_permute = fused_humming_moe.moe_permute

    def spy(*args: Any, **kwargs: Any) -> Any:
        permuted.append(kwargs["permuted_hidden_states"])
        permuted.append(kwargs["permuted_a1q_scale"])
        return moe_permute(*args, **kwargs)

    monkeypatch.setattr(fused_humming_moe, "moe_permute", spy)
    experts, w13, w2 = cached_experts(QuantScheme.FP8_BLOCK, False, topk=2)
    assert run_and_check(experts, w13, w2, 64) < TOLERANCE[QuantScheme.FP8_BLOCK]
    buffer, scales = permuted
    (workspace13,) = record_workspaces
    assert buffer.dtype == torch.float8_e4m3fn
    assert buffer.shape == (64 * 2, HIDDEN)
    assert _inside(buffer, workspace13)
    # The 1x128 group scales move with their rows, into workspace13 as well.
    assert scales.dtype == torch.float32 and scales.shape == (64 * 2, HIDDEN // 128)
    assert _inside(scales, workspace13)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "scheme, dtype",
    [
        (QuantScheme.W4A16_UINT4, torch.bfloat16),
        (QuantScheme.FP8_PER_TOKEN, torch.float8_e4m3fn),
    ],
    ids=["uint4", "fp8_per_token"],
)
def test_scatter_quantizes_into_workspace13(
    workspace_init: WorkspaceManager,
    record_workspaces: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    scheme: QuantScheme,
    dtype: torch.dtype,
) -> None:
    forward = pytest.importorskip("humming.forward")
    calls: list[dict[str, Any]] = []
    process = forward.may_process_input

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return process(*args, **kwargs)

    monkeypatch.setattr(forward, "may_process_input", spy)
    experts, w13, w2 = cached_experts(scheme, True)
    assert run_and_check(experts, w13, w2, 64) < TOLERANCE[scheme]
    (workspace13,) = record_workspaces
    scatter, activation = calls
    assert scatter["layout"] == "scatter"
    # T x topk rows: targets of non-local routes stay in bounds.
    assert scatter["outputs"].shape == (64 * 8, HIDDEN)
    assert scatter["outputs"].dtype == dtype
    assert _inside(scatter["outputs"], workspace13)
    assert activation["activation_type"] == "binary_split"
    assert _inside(activation["outputs"], workspace13)
    # The scratch keeps index metadata only.
    report = workspace_init.memory_report()
    (scratch,) = report.resources_of_type("MoEPermuteScratch")
    assert scratch.nbytes < 64 * 8 * HIDDEN


@pytest.mark.gpu
def test_locks_come_from_the_manager(workspace_init: WorkspaceManager) -> None:
    pytest.importorskip("humming")
    for num_tokens, topk in ((7, 8), (64, 2)):
        experts, w13, w2 = cached_experts(QuantScheme.W4A16_UINT4, False, topk=topk)
        run_and_check(experts, w13, w2, num_tokens)
    device = torch.device("cuda", torch.cuda.current_device())
    key = (HUMMING_LOCKS_KEY, str(device))
    resources = [
        r
        for s in workspace_init.memory_report().slots
        for r in s.resources
        if r.kind == "tensor" and isinstance(r.key, tuple) and r.key[0] == key
    ]
    assert len(resources) == 1
    (resource,) = resources
    assert isinstance(resource.key, tuple)
    assert resource.key[1][0] == "stream"  # one buffer per stream
    numel = resource.nbytes // 4
    assert numel >= 145
    locks = workspace_init.get_persistent(
        key, (numel,), torch.int32, zero_init=True, per_stream=True
    )
    torch.cuda.synchronize()
    assert int(locks.count_nonzero()) == 0  # every kernel leaves them at zero

    # Nothing lock-like or scratch-like is stored on the experts object.
    def reachable(obj: object) -> Iterator[object]:
        yield obj
        if isinstance(obj, dict):
            children: Any = obj.values()
        elif isinstance(obj, (list, tuple)):
            children = obj
        elif type(obj).__module__.startswith("vllm"):
            children = vars(obj).values()
        else:
            return
        for child in children:
            yield from reachable(child)

    for obj in reachable(experts):
        assert not isinstance(obj, MoEPermuteScratch)
        if isinstance(obj, torch.Tensor):
            assert obj.untyped_storage().data_ptr() != locks.data_ptr()
            assert not (obj.dim() == 1 and obj.dtype == torch.int32)


@pytest.mark.gpu
def test_runs_without_manager() -> None:
    pytest.importorskip("humming")
    reset_workspace_manager()
    experts, w13, w2 = cached_experts(QuantScheme.W4A16_MXFP4, False, topk=2)
    assert run_and_check(experts, w13, w2, 7) < TOLERANCE[QuantScheme.W4A16_MXFP4]


@pytest.mark.gpu
def test_cuda_graph_after_lock(workspace_init: WorkspaceManager) -> None:
    pytest.importorskip("humming")
    experts, w13, w2 = cached_experts(QuantScheme.W4A16_UINT4, True)
    moe = experts.moe
    num_tokens, topk = 64, 8
    hidden = torch.zeros(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, weights = routing(num_tokens, topk, NUM_EXPERTS, seed=3)
    expert_map = moe.make_expert_map("cuda")
    assert expert_map is not None
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up on the capture stream
        kernel.forward(hidden, weights, ids, expert_map)
    stream.synchronize()
    workspace_init.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = kernel.forward(hidden, weights, ids, expert_map)
    for seed in (4, 5):
        gen = torch.Generator().manual_seed(seed)
        hidden.copy_(torch.randn(num_tokens, HIDDEN, generator=gen))
        new_ids, new_weights = routing(num_tokens, topk, NUM_EXPERTS, seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_moe_reference(
            hidden, w13, w2, weights, ids, expert_map.cpu(), moe.activation
        )
        error = (out.double().cpu() - ref).norm() / ref.norm()
        assert error < TOLERANCE[QuantScheme.W4A16_UINT4]


# -- errors (CPU) --------------------------------------------------------------


def small_config(scheme: QuantScheme = QuantScheme.W4A16_UINT4) -> FusedMoEConfig:
    return moe_config(scheme, num_experts=8, hidden_size=256, intermediate_size=128)


def test_without_humming_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "humming", None)  # import humming fails
    moe = small_config()
    with pytest.raises(ValueError, match="humming-kernels"):
        HummingGroupedExperts.from_unquantized(moe, *random_weights(moe, "cpu"))


def test_without_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "humming", types.ModuleType("humming"))
    moe = small_config()
    with pytest.raises(ValueError, match=r"w13: .*CUDA device"):
        HummingGroupedExperts.from_unquantized(moe, *random_weights(moe, "cpu"))


@pytest.mark.parametrize(
    "moe, match",
    [
        (small_config(QuantScheme.UNQUANTIZED), "moe.quant_config.scheme"),
        (
            moe_config(QuantScheme.W4A16_UINT4, hidden_size=192, intermediate_size=128),
            "moe.hidden_size: .*multiple of 128",
        ),
        (
            moe_config(QuantScheme.W4A16_MXFP4, hidden_size=256, intermediate_size=48),
            "moe.intermediate_size: .*multiple of 32",
        ),
    ],
    ids=["unquantized", "hidden_alignment", "intermediate_alignment"],
)
def test_unsupported_config_is_named(moe: FusedMoEConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HummingGroupedExperts.from_unquantized(moe, *random_weights(moe, "cpu"))


def test_bad_weight_shape_is_named() -> None:
    moe = small_config()
    w13, w2 = random_weights(moe, "cpu")
    with pytest.raises(ValueError, match="w2: expected"):
        HummingGroupedExperts.from_unquantized(moe, w13, w2.transpose(1, 2))
