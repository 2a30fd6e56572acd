"""MoE token permute / unpermute on a shared, input-sized index scratch.

``moe_permute`` groups the expanded rows (token x top-k routes) by local
expert, ascending, stable inside each expert; ``moe_unpermute`` gathers each
token's routes back and reduces them with the routing weights in fp32.

The index metadata lives in a :class:`MoEPermuteScratch`: one per execution
slot, shared by every sequential MoE layer with the same routing dims
(:func:`get_moe_permute_scratch`). It holds index metadata only; permuted
hidden states go to the caller's buffer (normally a workspace view). A
scratch is sized in expanded rows by the inputs it has been given so far, and
may be enlarged only while the workspace manager is unlocked.

Where :func:`runs_gpu_kernels` says so (CUDA tensors) the Triton kernels run: no
host sync, no allocation when scratch and buffers are given, so calls can be
captured in CUDA graphs. Elsewhere (CPU) the plain-PyTorch references run.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels import moe_permute as kernels
from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.utils import canonical_device
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    get_shared_resource,
    is_workspace_manager_initialized,
)

_INDEX_DTYPES = (torch.int32, torch.int64)
_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


class MoEPermuteScratch:
    """Index metadata for permuting up to ``capacity`` expanded rows.

    Holds, for the last call: the route -> destination inverse index, the
    destination -> route index, per-local-expert offsets and the sort
    workspace. Capacity is in expanded rows (tokens x top-k), independent of
    hidden size, dtype and top-k. Every call rewrites what it reads, so a
    smaller request simply uses prefixes.
    """

    def __init__(
        self, num_experts: int, num_local_experts: int, device: torch.device | str
    ) -> None:
        if not 0 < num_local_experts <= num_experts:
            raise ValueError(
                f"need 0 < num_local_experts <= num_experts, got "
                f"num_local_experts={num_local_experts}, num_experts={num_experts}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.device = canonical_device(device)
        self.capacity = 0
        self.inv_permuted_idx = torch.empty(0, dtype=torch.int32, device=self.device)
        self.permuted_idx = torch.empty(0, dtype=torch.int32, device=self.device)
        self.expert_first_token_offset = torch.zeros(
            num_local_experts + 1, dtype=torch.int64, device=self.device
        )
        self.sort_workspace = torch.empty(0, dtype=torch.int32, device=self.device)

    def reserve(self, expanded_rows: int) -> None:
        """Make room for ``expanded_rows`` rows (grows only while unlocked)."""
        if expanded_rows <= self.capacity:
            return
        manager = (
            current_workspace_manager() if is_workspace_manager_initialized() else None
        )
        if manager is not None and not manager.growth_allowed():
            raise manager.locked_error(
                f"{expanded_rows} expanded rows from MoEPermuteScratch(num_experts="
                f"{self.num_experts}, num_local_experts={self.num_local_experts}, "
                f"device={self.device}), which has {self.capacity} (Scratch growth "
                f"is not allowed after locking)",
                owner_file=__file__,
            )
        # Release the old blocks first so the allocator can reuse them.
        self.inv_permuted_idx = self.permuted_idx = self.sort_workspace = None  # type: ignore[assignment]
        sort_numel = kernels.sort_workspace_numel(expanded_rows, self.num_local_experts)
        with torch.inference_mode(False):  # as the manager's allocations
            self.inv_permuted_idx, self.permuted_idx, self.sort_workspace = (
                torch.empty(n, dtype=torch.int32, device=self.device)
                for n in (expanded_rows, expanded_rows, sort_numel)
            )
        self.capacity = expanded_rows

    def nbytes(self) -> int:
        return sum(
            t.nbytes
            for t in (
                self.inv_permuted_idx,
                self.permuted_idx,
                self.expert_first_token_offset,
                self.sort_workspace,
            )
        )


def get_moe_permute_scratch(
    *, num_experts: int, num_local_experts: int, device: torch.device | str
) -> MoEPermuteScratch:
    """The current slot's shared scratch for these routing dims.

    With a workspace manager, one scratch per (ubatch, lane) is shared by all
    sequential MoE layers with the same routing dims; call this at execution
    time and never cache the result on a layer. Without a manager, a new
    scratch per call.
    """
    device = canonical_device(device)
    key = ("MoEPermuteScratch", num_experts, num_local_experts, str(device))
    return get_shared_resource(
        key, lambda: MoEPermuteScratch(num_experts, num_local_experts, device)
    )


# -- validation --------------------------------------------------------------


def _error(name: str, expected: str, got: object) -> ValueError:
    # Messages are built only on failure: the checks run on every call.
    return ValueError(f"{name}: expected {expected}, got {got}")


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _check_routing(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local_expert: int,
    device: torch.device,
) -> None:
    if not (topk_ids.dim() == 2 and topk_ids.dtype in _INDEX_DTYPES):
        raise _error(
            "topk_ids",
            "a 2-D int32/int64 tensor [num_tokens, topk]",
            _describe(topk_ids),
        )
    if topk_ids.device != device:
        raise _error("topk_ids", f"device {device}", topk_ids.device)
    if n_expert <= 0:
        raise _error("n_expert", "> 0", n_expert)
    if not (0 < n_local_expert <= n_expert):
        raise _error("n_local_expert", f"-1 or 1..n_expert={n_expert}", n_local_expert)
    if expert_map is not None:
        if not (expert_map.shape == (n_expert,) and expert_map.dtype == torch.int32):
            raise _error(
                "expert_map",
                f"an int32 tensor of shape ({n_expert},)",
                _describe(expert_map),
            )
        if expert_map.device != device:
            raise _error("expert_map", f"device {device}", expert_map.device)


def _scratch_for(
    scratch: MoEPermuteScratch | None,
    n_expert: int,
    n_local_expert: int,
    device: torch.device,
) -> MoEPermuteScratch:
    if scratch is None:
        return MoEPermuteScratch(n_expert, n_local_expert, device)
    if not (
        (scratch.num_experts, scratch.num_local_experts, scratch.device)
        == (n_expert, n_local_expert, device)
    ):
        raise _error(
            "scratch",
            f"a MoEPermuteScratch for num_experts={n_expert}, "
            f"num_local_experts={n_local_expert} on {device}",
            f"one for num_experts={scratch.num_experts}, num_local_experts="
            f"{scratch.num_local_experts} on {scratch.device}",
        )
    return scratch


def _sort_routes(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    scratch: MoEPermuteScratch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill the scratch's index metadata; returns (offsets, inv, permuted)."""
    rows = topk_ids.numel()
    scratch.reserve(rows)
    inv = scratch.inv_permuted_idx[:rows]
    permuted = scratch.permuted_idx[:rows]
    offsets = scratch.expert_first_token_offset
    if runs_gpu_kernels(topk_ids):
        kernels.route_sort(
            topk_ids.contiguous(),
            expert_map,
            scratch.num_experts,
            scratch.num_local_experts,
            inv,
            permuted,
            offsets,
            scratch.sort_workspace,
        )
    else:
        ref_inv, ref_permuted, ref_offsets = kernels.route_sort_reference(
            topk_ids, expert_map, scratch.num_experts, scratch.num_local_experts
        )
        inv.copy_(ref_inv)
        permuted.copy_(ref_permuted)
        offsets.copy_(ref_offsets)
    return offsets, inv, permuted


# -- public ops --------------------------------------------------------------


def moe_prepare_scatter(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    scratch: MoEPermuteScratch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata half of ``moe_permute``: (expert offsets, inverse index).

    For backends that write activations straight to their permuted rows
    (e.g. while quantizing them): route ``t * topk + k`` goes to row
    ``inv_permuted_idx[t * topk + k]``; rows at or past ``offsets[-1]`` are
    non-local or invalid routes. Afterwards ``scratch.permuted_idx[:T * topk]``
    holds the reverse, destination -> route, for backends that gather.
    """
    _check_routing(
        topk_ids,
        expert_map,
        scratch.num_experts,
        scratch.num_local_experts,
        scratch.device,
    )
    offsets, inv, _ = _sort_routes(topk_ids, expert_map, scratch)
    return offsets, inv


def moe_permute(
    hidden_states: torch.Tensor,
    a1q_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    n_expert: int,
    n_local_expert: int = -1,
    expert_map: torch.Tensor | None = None,
    permuted_hidden_states: torch.Tensor | None = None,
    scratch: MoEPermuteScratch | None = None,
    permuted_a1q_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the expanded rows of ``hidden_states`` by local expert.

    Returns ``(permuted_hidden_states, permuted_a1q_scale,
    expert_first_token_offset, inv_permuted_idx, permuted_idx)``. Local rows
    come first, by ascending local expert, routes in their original order
    inside one expert; non-local and invalid routes (id < 0, id >= n_expert,
    or mapped to -1) sort after them and are excluded from the offsets, and
    their rows of the permuted buffer are left unwritten. ``a1q_scale`` may be
    per tensor (passed through) or per token / token group ([T, G], moved
    with the rows; 2-D means per token even with one token).
    ``permuted_hidden_states`` (>= T * topk rows) and, for per-token scales,
    ``permuted_a1q_scale`` (>= T * topk rows of G) are written in place when
    given (normally workspace views); the returned tensors are their first
    T * topk rows.
    """
    if n_local_expert == -1:
        n_local_expert = n_expert
    if not (hidden_states.dim() == 2 and hidden_states.dtype in _HIDDEN_DTYPES):
        raise _error(
            "hidden_states",
            "a 2-D bf16/fp16/fp32/fp8_e4m3fn tensor [num_tokens, hidden]",
            _describe(hidden_states),
        )
    device = hidden_states.device
    _check_routing(topk_ids, expert_map, n_expert, n_local_expert, device)
    num_tokens, hidden = hidden_states.shape
    if topk_ids.shape[0] != num_tokens:
        raise _error(
            "topk_ids",
            f"{num_tokens} rows (one per token of hidden_states)",
            _describe(topk_ids),
        )
    rows = topk_ids.numel()
    if permuted_hidden_states is None:
        permuted_hidden_states = torch.empty(
            rows, hidden, dtype=hidden_states.dtype, device=device
        )
    if not (
        permuted_hidden_states.dim() == 2
        and permuted_hidden_states.shape[0] >= rows
        and permuted_hidden_states.shape[1] == hidden
        and permuted_hidden_states.dtype == hidden_states.dtype
        and permuted_hidden_states.device == device
        and permuted_hidden_states.stride(1) == 1
    ):
        raise _error(
            "permuted_hidden_states",
            f"a row-contiguous [>= {rows}, {hidden}] {hidden_states.dtype} tensor "
            f"on {device}",
            _describe(permuted_hidden_states),
        )
    permuted_scale: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    if a1q_scale is not None:
        if a1q_scale.device != device:
            raise _error("a1q_scale", f"device {device}", a1q_scale.device)
        if a1q_scale.dim() < 2 and a1q_scale.numel() == 1:
            permuted_scale = a1q_scale  # per tensor: passes through
        else:
            if not (
                a1q_scale.dim() == 2
                and a1q_scale.shape[0] == num_tokens
                and a1q_scale.dtype == torch.float32
            ):
                raise _error(
                    "a1q_scale",
                    f"a per-tensor scale (0-D or [1]), or a [{num_tokens}, groups] "
                    f"fp32 tensor",
                    _describe(a1q_scale),
                )
            row_scale = a1q_scale.contiguous()
            groups = a1q_scale.shape[1]
            if permuted_a1q_scale is None:
                permuted_a1q_scale = torch.empty(
                    rows, groups, dtype=torch.float32, device=device
                )
            if not (
                permuted_a1q_scale.dim() == 2
                and permuted_a1q_scale.shape[0] >= rows
                and permuted_a1q_scale.shape[1] == groups
                and permuted_a1q_scale.dtype == torch.float32
                and permuted_a1q_scale.device == device
                and permuted_a1q_scale.is_contiguous()
            ):
                raise _error(
                    "permuted_a1q_scale",
                    f"a contiguous [>= {rows}, {groups}] fp32 tensor on {device}",
                    _describe(permuted_a1q_scale),
                )
            permuted_scale = permuted_a1q_scale[:rows]

    scratch = _scratch_for(scratch, n_expert, n_local_expert, device)
    offsets, inv, permuted_idx = _sort_routes(topk_ids, expert_map, scratch)
    out = permuted_hidden_states[:rows]
    if rows:
        topk = topk_ids.shape[1]
        if runs_gpu_kernels(hidden_states):
            kernels.permute_rows(
                hidden_states.contiguous(),
                inv,
                topk,
                offsets,
                out,
                row_scale,
                permuted_scale if row_scale is not None else None,
            )
        else:
            ref_rows, ref_scale = kernels.permute_rows_reference(
                hidden_states, inv, topk, offsets, row_scale
            )
            num_valid = int(offsets[-1])  # CPU: no device sync
            out[:num_valid].copy_(ref_rows[:num_valid])
            if ref_scale is not None and permuted_scale is not None:
                permuted_scale.copy_(ref_scale)
    return out, permuted_scale, offsets, inv, permuted_idx


def moe_unpermute(
    out: torch.Tensor,
    permuted_hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor | None = None,
) -> None:
    """``out[t] = sum_k w[t, k] * permuted[inv[t * topk + k]]`` in fp32.

    Routes whose row is at or past ``expert_first_token_offset[-1]`` (when
    given) are skipped; without offsets every route must be valid. Every row
    of ``out`` is written (zero when a token has no valid route).
    """
    if runs_gpu_kernels(out):
        kernels.unpermute_rows(
            out,
            permuted_hidden_states,
            topk_weights,
            inv_permuted_idx,
            expert_first_token_offset,
        )
        return
    kernels.check_unpermute_args(
        out,
        permuted_hidden_states,
        topk_weights,
        inv_permuted_idx,
        expert_first_token_offset,
    )
    out.copy_(
        kernels.unpermute_rows_reference(
            permuted_hidden_states,
            topk_weights,
            inv_permuted_idx,
            expert_first_token_offset,
            out_dtype=out.dtype,
        )
    )
