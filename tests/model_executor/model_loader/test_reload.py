"""Weight reload after the workspace manager is locked."""

import torch

from vllm.model_executor.layers.quantization.marlin import MarlinLinear
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    marlin_dequantize,
)


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
