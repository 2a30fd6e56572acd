import numpy as np
import pytest
import torch

from vllm.utils import align_up, canonical_device, named_tensors, to_device


@pytest.mark.parametrize(
    ("n", "multiple", "expected"),
    [(0, 256, 0), (1, 256, 256), (256, 256, 256), (257, 16, 272)],
)
def test_align_up(n, multiple, expected):
    assert align_up(n, multiple) == expected


def test_canonical_device_fills_the_cuda_index(device):
    assert canonical_device("cpu") == torch.device("cpu")
    if device.type == "cuda":
        assert canonical_device("cuda") == torch.device(
            "cuda", torch.cuda.current_device()
        )


def test_named_tensors_follows_containers_once():
    class Holder:
        def __init__(self) -> None:
            self.w = torch.zeros(2)
            self.parts = [torch.ones(1), {"k": torch.ones(3)}]
            self.me = self  # a cycle is visited once

    names = dict(named_tensors(Holder(), "h"))
    assert sorted(names) == ["h.parts.0", "h.parts.1.k", "h.w"]
    assert names["h.parts.1.k"].shape == (3,)


def test_to_device_copies_without_waiting_for_the_stream(device):
    """Lists and arrays arrive as the dtype asked for; on a GPU the copy
    issues behind a long queued kernel without a stream sync (torch's sync
    debug mode turns a sync into an error) and still reads right."""
    busy = None
    if device.type == "cuda":
        busy = torch.randn(4096, 4096, device=device)
        for _ in range(20):  # the stream stays busy while the copies issue
            busy = busy @ busy / 64
        torch.cuda.set_sync_debug_mode("error")
    try:
        ints = to_device([3, 1, 2], torch.long, device)
        floats = to_device(np.array([0.5, 1.5]), torch.float32, device)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert ints.device.type == floats.device.type == device.type
    assert ints.dtype == torch.long and ints.tolist() == [3, 1, 2]
    assert floats.dtype == torch.float32 and floats.tolist() == [0.5, 1.5]
