"""What the current model step's layers read besides their inputs: the
attention metadata of the batch (None outside a batched step)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.attention.backends.torch_paged import PagedAttentionMetadata

# A context variable, so that micro-batch threads each see their own batch.
_attn_metadata: contextvars.ContextVar[PagedAttentionMetadata | None] = (
    contextvars.ContextVar("attn_metadata", default=None)
)


def current_attn_metadata() -> PagedAttentionMetadata | None:
    return _attn_metadata.get()


@contextmanager
def set_forward_context(attn_metadata: PagedAttentionMetadata) -> Iterator[None]:
    token = _attn_metadata.set(attn_metadata)
    try:
        yield
    finally:
        _attn_metadata.reset(token)
