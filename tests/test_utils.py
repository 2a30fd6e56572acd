import pytest
import torch

from vllm.utils import align_up, canonical_device, named_tensors


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
