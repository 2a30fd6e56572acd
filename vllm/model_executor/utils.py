"""Small helpers shared by layers."""

from __future__ import annotations

import torch


def copy_tensors_in_place(dst: object, src: object) -> bool:
    """Copy each tensor attribute of ``src`` into the same-named one of ``dst``.

    Only when both hold the same tensor attributes with equal shapes, dtypes
    and devices; returns whether it copied (otherwise ``dst`` is untouched).
    Reloading weights this way keeps their storage, so CUDA graphs captured
    before the reload read the new weights on replay.
    """
    dst_tensors = {k: v for k, v in vars(dst).items() if isinstance(v, torch.Tensor)}
    src_tensors = {k: v for k, v in vars(src).items() if isinstance(v, torch.Tensor)}
    if dst_tensors.keys() != src_tensors.keys() or any(
        (d.shape, d.dtype, d.device) != (s.shape, s.dtype, s.device)
        for d, s in ((dst_tensors[k], src_tensors[k]) for k in dst_tensors)
    ):
        return False
    for name, tensor in dst_tensors.items():
        if tensor.data_ptr() != src_tensors[name].data_ptr():
            tensor.copy_(src_tensors[name])
    return True
