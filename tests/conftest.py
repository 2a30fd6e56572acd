"""Test setup shared by the whole suite.

Triton kernels run on CPU tensors only under the interpreter, and the
interpreter must be chosen before any module defining ``@triton.jit`` kernels
is imported, so it is set here, before the package is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

from collections.abc import Iterator

import pytest

from vllm.v1.worker.workspace import (
    WorkspaceManager,
    init_workspace_manager,
    reset_workspace_manager,
)

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if not CUDA:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    elif os.environ.get("GPU_TESTS_ONLY") == "1":
        # The device's minutes are scarce, and CI's CPU run covers the tests
        # that never touch the GPU: run those marked gpu and those taking
        # the device fixture (CUDA here).
        skip_cpu = pytest.mark.skip(reason="GPU_TESTS_ONLY: a CPU test, run in CI")
        for item in items:
            gpu = "gpu" in item.keywords
            if not gpu and "device" not in getattr(item, "fixturenames", ()):
                item.add_marker(skip_cpu)


@pytest.fixture
def device() -> torch.device:
    """The test's device: CUDA when present, else CPU."""
    return torch.device("cuda" if CUDA else "cpu")


@pytest.fixture
def workspace_init(device: torch.device) -> Iterator[WorkspaceManager]:
    """A workspace manager on the test's device, reset afterwards."""
    reset_workspace_manager()
    manager = init_workspace_manager(device)
    try:
        yield manager
    finally:
        reset_workspace_manager()
