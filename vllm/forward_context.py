"""What the current model step's layers read besides their inputs: the
attention metadata of the batch (None outside a batched step) and, under
expert parallelism, the token counts every rank's forward runs with (None
where the ranks did not agree on them before the step)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.attention.backends.torch_paged import PagedAttentionMetadata


@dataclass(frozen=True)
class DPMetadata:
    """Tokens of this step's forward on each rank of the expert-parallel
    group, in group order, known on the host of every rank: the token
    exchange needs no count exchange of its own (no host sync, so a CUDA
    graph can hold it)."""

    num_tokens_across_dp: list[int]

    @property
    def max_tokens(self) -> int:
        return max(self.num_tokens_across_dp)


# Context variables, so that micro-batch threads each see their own batch.
_attn_metadata: contextvars.ContextVar[PagedAttentionMetadata | None] = (
    contextvars.ContextVar("attn_metadata", default=None)
)
_dp_metadata: contextvars.ContextVar[DPMetadata | None] = contextvars.ContextVar(
    "dp_metadata", default=None
)


def current_attn_metadata() -> PagedAttentionMetadata | None:
    return _attn_metadata.get()


def current_dp_metadata() -> DPMetadata | None:
    return _dp_metadata.get()


@contextmanager
def set_forward_context(
    attn_metadata: PagedAttentionMetadata | None,
    dp_metadata: DPMetadata | None = None,
) -> Iterator[None]:
    attn_token = _attn_metadata.set(attn_metadata)
    dp_token = _dp_metadata.set(dp_metadata)
    try:
        yield
    finally:
        _dp_metadata.reset(dp_token)
        _attn_metadata.reset(attn_token)
