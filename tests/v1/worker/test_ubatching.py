import threading

import pytest

from vllm.v1.worker.ubatching import dbo_current_ubatch_id, run_ubatches, ubatch_context


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
