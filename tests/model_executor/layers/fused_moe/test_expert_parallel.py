"""Expert parallelism on real gloo worlds of 2, 3 and 4 processes.

An expert-parallel FusedMoE equals the single-process layer (fp32, both
all2all backends, the default one also with the step's token counts known
on the host, uneven token counts, a rank with no tokens, every route to
one rank, experts not divisible by ranks); linear placement and its expert
map; each rank loads only its experts; no workspace growth after lock
whatever the routing; a killed worker makes the others fail with a named
error within the timeout; tensor-parallel experts routing from logits at
decode sizes still sum the ranks' outputs.
"""

import os
import time
from dataclasses import dataclass

import pytest
import torch

from tests.distributed.utils import (
    init_gloo_world,
    layout_group,
    run_workers,
    values,
)
from vllm.distributed import (
    CollectiveError,
    GroupCoordinator,
    destroy_distributed_environment,
    get_ep_group,
    initialize_model_parallel,
)
from vllm.forward_context import DPMetadata, set_forward_context
from vllm.model_executor.kernels.common.topk_softmax import top_routes_reference
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.expert_placement import ExpertPlacement
from vllm.model_executor.layers.fused_moe.experts import triton_moe
from vllm.model_executor.layers.fused_moe.layer import FusedMoE, make_experts
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    get_moe_permute_scratch,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize import ALL2ALL_BACKENDS
from vllm.model_executor.layers.fused_moe.prepare_finalize.replicated import (
    MoEPrepareAndFinalizeReplicated,
)
from vllm.v1.worker.workspace import (
    WorkspaceLockedError,
    init_workspace_manager,
    reset_workspace_manager,
)

HIDDEN, INTER = 16, 8
AG = "allgather_reducescatter"


@dataclass(frozen=True)
class Case:
    name: str
    num_experts: int
    topk: int
    tokens: tuple[int, ...]  # per rank
    to_rank: int | None = None  # every route goes to this rank's experts


CASES = {
    2: [
        Case("uneven", 8, 3, (5, 11)),
        Case("zero_tokens_on_a_rank", 8, 2, (0, 6)),
        Case("all_tokens_to_one_rank", 8, 2, (7, 4), to_rank=1),
        Case("experts_not_divisible", 7, 3, (6, 3)),
        Case("no_tokens_anywhere", 8, 2, (0, 0)),
    ],
    4: [
        Case("uneven_not_divisible", 10, 4, (5, 0, 8, 3)),
        Case("all_tokens_to_one_rank", 10, 2, (4, 6, 0, 5), to_rank=3),
    ],
}


def moe_config(case: Case, ep_size: int = 1, ep_rank: int = 0) -> FusedMoEConfig:
    return FusedMoEConfig(
        num_experts=case.num_experts,
        experts_per_token=case.topk,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        in_dtype=torch.float32,
        ep_size=ep_size,
        ep_rank=ep_rank,
    )


def full_weights(num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's weights, the same on every rank."""
    g = torch.Generator().manual_seed(num_experts)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=g) / INTER**0.5
    return w13, w2


def make_layer(
    moe: FusedMoEConfig,
    name: str,
    ep_group: GroupCoordinator | None = None,
    all2all_backend: str = AG,
) -> FusedMoE:
    layer = FusedMoE(
        moe,
        prefix=f"ep_test.{name}.{all2all_backend}.{ep_group is not None}",
        ep_group=ep_group,
        all2all_backend=all2all_backend,
    )
    layer.stacked_weight_loader(*full_weights(moe.num_experts))
    layer.process_weights_after_loading()
    return layer


def inputs(
    case: Case, rank: int, world_size: int, num_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and router logits (pushed onto one rank's experts
    when the case says so)."""
    g = torch.Generator().manual_seed(1000 * world_size + rank)
    tokens = case.tokens[rank] if num_tokens is None else num_tokens
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    logits = torch.randn(tokens, case.num_experts, generator=g)
    if case.to_rank is not None:
        owned = ExpertPlacement(case.num_experts, world_size, case.to_rank)
        logits[:, owned.local_experts.start : owned.local_experts.stop] += 20.0
    return hidden, logits


def ep_world(rank: int, world_size: int, port: int, timeout_s: float = 30.0) -> None:
    init_gloo_world(rank, world_size, port, timeout_s)
    initialize_model_parallel(data_parallel_size=world_size)


# -- in one process ----------------------------------------------------------


def test_linear_placement_gives_the_remainder_to_the_first_ranks():
    placements = [ExpertPlacement(10, 4, r) for r in range(4)]
    assert [p.num_local_experts for p in placements] == [3, 3, 2, 2]
    assert [p.local_experts for p in placements] == [
        range(0, 3),
        range(3, 6),
        range(6, 8),
        range(8, 10),
    ]
    assert placements[0].owner_map("cpu").tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    expert_map = placements[2].expert_map("cpu")
    assert expert_map is not None
    assert expert_map.dtype == torch.int32 and expert_map.is_contiguous()
    assert expert_map.tolist() == [-1] * 6 + [0, 1] + [-1] * 2
    assert ExpertPlacement(8, 1).expert_map("cpu") is None  # every expert local
    assert [ExpertPlacement(4, 4, r).local_experts for r in range(4)] == [
        range(r, r + 1) for r in range(4)
    ]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"^ep_size: expected 1..num_experts=4"):
        ExpertPlacement(4, 5)
    with pytest.raises(ValueError, match=r"^ep_rank: expected 0..1, got 2"):
        ExpertPlacement(4, 2, 2)
    with pytest.raises(ValueError, match=r"^num_experts: expected >= 1"):
        ExpertPlacement(0)
    case = CASES[2][0]
    with pytest.raises(ValueError, match=r"all2all_backend: expected one of") as info:
        FusedMoE(moe_config(case), prefix="ep_test.bad", all2all_backend="naive")
    assert all(name in str(info.value) for name in ALL2ALL_BACKENDS)
    group = layout_group("ep", [0, 1], 1)
    with pytest.raises(ValueError, match=r"ep_group: expected 4 ranks"):
        FusedMoE(moe_config(case, 4, 1), prefix="ep_test.bad", ep_group=group)
    with pytest.raises(ValueError, match=r"moe.ep_rank=0"):
        FusedMoE(moe_config(case, 2, 0), prefix="ep_test.bad", ep_group=group)


@pytest.mark.parametrize("ep_rank", [1, 3])
def test_each_rank_loads_only_its_experts(ep_rank):
    """Per-expert shards of remote experts are skipped; the layer holds
    [local_experts, ...] weights equal to its experts' slice."""
    moe = moe_config(Case("load", 10, 2, ()), ep_size=4, ep_rank=ep_rank)
    layer = FusedMoE(moe, prefix=f"ep_test.load.{ep_rank}")
    w13, w2 = full_weights(10)
    local = moe.placement.local_experts
    assert layer.w13_weight is not None and layer.w2_weight is not None
    assert layer.w13_weight.shape == (len(local), 2 * INTER, HIDDEN)
    for e in range(10):
        layer.weight_loader(w13[e, :INTER], "w1", e)
        layer.weight_loader(w13[e, INTER:], "w3", e)
        layer.weight_loader(w2[e], "w2", e)
    assert torch.equal(layer.w13_weight, w13[local.start : local.stop])
    assert torch.equal(layer.w2_weight, w2[local.start : local.stop])
    layer.process_weights_after_loading()  # nothing local is missing


# -- spawned worlds ----------------------------------------------------------


def _parity_worker(rank: int, world_size: int, port: int) -> dict[str, float]:
    """Max |EP - single process| per case and backend on this rank's tokens."""
    ep_world(rank, world_size, port)
    init_workspace_manager("cpu")
    try:
        errors: dict[str, float] = {}
        for case in CASES[world_size]:
            hidden, logits = inputs(case, rank, world_size)
            ref = make_layer(moe_config(case), case.name)(hidden, logits)
            assert hidden.shape[0] == 0 or ref.abs().max() > 0
            moe = moe_config(case, world_size, rank)
            # the engine's steps: every rank's count known before the step
            counts = DPMetadata(list(case.tokens))
            for backend, dp in (*((b, None) for b in ALL2ALL_BACKENDS), (AG, counts)):
                layer = make_layer(moe, case.name, get_ep_group(), backend)
                assert layer.w13_weight is not None  # grouped_mm keeps it
                assert layer.w13_weight.shape[0] == moe.num_local_experts
                with set_forward_context(None, dp):
                    out = layer(hidden, logits)
                assert out.shape == ref.shape and out.dtype == ref.dtype
                diff = (out - ref).abs().max().item() if out.numel() else 0.0
                errors[f"{case.name}/{backend}{'+dp' if dp else ''}"] = diff
        # counts that do not name this rank's tokens, on every rank alike
        wrong = DPMetadata([case.tokens[rank]] * (world_size + 1))
        with set_forward_context(None, wrong), pytest.raises(ValueError) as info:
            layer(hidden, logits)
        assert str(info.value).startswith(f"dp_metadata: expected {world_size} ")
        return errors
    finally:
        reset_workspace_manager()
        destroy_distributed_environment()


@pytest.fixture(scope="module", params=sorted(CASES))
def parity(request) -> tuple[int, list[dict[str, float]]]:
    """One spawned world per size runs every case (spawns are the cost)."""
    world_size = request.param
    return world_size, values(run_workers(_parity_worker, world_size))


def test_ep_layer_equals_the_single_process_layer(parity):
    world_size, per_rank = parity
    expected = {
        f"{case.name}/{backend}"
        for case in CASES[world_size]
        for backend in (*ALL2ALL_BACKENDS, f"{AG}+dp")
    }
    for rank, errors in enumerate(per_rank):
        assert set(errors) == expected
        bad = {k: v for k, v in errors.items() if v > 1e-5}
        assert not bad, f"rank {rank} of {world_size}: {bad}"


def _lock_worker(rank: int, world_size: int, port: int) -> dict[str, dict]:
    ep_world(rank, world_size, port)
    try:
        budget = 8  # tokens per rank the engine would warm up at
        case = Case("lock", 8, 2, (budget,) * world_size)
        moe = moe_config(case, world_size, rank)
        results = {}
        for backend in ALL2ALL_BACKENDS:  # one manager each: nothing shared
            reset_workspace_manager()
            manager = init_workspace_manager("cpu")
            layer = make_layer(moe, case.name, get_ep_group(), backend)
            # Warm-up where every rank keeps its tokens: all2all then
            # receives only its own, the least any routing sends it.
            layer(*inputs(Case("local", 8, 2, case.tokens, rank), rank, world_size))
            scratch = get_moe_permute_scratch(
                num_experts=8, num_local_experts=moe.num_local_experts, device="cpu"
            )
            before = (manager.memory_report().total_bytes, scratch.capacity)
            manager.lock()
            for tokens, to_rank in ((budget, 0), (budget, 1), (3, 0), (0, None)):
                skewed = Case("skewed", 8, 2, case.tokens, to_rank)
                layer(*inputs(skewed, rank, world_size, tokens))
            after = (manager.memory_report().total_bytes, scratch.capacity)
            over = budget + 1 if rank == 0 else budget
            with pytest.raises(WorkspaceLockedError) as info:
                layer(*inputs(case, rank, world_size, over))
            # Every rank refused before any exchange of outputs: still in step.
            layer(*inputs(case, rank, world_size, 2))
            results[backend] = {
                "before": before,
                "after": after,
                "refused": str(info.value),
            }
        return results
    finally:
        reset_workspace_manager()
        destroy_distributed_environment()


def test_no_growth_after_lock_whatever_the_routing():
    """Buffers are sized for the most tokens any rank can receive in a step
    (all ranks' tokens), so after a warm-up at the token budget every
    routing fits; one more token is refused on every rank alike."""
    for per_backend in values(run_workers(_lock_worker, 2)):
        assert set(per_backend) == set(ALL2ALL_BACKENDS)
        for r in per_backend.values():
            assert r["before"] == r["after"]
            assert r["before"][1] == 2 * 8 * 2  # rows: 2 ranks x 8 tokens x top-2
            assert "Workspace is locked" in r["refused"]


def _killed_worker(rank: int, world_size: int, port: int) -> dict:
    # No teardown on purpose: the world is broken once a peer is gone.
    ep_world(rank, world_size, port, timeout_s=10.0)
    case = Case("killed", 6, 2, (4,) * world_size)
    layer = make_layer(moe_config(case, world_size, rank), case.name, get_ep_group())
    hidden, logits = inputs(case, rank, world_size)
    for step in range(200):
        if rank == world_size - 1 and step == 2:
            os._exit(1)  # dies mid-run, without a word to its peers
        start = time.monotonic()
        try:
            layer(hidden, logits)
        except CollectiveError as e:
            return {"step": step, "waited": time.monotonic() - start, "error": str(e)}
    return {"step": None}


def test_a_killed_worker_makes_the_others_fail_within_the_timeout():
    results = run_workers(_killed_worker, 3, timeout_s=60.0)
    assert results[2].exitcode == 1 and results[2].value is None
    for r in values(results[:2]):
        assert r["step"] == 2, r
        assert r["waited"] < 10.0
        assert "in the ep group (ranks [0, 1, 2]) failed" in r["error"]


def _routed_replicated_worker(rank: int, world_size: int, port: int) -> list[float]:
    """Decode kernels routing from the logits (the interpreter's), each rank
    its experts of the same tokens, then the all-reduce: the single-process
    output, as the routing by ids gives it (errors relative to it)."""
    ep_world(rank, world_size, port)
    init_workspace_manager("cpu")
    try:
        triton_moe.runs_gpu_kernels = lambda t: True
        dims = dict(num_experts=8, experts_per_token=2, hidden_size=HIDDEN,
                    intermediate_size=INTER, in_dtype=torch.bfloat16)  # fmt: skip
        moe = FusedMoEConfig(**dims, ep_size=world_size, ep_rank=rank)  # type: ignore[arg-type]
        w13, w2 = (w.bfloat16() for w in full_weights(8))
        mine = slice(
            moe.placement.local_experts.start, moe.placement.local_experts.stop
        )
        experts = make_experts(moe, w13[mine], w2[mine], "triton")
        group = MoEPrepareAndFinalizeReplicated(get_ep_group())
        kernel = FusedMoEModularKernel(group, experts)
        one_process = make_experts(FusedMoEConfig(**dims), w13, w2, "triton")  # type: ignore[arg-type]
        single = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), one_process)
        g = torch.Generator().manual_seed(world_size)  # the same on every rank
        hidden = torch.randn(3, HIDDEN, generator=g).bfloat16()
        logits = torch.randn(3, 8, generator=g).bfloat16()
        assert kernel.routes_from_logits(hidden)
        weights, ids = top_routes_reference(logits, 2, True)
        expected = single.forward(hidden, weights, ids).float()
        expert_map = moe.make_expert_map("cpu")
        outs = (
            kernel.forward_routed(hidden, logits, True, expert_map),
            kernel.forward(hidden, weights, ids, expert_map),
        )
        scale = expected.abs().max()
        return [((out.float() - expected).abs().max() / scale).item() for out in outs]
    finally:
        reset_workspace_manager()
        destroy_distributed_environment()


def test_tensor_parallel_routed_decode_sums_the_ranks():
    per_rank = values(run_workers(_routed_replicated_worker, 2))
    for rank, (routed, by_ids) in enumerate(per_rank):
        assert routed < 2e-2 and by_ids < 2e-2, f"rank {rank}: {routed}, {by_ids}"
