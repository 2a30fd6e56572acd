import itertools
import threading

import pytest
import torch

from vllm.v1.worker import workspace as workspace_module
from vllm.v1.worker.ubatching import (
    dbo_current_ubatch_id,
    run_ubatches,
    ubatch_context,
)
from vllm.v1.worker.workspace import (
    ALIGNMENT,
    WorkspaceLockedError,
    WorkspaceManager,
    current_workspace_lane,
    current_workspace_manager,
    get_lock_buffer,
    get_shared_resource,
    get_workspace_buffers,
    init_workspace_manager,
    is_workspace_manager_initialized,
    lock_workspace,
    reset_workspace_manager,
    unlock_workspace,
    use_workspace_lane,
)
from vllm.v1.worker.workspace_report import tensor_storage_bytes


@pytest.fixture
def multi_slot(device: torch.device):
    reset_workspace_manager()
    manager = init_workspace_manager(device, num_ubatches=2, num_lanes=2)
    yield manager
    reset_workspace_manager()


def in_slot(ubatch: int, lane: int, fn):
    """Run ``fn`` as (ubatch, lane) on a ubatch thread and return its result."""

    def body():
        with use_workspace_lane(lane):
            return fn()

    fns = [lambda: None] * ubatch + [body]
    return run_ubatches(fns)[ubatch]


# -- module API --------------------------------------------------------------


def test_module_lifecycle(device):
    reset_workspace_manager()
    assert not is_workspace_manager_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        current_workspace_manager()
    manager = init_workspace_manager(device)
    assert is_workspace_manager_initialized()
    assert current_workspace_manager() is manager
    with pytest.raises(RuntimeError, match="already initialized"):
        init_workspace_manager(device)
    lock_workspace()
    assert manager.is_locked()
    unlock_workspace()
    assert not manager.is_locked()
    reset_workspace_manager()
    assert not is_workspace_manager_initialized()


@pytest.mark.parametrize("kwargs", [{"num_lanes": 0}, {"num_ubatches": 0}])
def test_bad_slot_counts(device, kwargs):
    with pytest.raises(ValueError, match="must be >= 1"):
        WorkspaceManager(device, **kwargs)


def test_alloc_context_wraps_every_allocation(device):
    entered = []

    class Recorder:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *exc):
            return False

    manager = WorkspaceManager(device, alloc_context=Recorder)
    manager.get_simultaneous(((16,), torch.float32))
    manager.get_persistent("t", (4,), torch.int32)
    manager.get_persistent_resource("o", lambda: object())
    assert len(entered) == 3
    manager.get_simultaneous(((8,), torch.float32))  # fits: no allocation
    assert len(entered) == 3


# -- arena -------------------------------------------------------------------


def arena_capacity(manager: WorkspaceManager) -> int:
    return manager._slots[0].capacity


def test_simultaneous_views_disjoint_and_aligned(workspace_init):
    a, b, c = workspace_init.get_simultaneous(
        ((3, 5), torch.float16), ((7,), torch.int64), ((2, 2, 3), torch.float32)
    )
    assert (a.shape, a.dtype) == ((3, 5), torch.float16)
    assert (b.shape, b.dtype) == ((7,), torch.int64)
    assert (c.shape, c.dtype) == ((2, 2, 3), torch.float32)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in (a, b, c))
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    for t in (a, b, c):
        assert t.data_ptr() % ALIGNMENT == 0
    # Writing one view leaves the others intact.
    a.fill_(1.5)
    b.fill_(-3)
    c.fill_(2.25)
    assert bool((a == 1.5).all()) and bool((b == -3).all())
    assert bool((c == 2.25).all())


def test_arena_reused_and_grows_never_shrinks(workspace_init):
    (first,) = workspace_init.get_simultaneous(((1024,), torch.float32))
    assert arena_capacity(workspace_init) == 4096
    (again,) = workspace_init.get_simultaneous(((10,), torch.float32))
    assert again.data_ptr() == first.data_ptr()  # served from the same bytes
    (bigger,) = workspace_init.get_simultaneous(((4096,), torch.float32))
    assert arena_capacity(workspace_init) == 16384
    workspace_init.get_simultaneous(((1,), torch.float32))
    assert arena_capacity(workspace_init) == 16384
    assert bigger.numel() == 4096


def test_lock_blocks_growth_not_reuse_and_unlock_restores(workspace_init):
    workspace_init.get_simultaneous(((256,), torch.float32))
    workspace_init.lock()
    (view,) = workspace_init.get_simultaneous(((200,), torch.float32))
    view.normal_()  # reuse works after lock
    with pytest.raises(WorkspaceLockedError) as info:
        workspace_init.get_simultaneous(((257,), torch.float32))
    msg = str(info.value)
    assert isinstance(info.value, AssertionError)
    assert "arena growth" in msg and "(257,) torch.float32" in msg
    assert "test_workspace.py:" in msg  # who asked
    assert "ubatch=0, lane=0" in msg and "arena " in msg  # slot, what exists
    workspace_init.unlock()
    (grown,) = workspace_init.get_simultaneous(((257,), torch.float32))
    assert grown.numel() == 257


def test_resources_made_under_inference_mode_stay_updatable(workspace_init):
    with torch.inference_mode():  # as a runner's warm-up
        (view,) = workspace_init.get_simultaneous(((8,), torch.float32))
        locks = workspace_init.get_persistent("locks", (4,), torch.int32)
        box = workspace_init.get_persistent_resource("box", lambda: [torch.ones(2)])
    # Outside inference mode: no "inference tensor" error on what persists
    # (views are per call: a later call hands out fresh ones).
    locks.zero_()
    box[0].add_(1)
    (again,) = workspace_init.get_simultaneous(((8,), torch.float32))
    again.fill_(1.0)
    assert again.data_ptr() == view.data_ptr() and not locks.is_inference()


# -- persistent resources ----------------------------------------------------


def test_persistent_resource_factory_runs_once(workspace_init):
    calls = []

    def factory():
        calls.append(1)
        return {"buf": torch.ones(8)}

    first = workspace_init.get_persistent_resource(("res", 8), factory)
    second = workspace_init.get_persistent_resource(("res", 8), factory)
    assert first is second and len(calls) == 1
    other = workspace_init.get_persistent_resource(("res", 9), factory)
    assert other is not first and len(calls) == 2


def test_persistent_tensor_zeroed_once_and_survives_arena_traffic(workspace_init):
    t = workspace_init.get_persistent("locks", (64,), torch.int32, zero_init=True)
    assert bool((t == 0).all())
    t.fill_(7)
    again = workspace_init.get_persistent("locks", (64,), torch.int32, zero_init=True)
    assert again.data_ptr() == t.data_ptr()
    assert bool((again == 7).all())  # not re-zeroed
    for n in (16, 4096, 100000):
        (v,) = workspace_init.get_simultaneous(((n,), torch.int32))
        v.fill_(-1)
    assert bool((t == 7).all())  # arena never overlaps persistent storage


def test_persistent_tensor_mismatch_names_both(workspace_init):
    workspace_init.get_persistent("k", (4, 8), torch.float32)
    with pytest.raises(ValueError, match=r"\(4, 8\) torch.float32.*\(4, 9\)"):
        workspace_init.get_persistent("k", (4, 9), torch.float32)
    with pytest.raises(ValueError, match=r"torch\.float16"):
        workspace_init.get_persistent("k", (4, 8), torch.float16)


def test_tensor_and_object_key_spaces_are_separate(workspace_init):
    t = workspace_init.get_persistent("same", (2,), torch.float32)
    o = workspace_init.get_persistent_resource("same", lambda: "object")
    assert isinstance(t, torch.Tensor) and o == "object"


def test_lock_blocks_new_keys_but_not_existing(workspace_init):
    t = workspace_init.get_persistent("t", (3,), torch.float32)
    o = workspace_init.get_persistent_resource("o", object)
    workspace_init.lock()
    assert workspace_init.get_persistent("t", (3,), torch.float32) is t
    assert workspace_init.get_persistent_resource("o", object) is o
    with pytest.raises(WorkspaceLockedError, match="new persistent tensor 'u'"):
        workspace_init.get_persistent("u", (3,), torch.float32)
    with pytest.raises(WorkspaceLockedError) as info:
        workspace_init.get_persistent_resource("p", object)
    msg = str(info.value)
    assert "'p'" in msg and "'t': (3,) torch.float32" in msg and "'o': object" in msg


# -- slots -------------------------------------------------------------------


def test_four_slots_have_distinct_arenas_and_resources(multi_slot):
    calls = []

    def make() -> torch.Tensor:
        calls.append(1)
        return torch.zeros(4, device=multi_slot.device)

    def probe():
        (view,) = multi_slot.get_simultaneous(((64,), torch.float32))
        res = multi_slot.get_persistent_resource("r", make)
        return view.data_ptr(), res.data_ptr()

    results = {(u, lane): in_slot(u, lane, probe) for u in (0, 1) for lane in (0, 1)}
    assert len({r[0] for r in results.values()}) == 4
    assert len({r[1] for r in results.values()}) == 4
    assert len(calls) == 4
    # Asking again in each slot calls no factory and returns the same storage.
    for (u, lane), expected in results.items():
        assert in_slot(u, lane, probe) == expected
    assert len(calls) == 4
    report = multi_slot.memory_report()
    assert [(s.ubatch, s.lane) for s in report.slots] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


def test_lock_in_one_slot_reports_that_slot(multi_slot):
    multi_slot.lock()
    with pytest.raises(WorkspaceLockedError, match=r"ubatch=1, lane=1"):
        in_slot(1, 1, lambda: multi_slot.get_persistent("x", (1,), torch.int32))


def test_lane_errors(multi_slot):
    with pytest.raises(ValueError, match=">= 0"), use_workspace_lane(-1):
        pass
    with pytest.raises(ValueError, match="num_lanes=2"), use_workspace_lane(2):
        pass
    with pytest.raises(ValueError, match="num_ubatches=2"):
        run_ubatches([lambda: None] * 2 + [lambda: multi_slot.get_simultaneous()])


def test_lane_selected_before_init_is_checked_on_use(device):
    reset_workspace_manager()
    with use_workspace_lane(3):
        manager = init_workspace_manager(device, num_lanes=2)
        with pytest.raises(ValueError, match=r"lane 3.*num_lanes=2"):
            manager.get_persistent("k", (1,), torch.float32)
    reset_workspace_manager()


def test_lane_restored_and_new_threads_start_on_lane_zero(multi_slot):
    seen = []
    with use_workspace_lane(1):
        assert current_workspace_lane() == 1
        t = threading.Thread(target=lambda: seen.append(current_workspace_lane()))
        t.start()
        t.join()
        with pytest.raises(RuntimeError), use_workspace_lane(0):
            raise RuntimeError("body fails")
        assert current_workspace_lane() == 1
    assert current_workspace_lane() == 0
    assert seen == [0]


def test_ubatch_context_restores_the_previous_id(multi_slot):
    with ubatch_context(1):
        assert dbo_current_ubatch_id() == 1
        with ubatch_context(0):
            assert dbo_current_ubatch_id() == 0
        assert dbo_current_ubatch_id() == 1
    assert dbo_current_ubatch_id() == 0
    (view,) = multi_slot.get_simultaneous(((4,), torch.float32))  # slot lookup works
    assert view.numel() == 4


def test_ubatch_threads_inherit_the_callers_lane(multi_slot):
    def lane_and_view() -> int:
        multi_slot.get_simultaneous(((16,), torch.float32))
        return current_workspace_lane()

    with use_workspace_lane(1):
        assert run_ubatches([lane_and_view] * 2) == [1, 1]
    # The ubatch threads on lane 1 used the (ubatch, 1) slots, not lane 0's.
    used = [
        (s.ubatch, s.lane) for s in multi_slot.memory_report().slots if s.arena_bytes
    ]
    assert used == [(0, 1), (1, 1)]
    assert run_ubatches([current_workspace_lane] * 2) == [0, 0]


def test_concurrent_ubatch_threads_land_in_own_slots(multi_slot):
    barrier = threading.Barrier(2)

    def work():
        ubatch = dbo_current_ubatch_id()
        barrier.wait()  # both threads are inside their ubatch at once
        (view,) = multi_slot.get_simultaneous(((1000,), torch.float32))
        view.fill_(float(ubatch))
        barrier.wait()
        owner = multi_slot.get_persistent_resource("owner", lambda: ubatch)
        return ubatch, view.data_ptr(), bool((view == ubatch).all()), owner

    results = run_ubatches([work, work])
    assert [r[0] for r in results] == [0, 1]
    assert results[0][1] != results[1][1]
    assert all(r[2] for r in results)
    assert [r[3] for r in results] == [0, 1]


def test_per_stream_key_on_cpu_is_constant(workspace_init):
    if workspace_init.device.type != "cpu":
        pytest.skip("CPU behaviour")
    a = workspace_init.get_persistent("lk", (8,), torch.int32, per_stream=True)
    b = workspace_init.get_persistent("lk", (8,), torch.int32, per_stream=True)
    assert a is b


def test_helpers_use_the_manager_when_there_is_one(device):
    reset_workspace_manager()
    # Without a manager: fresh memory every call, lock buffers zeroed.
    assert get_lock_buffer("locks", 8, device) is not get_lock_buffer(
        "locks", 8, device
    )
    assert not get_lock_buffer("locks", 8, device).any()
    assert get_shared_resource("k", object) is not get_shared_resource("k", object)
    a, b = get_workspace_buffers(device, ((4,), torch.float32), ((2, 3), torch.int64))
    assert (a.shape, a.dtype, b.shape, b.dtype) == (
        (4,),
        torch.float32,
        (2, 3),
        torch.int64,
    )
    manager = init_workspace_manager(device)
    try:
        locks = get_lock_buffer("locks", 8, device)
        locks.fill_(3)  # a kernel that failed mid-way: the buffer is not re-zeroed
        assert get_lock_buffer("locks", 8, device) is locks
        (resource,) = manager.memory_report().slots[0].resources
        assert resource.key == (
            ("locks", str(manager.device)),
            workspace_module._stream_key(manager.device),
        )
        assert get_shared_resource("k", object) is get_shared_resource("k", object)
        (view,) = get_workspace_buffers(device, ((64,), torch.float32))
        (again,) = get_workspace_buffers(device, ((64,), torch.float32))
        assert view.data_ptr() == again.data_ptr()
        with pytest.raises(ValueError, match=r"lock buffer 'locks'.*meta"):
            get_lock_buffer("locks", 8, "meta")
        manager.lock()
        with pytest.raises(WorkspaceLockedError, match="other"):
            get_lock_buffer("other", 8, device)
    finally:
        reset_workspace_manager()


@pytest.mark.gpu
def test_streams_get_distinct_stream_scoped_buffers(workspace_init):
    def lock_buffer():
        return get_lock_buffer("locks", 132, workspace_init.device)

    default = lock_buffer()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = lock_buffer()
        assert lock_buffer() is on_side
    assert lock_buffer() is default
    assert on_side.data_ptr() != default.data_ptr()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        assert lock_buffer().data_ptr() not in (default.data_ptr(), on_side.data_ptr())
    obj = workspace_init.get_persistent_resource("o", object, per_stream=True)
    with torch.cuda.stream(side):
        assert (
            workspace_init.get_persistent_resource("o", object, per_stream=True)
            is not obj
        )
    workspace_init.lock()
    fresh = torch.cuda.Stream()
    with (
        torch.cuda.stream(fresh),
        pytest.raises(WorkspaceLockedError, match="stream"),
    ):
        lock_buffer()


# -- accounting --------------------------------------------------------------


class Holder:
    def __init__(self, device):
        base = torch.empty(1000, dtype=torch.float32, device=device)
        self.a = base
        self.view = base[10:20]  # same storage: counted once
        self.parts = [torch.empty(3, 5, dtype=torch.float16, device=device)]
        self.meta = {"idx": torch.empty(7, dtype=torch.int64, device=device)}
        self.name = "holder"


def test_accounting_equals_real_storage(multi_slot):
    def fill():
        views = multi_slot.get_simultaneous(((100,), torch.float32), ((3,), torch.int8))
        multi_slot.get_persistent("t", (5, 7), torch.float16)
        holder = multi_slot.get_persistent_resource(
            "h", lambda: Holder(multi_slot.device)
        )
        return holder, views

    holder, views = in_slot(1, 0, fill)
    report = multi_slot.memory_report()
    slot = next(s for s in report.slots if (s.ubatch, s.lane) == (1, 0))
    arena_storage = views[0].untyped_storage().nbytes()
    assert slot.arena_bytes == arena_storage
    # Each view is rounded to 256 bytes; CPU may add padding to align the base.
    assert 512 + 256 <= arena_storage <= 512 + 256 + ALIGNMENT
    by_key = {r.key: r for r in slot.resources}
    assert by_key["t"].nbytes == 5 * 7 * 2 and by_key["t"].kind == "tensor"
    expected = 1000 * 4 + 15 * 2 + 7 * 8
    assert by_key["h"].nbytes == expected == tensor_storage_bytes(holder)
    assert by_key["h"].type_name == "Holder"
    assert report.persistent_bytes == 70 + expected
    assert report.arena_bytes == arena_storage
    assert report.total_bytes == arena_storage + 70 + expected
    assert [r.key for r in report.resources_of_type("Holder")] == ["h"]
    others = [s for s in report.slots if (s.ubatch, s.lane) != (1, 0)]
    assert all(s.arena_bytes == 0 and not s.resources for s in others)
    text = report.format()
    assert "ubatch=1, lane=0" in text and "Holder" in text


def test_debug_logging(workspace_init, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_DEBUG_WORKSPACE", "1")
    workspace_module.logger.propagate = True
    try:
        with caplog.at_level("INFO", logger=workspace_module.logger.name):
            workspace_init.get_simultaneous(((64,), torch.float32))
            workspace_init.get_persistent("t", (4,), torch.int32)
            workspace_init.lock()
    finally:
        workspace_module.logger.propagate = False
    text = caplog.text
    assert "arena 0 -> 256 bytes" in text and "test_workspace.py:" in text
    assert "new tensor 't'" in text and "16 bytes" in text
    assert "workspace locked" in text
