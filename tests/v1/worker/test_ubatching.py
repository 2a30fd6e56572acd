import threading
import time

import pytest

from vllm.v1.worker.ubatching import (
    balanced_split,
    collective_turn,
    dbo_current_ubatch_id,
    run_ubatches,
    ubatch_context,
)


def test_ubatch_context_nests_restores_and_checks():
    assert dbo_current_ubatch_id() == 0
    with ubatch_context(1):
        assert dbo_current_ubatch_id() == 1
        with ubatch_context(0):
            assert dbo_current_ubatch_id() == 0
        assert dbo_current_ubatch_id() == 1
    assert dbo_current_ubatch_id() == 0
    with (
        pytest.raises(ValueError, match="ubatch_id must be >= 0, got -1"),
        ubatch_context(-1),
    ):
        pass


def test_run_ubatches_runs_each_as_its_ubatch_on_its_own_thread():
    seen: dict[int, tuple[int, int]] = {}

    def work(i: int) -> int:
        seen[i] = (dbo_current_ubatch_id(), threading.get_ident())
        return 10 * i

    assert run_ubatches([lambda: work(0), lambda: work(1)]) == [0, 10]
    assert [seen[i][0] for i in (0, 1)] == [0, 1]
    # Not the caller's thread (ids of finished threads may be reused).
    assert threading.get_ident() not in (seen[0][1], seen[1][1])
    assert dbo_current_ubatch_id() == 0


def test_run_ubatches_reraises_after_all_finish():
    finished = []

    def fail() -> None:
        raise RuntimeError("ubatch 0 failed")

    def finish() -> None:
        finished.append(dbo_current_ubatch_id())

    with pytest.raises(RuntimeError, match="ubatch 0 failed"):
        run_ubatches([fail, finish])
    assert finished == [1]


def test_collectives_alternate_between_ubatches_whatever_their_speed():
    """Ubatch 1 reaches each collective first (ubatch 0 sleeps before each),
    yet they issue in turns from ubatch 0: the order every rank shares. A
    ubatch with fewer collectives finishes, and the other's are not held up."""
    issued: list[tuple[int, int]] = []

    def ubatch(count: int, delay: float) -> None:
        for i in range(count):
            time.sleep(delay)
            with collective_turn():
                issued.append((dbo_current_ubatch_id(), i))

    run_ubatches([lambda: ubatch(3, 0.05), lambda: ubatch(5, 0.0)])
    assert issued == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4)]
    with collective_turn():  # outside run_ubatches: no turns
        pass


def test_balanced_split_cuts_nearest_half_the_tokens():
    assert balanced_split([]) == 0
    assert balanced_split([7]) == 1  # the second micro-batch runs empty
    assert balanced_split([1, 1]) == 1
    assert balanced_split([100, 1, 1]) == 1  # never an empty side with two
    assert balanced_split([1, 1, 100]) == 2
    assert balanced_split([3, 3, 3, 3]) == 2
    assert balanced_split([5, 1, 1, 1, 1, 1]) == 1
