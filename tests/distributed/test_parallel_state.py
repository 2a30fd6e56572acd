"""Process groups over real gloo worlds: layout, collectives, teardown,
errors named, a communicator per ubatch, and a silent peer ends in an error
within the timeout."""

import time
from datetime import timedelta

import pytest
import torch

from tests.distributed.utils import init_gloo_world, run_workers, values
from vllm.distributed import (
    CollectiveError,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_distributed_init_method,
    get_dp_group,
    get_ep_group,
    get_open_port,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.v1.worker.ubatching import run_ubatches, ubatch_context


@pytest.fixture
def solo_world():
    """A real one-process gloo world, left afterwards."""
    init_distributed_environment(
        1,
        0,
        get_distributed_init_method("127.0.0.1", get_open_port()),
        backend="gloo",
        timeout=timedelta(seconds=10),
    )
    try:
        yield get_world_group()
    finally:
        destroy_distributed_environment()


def test_groups_before_init_name_the_missing_call():
    with pytest.raises(RuntimeError, match=r"init_distributed_environment\(\)"):
        get_world_group()
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel\(\)"):
        get_ep_group()
    assert not model_parallel_is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"world_size": 0, "rank": 0}, "world_size"),
        ({"world_size": 2, "rank": 2}, "rank"),
        ({"world_size": 1, "rank": 0, "backend": "mpi"}, "backend"),
    ],
)
def test_bad_world_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        init_distributed_environment(
            distributed_init_method="tcp://127.0.0.1:1", **kwargs
        )


def test_env_rendezvous_needs_master_addr_and_port(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        init_distributed_environment(1, 0, backend="gloo")


def test_env_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(get_open_port()))
    world = init_distributed_environment(1, 0, backend="gloo")
    try:
        assert (world.world_size, world.rank_in_group) == (1, 0)
    finally:
        destroy_distributed_environment()


def test_solo_world_groups_and_teardown(solo_world):
    with pytest.raises(RuntimeError, match="already initialized"):
        init_distributed_environment(1, 0, backend="gloo")
    with pytest.raises(ValueError, match="tensor_model_parallel_size x"):
        initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size: expected >= 1"):
        initialize_model_parallel(data_parallel_size=0)
    initialize_model_parallel()
    ep = get_ep_group()
    assert (ep.ranks, ep.device_group) == ([0], None)  # no peers, no communicator
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(ep.all_gather(x), x) and torch.equal(ep.reduce_scatter(x), x)
    with pytest.raises(RuntimeError, match="already initialized"):
        initialize_model_parallel()


def _layout_worker(rank: int, world_size: int, port: int) -> dict:
    init_gloo_world(rank, world_size, port)
    try:
        initialize_model_parallel(tensor_model_parallel_size=2, data_parallel_size=2)
        tp, dp, ep = get_tp_group(), get_dp_group(), get_ep_group()
        out: dict = {"tp": tp.ranks, "dp": dp.ranks, "ep": ep.ranks}
        x = torch.full((2, 3), float(rank))
        out["all_gather"] = ep.all_gather(x)
        out["tp_all_gather"] = tp.all_gather(x)
        out["reduce_scatter"] = ep.reduce_scatter(torch.arange(8.0).view(8, 1) * rank)
        out["empty_gather"] = ep.all_gather(torch.empty(0, 3)).shape
        # fp8 travels as bytes (gloo has no float8 types)
        fp8 = torch.full((1, 4), rank / 2).to(torch.float8_e4m3fn)
        out["fp8_gather"] = ep.all_gather(fp8).float()
        # Uneven all-to-all: rank r sends r + 1 rows to each peer.
        send = torch.full((4 * (rank + 1), 2), float(rank))
        recv = torch.empty(sum(r + 1 for r in range(4)), 2)
        ep.all_to_all_single(recv, send, [r + 1 for r in range(4)], [rank + 1] * 4)
        out["all_to_all"] = recv[:, 0]
        with pytest.raises(ValueError, match="input_split_sizes: expected 4 sizes"):
            ep.all_to_all_single(recv, send, [r + 1 for r in range(4)], [1, 1])
        # Teardown, then a new layout in the same world.
        destroy_model_parallel()
        initialize_model_parallel(data_parallel_size=world_size)
        out["dp_after_reinit"] = get_dp_group().ranks
        out["sum_after_reinit"] = get_dp_group().all_reduce(torch.ones(1)).item()
        return out
    finally:
        destroy_distributed_environment()


def test_four_rank_layout_and_collectives():
    results = values(run_workers(_layout_worker, 4))
    for rank, r in enumerate(results):
        assert r["tp"] == [rank // 2 * 2, rank // 2 * 2 + 1]  # consecutive runs
        assert r["dp"] == [rank % 2, rank % 2 + 2]  # stride tp
        assert r["ep"] == [0, 1, 2, 3]
        expected = torch.arange(4.0).repeat_interleave(2)[:, None].expand(8, 3)
        assert torch.equal(r["all_gather"], expected)
        pair = torch.tensor(r["tp"], dtype=torch.float32).repeat_interleave(2)
        assert torch.equal(r["tp_all_gather"], pair[:, None].expand(4, 3))
        rows = torch.arange(8.0).view(8, 1) * 6  # sum of ranks 0..3
        assert torch.equal(r["reduce_scatter"], rows[2 * rank : 2 * rank + 2])
        assert r["empty_gather"] == (0, 3)
        assert r["fp8_gather"].flatten().tolist() == [
            v for q in range(4) for v in [q / 2] * 4
        ]
        assert r["all_to_all"].tolist() == [
            float(src) for src in range(4) for _ in range(src + 1)
        ]
        assert r["dp_after_reinit"] == [0, 1, 2, 3]
        assert r["sum_after_reinit"] == 4.0


def _ubatch_worker(rank: int, world_size: int, port: int) -> dict:
    init_gloo_world(rank, world_size, port)
    try:
        initialize_model_parallel(data_parallel_size=world_size, num_ubatches=2)
        ep = get_ep_group()

        def ubatch(scale: float, delay: float) -> list[float]:
            # The ranks reach their collectives in opposite ubatch order: on a
            # shared communicator rank 0's ubatch 0 would meet rank 1's ubatch 1.
            time.sleep(delay)
            return [
                ep.all_reduce(torch.full((1,), scale * (rank + 1) + i)).item()
                for i in range(3)
            ]

        late = 0.3 if rank == 0 else 0.0
        sums = run_ubatches(
            [lambda: ubatch(1.0, late), lambda: ubatch(100.0, 0.3 - late)]
        )
        destroy_model_parallel()
        initialize_model_parallel(data_parallel_size=world_size)
        with ubatch_context(1), pytest.raises(RuntimeError) as info:
            get_ep_group().all_reduce(torch.ones(1))
        return {"sums": sums, "error": str(info.value)}
    finally:
        destroy_distributed_environment()


def test_each_ubatch_has_its_own_communicator():
    for r in values(run_workers(_ubatch_worker, 2)):
        # ubatch 0: 1 + 2 (+ 2i), ubatch 1: 100 + 200 (+ 2i)
        assert r["sums"] == [[3.0, 5.0, 7.0], [300.0, 302.0, 304.0]]
        assert r["error"].startswith(
            "ubatch 1: the ep group has communicators for 1 ubatches"
        )


def _silent_peer_worker(rank: int, world_size: int, port: int) -> float:
    init_gloo_world(rank, world_size, port, timeout_s=2.0)
    try:
        group = get_world_group()
        group.barrier()
        if rank == 1:
            time.sleep(3.5)  # alive but never joins the collective
            return 0.0
        start = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            group.all_gather(torch.ones(1, 4))
        message = str(info.value)
        assert (
            "all_gather in the world group (ranks [0, 1]) failed on rank 0" in message
        )
        assert "timeout 2s" in message
        return time.monotonic() - start
    finally:
        destroy_distributed_environment()


def test_a_silent_peer_ends_in_a_named_error_within_the_timeout():
    waited = values(run_workers(_silent_peer_worker, 2))[0]
    assert 1.5 < waited < 4.0
