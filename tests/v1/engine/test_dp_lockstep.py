"""The lockstep protocol on 2 real gloo ranks: a command without orders
(one broadcast of a number) and one with orders arrive whole, in order, and
every rank's report reaches rank 0, in one block each or, past a block's
size, whole in a second round."""

from datetime import timedelta

from tests.distributed.utils import init_gloo_world, run_workers, values
from vllm.distributed import destroy_distributed_environment
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.dp_lockstep import ControlGroups, NewRequest, StepCommand

NEW = NewRequest("r0", [1, 2, 3], SamplingParams(max_tokens=4), None)


def _worker(rank: int, world_size: int, port: int) -> dict:
    init_gloo_world(rank, world_size, port)
    try:
        control = ControlGroups.create(timedelta(seconds=30))
        empty = StepCommand([[], []], [[], []])
        orders = StepCommand([[], [NEW]], [[("old", "abort")], []])
        received = [
            control.broadcast_command(command if rank == 0 else None)
            for command in (empty, orders, empty)
        ]
        big = "x" * 100_000 if rank == 1 else "small"  # past one block
        return {
            "received": received,
            "gathered": control.gather("reports", f"rank {rank}", rank),
            "gathered_big": control.gather("reports", big, rank),
        }
    finally:
        destroy_distributed_environment()


def test_commands_and_reports_travel_whole():
    ranks = values(run_workers(_worker, 2))
    for result in ranks:
        empty, orders, again = result["received"]
        assert empty == again == StepCommand([[], []], [[], []])
        assert orders.adds == [[], [NEW]] and orders.aborts == [[("old", "abort")], []]
    assert ranks[0]["gathered"] == ["rank 0", "rank 1"]
    assert ranks[0]["gathered_big"] == ["small", "x" * 100_000]
    assert ranks[1]["gathered"] == ranks[1]["gathered_big"] == []
