"""Small helpers shared by layers."""

from __future__ import annotations

from vllm.utils import named_tensors


def copy_tensors_in_place(dst: object, src: object) -> bool:
    """Copy every tensor reachable from ``src`` into the one at the same
    attribute path of ``dst`` (nested objects included).

    Only when both hold tensors at the same paths with equal shapes, dtypes
    and devices; returns whether it copied (otherwise ``dst`` is untouched).
    Reloading weights this way keeps their storage, so CUDA graphs captured
    before the reload read the new weights on replay.
    """
    dst_tensors, src_tensors = dict(named_tensors(dst)), dict(named_tensors(src))
    if not dst_tensors or dst_tensors.keys() != src_tensors.keys():
        return False
    if any(
        (d.shape, d.dtype, d.device) != (s.shape, s.dtype, s.device)
        for d, s in ((dst_tensors[k], src_tensors[k]) for k in dst_tensors)
    ):
        return False
    for path, tensor in dst_tensors.items():
        if tensor.data_ptr() != src_tensors[path].data_ptr():
            tensor.copy_(src_tensors[path])
    return True
