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
