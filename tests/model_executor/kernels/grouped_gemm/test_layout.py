import torch

from vllm.model_executor.kernels.grouped_gemm import (
    deinterleave_gate_up,
    interleave_gate_up,
)


def test_gate_up_interleaving(device):
    w13 = torch.randn(3, 2 * 5, 4, device=device)
    inter = interleave_gate_up(w13)
    assert torch.equal(inter[:, 0::2], w13[:, :5])
    assert torch.equal(inter[:, 1::2], w13[:, 5:])
    assert torch.equal(deinterleave_gate_up(inter), w13)
    scales = torch.randn(3, 10, device=device)
    assert torch.equal(interleave_gate_up(scales)[:, 0::2], scales[:, :5])
    assert torch.equal(interleave_gate_up(scales)[:, 1::2], scales[:, 5:])
