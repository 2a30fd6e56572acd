"""Gated activations between the two expert GEMMs."""

from __future__ import annotations

import torch

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def apply_moe_activation(
    activation: str, out: torch.Tensor, gate_up: torch.Tensor
) -> torch.Tensor:
    """``out[R, I] = act(gate_up[:, :I], gate_up[:, I:])`` (see config.ACTIVATIONS)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    if activation == "silu":
        result = torch.nn.functional.silu(gate) * up
    elif activation == "swiglu":
        gate = gate.clamp(max=SWIGLU_LIMIT)
        up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        result = gate * torch.sigmoid(SWIGLU_ALPHA * gate) * (up + 1)
    else:
        raise ValueError(f"activation: expected 'silu' or 'swiglu', got {activation!r}")
    return out.copy_(result)
