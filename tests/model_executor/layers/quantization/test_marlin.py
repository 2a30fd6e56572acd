"""MarlinLinear: its input checks and its forward under CUDA-graph capture.

The runtime op it calls and the lock workspaces are tested in
tests/model_executor/layers/quantization/utils/test_marlin_utils.py.
"""

import pytest
import torch

from vllm.model_executor.layers.quantization.marlin import MarlinLinear
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    marlin_dequantize,
)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_forward_rejects_bad_input(device):
    torch.manual_seed(4)
    layer = MarlinLinear(256, 128, device=device)
    layer.weight_loader(torch.randn(128, 256, device=device))
    layer.process_weights_after_loading()
    with pytest.raises(ValueError, match=r"^x: expected"):
        layer(torch.randn(2, 128, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^x: expected"):
        layer(torch.randn(2, 256, device=device))  # float32


@pytest.mark.gpu
def test_cuda_graph_on_warmup_stream(workspace_init):
    torch.manual_seed(6)
    layer = MarlinLinear(4096, 1024, device="cuda")
    layer.weight_loader(torch.randn(1024, 4096, device="cuda"))
    layer.process_weights_after_loading()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # warm-up on the capture stream creates its lock buffer
    stream.synchronize()
    workspace_init.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = layer(x)
    assert layer.qweight is not None and layer.scales is not None
    weight = marlin_dequantize(layer.qweight, layer.scales, 128).float()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(y, x.float() @ weight.t()) < 1e-2


def int32_tensors(module: torch.nn.Module) -> list[str]:
    return [
        name
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor) and value.dtype == torch.int32
    ] + [name for name, b in module.named_buffers() if b.dtype == torch.int32]


def test_marlin_reload_after_lock_needs_no_workspace(workspace_init, device):
    torch.manual_seed(0)
    layer = MarlinLinear(256, 128, device=device)
    layer.weight_loader(torch.randn(128, 256, device=device))
    layer.process_weights_after_loading()
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    old_out = layer(x)  # warm-up creates the slot's lock buffer
    before = workspace_init.memory_report()
    workspace_init.lock()

    assert layer.qweight is not None
    storage = layer.qweight.data_ptr()
    new_weight = torch.randn(128, 256, device=device)
    layer.weight_loader(new_weight)
    layer.process_weights_after_loading()
    out = layer(x)
    assert layer.qweight is not None and layer.scales is not None
    ref = x.float() @ marlin_dequantize(layer.qweight, layer.scales, 128).float().t()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-1)
    # The new weights are in use, in the old storage (graphs captured before
    # the reload stay valid), and nothing new was allocated by the manager.
    assert layer.qweight.data_ptr() == storage
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2
    assert ((out.float() - old_out.float()).norm() / ref.norm()) > 0.5
    after = workspace_init.memory_report()
    assert after.total_bytes == before.total_bytes
    # Only the packed weights are int32: no lock workspace lives on the layer.
    assert int32_tensors(layer) == ["qweight"]
    assert not any("workspace" in name for name in vars(layer))
