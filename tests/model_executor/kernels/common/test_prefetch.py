"""The prefetch distance check (``common/prefetch.py``), and
:class:`PrefetchRecorder`, with which the decode kernels' tests check where
their prefetches point (``marlin/test_gemv.py``, ``marlin/test_moe_decode.py``,
``grouped_gemm/test_decode.py``); their sm_90 build tests count them."""

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest
import torch

from vllm.model_executor.kernels.common import prefetch
from vllm.model_executor.kernels.common.prefetch import MAX_PREFETCH, check_prefetch


@dataclass
class Config:
    prefetch: int


def test_check_prefetch_names_the_config():
    for steps in (0, MAX_PREFETCH):
        check_prefetch(Config(steps), "prefetch")
    for steps in (-1, MAX_PREFETCH + 1):
        with pytest.raises(
            ValueError, match=rf"config: prefetch must be in 0..{MAX_PREFETCH}: Config"
        ):
            check_prefetch(Config(steps), "prefetch")


class PrefetchRecorder:
    """Stands in for ``prefetch_l1`` under the interpreter (which runs no
    PTX): keeps every address a kernel would prefetch (where its mask)."""

    def __init__(self) -> None:
        self.addresses: list[np.ndarray] = []

    @classmethod
    def installed(
        cls, monkeypatch: pytest.MonkeyPatch, launcher: ModuleType, *users: ModuleType
    ) -> "PrefetchRecorder":
        """A recorder in place of ``prefetch_l1`` (in common/prefetch.py and
        in ``users``, which import it), with ``launcher``'s prefetch distances
        passed as asked."""
        recorder = cls()
        for module in (prefetch, *users):
            monkeypatch.setattr(module, "prefetch_l1", recorder)
        monkeypatch.setattr(launcher, "prefetch_steps", lambda steps, *_: steps)
        return recorder

    def __call__(self, ptrs, mask=None) -> None:
        addresses = np.asarray(ptrs.handle.data).astype(np.int64)
        if mask is not None:
            keep = np.broadcast_to(np.asarray(mask.handle.data), addresses.shape)
            addresses = addresses[keep]
        self.addresses.append(addresses.reshape(-1))

    def offsets_in(self, t: torch.Tensor) -> np.ndarray:
        """Byte offsets of the recorded addresses that fall in ``t``."""
        got = np.concatenate(self.addresses) - t.data_ptr()
        return got[(got >= 0) & (got < t.numel() * t.element_size())]

    def count(self) -> int:
        return sum(a.size for a in self.addresses)

    def outside(self, *tensors: torch.Tensor) -> int:
        """How many recorded addresses lie in none of ``tensors``."""
        got = np.concatenate(self.addresses)
        inside = np.zeros(got.shape, bool)
        for t in tensors:
            start = t.data_ptr()
            inside |= (got >= start) & (got < start + t.numel() * t.element_size())
        return int((~inside).sum())
