"""Triton kernels for MoE token permute / unpermute.

A route is ``r = t * topk + k`` for token ``t`` and slot ``k``; there are
``R = T * topk`` routes. ``route_sort`` is a stable counting sort of the routes
by local expert (invalid routes form a last bucket), ``permute_rows`` scatters
each token row to its routes' destinations, and ``unpermute_rows`` gathers a
token's routes back and reduces them with the top-k weights in fp32.

Every launcher is allocation-free and never synchronises with the host, so the
three ops can be captured in a CUDA graph and replayed with new inputs of the
same shape. The ``*_reference`` functions are plain PyTorch with the same
semantics: the CPU path and the test oracle.

Modules: :mod:`.sort` (the route sort and its workspace size), :mod:`.rows`
(the row kernels and their argument checks), :mod:`.reference` (the
references). Callers use the names re-exported here.
"""

from vllm.model_executor.kernels.moe_permute.reference import (
    permute_rows_reference,
    route_sort_reference,
    unpermute_rows_reference,
)
from vllm.model_executor.kernels.moe_permute.rows import (
    check_unpermute_args,
    permute_rows,
    unpermute_rows,
)
from vllm.model_executor.kernels.moe_permute.sort import (
    route_sort,
    sort_workspace_numel,
)

__all__ = [
    "check_unpermute_args",
    "permute_rows",
    "permute_rows_reference",
    "route_sort",
    "route_sort_reference",
    "sort_workspace_numel",
    "unpermute_rows",
    "unpermute_rows_reference",
]
