"""``FusedMoE``: an MoE layer whose forward runs as an opaque runtime op.

``forward`` calls ``torch.ops.vllm.moe_forward(hidden, logits, gate_weight,
layer_name)`` (routing by the router's logits or by its weight), and
``forward_normed`` ``moe_forward_normed`` (the decoder's residual add and
norm first, in the router's kernel where one token allows);
under ``torch.compile`` that op is a leaf with a fake implementation, so every
workspace, scratch and lock lookup inside the experts happens at execution
time, in whichever slot and stream the call runs.

Expert parallelism: a layer given an expert-parallel group (``ep_group``,
whose size and rank must be ``moe.ep_size`` / ``moe.ep_rank``) holds only its
rank's experts (linear placement, :mod:`.expert_placement`), loads only their
weights, and exchanges tokens with the other ranks through the
``all2all_backend`` chosen by name (:mod:`.prepare_finalize`), or, where
every rank of the group holds the same tokens (``replicated_tokens``: tensor
parallelism), sums the ranks' shares. Without a group a layer with
``ep_size`` > 1 computes its local experts' share only.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from vllm.distributed import GroupCoordinator
from vllm.logger import init_logger
from vllm.model_executor.kernels.common.checks import check_norm_operands
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8
from vllm.model_executor.layers.fused_moe.experts.fused_humming_moe import (
    HummingGroupedExperts,
)
from vllm.model_executor.layers.fused_moe.experts.fused_marlin_moe import MarlinExperts
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    GroupedMMExperts,
)
from vllm.model_executor.layers.fused_moe.experts.triton_fp8_moe import (
    TritonExpertsFp8,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.experts.triton_w4a8_moe import (
    TritonExpertsW4A8,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    FusedMoEModularKernel,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize import (
    check_all2all_backend,
    make_prepare_finalize,
)
from vllm.model_executor.layers.fused_moe.routing import (
    fused_topk,
    gated_topk,
    rms_norm_gated_logits,
    rms_norm_gated_topk,
)
from vllm.model_executor.utils import copy_tensors_in_place
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)

logger = init_logger(__name__)

EXPERTS_BACKENDS: dict[str, type[FusedMoEExperts]] = {
    "grouped_mm": GroupedMMExperts,
    "triton": TritonExperts,
    "cutlass": CutlassExpertsFp8,
    "triton_fp8": TritonExpertsFp8,
    "humming": HummingGroupedExperts,
    "marlin": MarlinExperts,
    "triton_w4a8": TritonExpertsW4A8,
}
"""Backend names a layer accepts (besides ``auto``) and the experts they build."""

AUTO_ORDER = {
    "cuda": (
        "triton",
        "grouped_mm",
        "triton_fp8",
        "cutlass",
        "humming",
        "marlin",
        "triton_w4a8",
    ),
    # The CPU runs references of the GPU kernels: grouped_mm is its bf16 path.
    "cpu": (
        "grouped_mm",
        "triton",
        "triton_fp8",
        "cutlass",
        "humming",
        "marlin",
        "triton_w4a8",
    ),
}
"""``auto`` takes the first backend of the device's order that runs the layer.
Measured on the H200: triton 1.15-1.37x the grouped_mm layer (64-8192
tokens); triton_fp8's GEMMs 1.3-3x faster than cutlass's
``_scaled_grouped_mm``; humming before our Marlin for W4A16 where
humming-kernels is installed."""

BACKENDS = ("auto", *EXPERTS_BACKENDS)

_layers: weakref.WeakValueDictionary[str, FusedMoE] = weakref.WeakValueDictionary()


def choose_experts_backend(moe: FusedMoEConfig, device: torch.device) -> str:
    """The first backend of the device's :data:`AUTO_ORDER` whose
    ``unsupported`` answers None; the reasons of those skipped go to the debug
    log (and into the error when none runs the layer)."""
    skipped: dict[str, str] = {}
    for name in AUTO_ORDER["cuda" if device.type == "cuda" else "cpu"]:
        reason = EXPERTS_BACKENDS[name].unsupported(moe, device)
        if reason is None:
            if skipped:
                logger.debug("experts backend %s; skipped %s", name, skipped)
            return name
        skipped[name] = reason
    raise ValueError(
        f"backend: no experts backend runs {moe.quant_config.scheme.value} on "
        f"{device}: " + "; ".join(f"{n}: {r}" for n, r in skipped.items())
    )


def make_experts(
    moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor, backend: str = "auto"
) -> FusedMoEExperts:
    """Prepare experts for ``moe.quant_config`` from full-precision weights."""
    if backend == "auto":
        backend = choose_experts_backend(moe, w13.device)
    if backend not in EXPERTS_BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return EXPERTS_BACKENDS[backend].from_unquantized(moe, w13, w2)


class FusedMoE(nn.Module):
    """Routed experts of one decoder layer (one expert-parallel rank).

    Create it on its device: the prepared experts are plain tensors of the
    experts object, not module parameters, so ``.to()`` after
    ``process_weights_after_loading`` does not move them.
    """

    def __init__(
        self,
        moe: FusedMoEConfig,
        *,
        prefix: str,
        renormalize: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        ep_group: GroupCoordinator | None = None,
        all2all_backend: str = "allgather_reducescatter",
        replicated_tokens: bool = False,
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if prefix in _layers:
            raise ValueError(f"prefix: a FusedMoE layer named {prefix!r} exists")
        check_all2all_backend(all2all_backend)
        self.device = (
            torch.device(device) if device is not None else torch.device("cpu")
        )
        if ep_group is not None and (
            (ep_group.world_size, ep_group.rank_in_group) != (moe.ep_size, moe.ep_rank)
            or ep_group.device.type != self.device.type
        ):
            raise ValueError(
                f"ep_group: expected {moe.ep_size} ranks with this one at "
                f"moe.ep_rank={moe.ep_rank} on {self.device.type}, got the "
                f"{ep_group.name} group of {ep_group.world_size} ranks with this "
                f"one at {ep_group.rank_in_group} on {ep_group.device.type}"
            )
        self.moe = moe
        self.layer_name = prefix
        self.renormalize = renormalize
        self.backend = backend
        self.ep_group = ep_group
        self.all2all_backend = all2all_backend
        self.replicated_tokens = replicated_tokens
        self.w13_weight: nn.Parameter | None = None
        self.w2_weight: nn.Parameter | None = None
        self._create_weights()
        self.register_buffer("expert_map", moe.make_expert_map(self.device))
        self.expert_map: torch.Tensor | None
        self.kernel: FusedMoEModularKernel | None = None
        _layers[prefix] = self

    def _create_weights(self) -> None:
        moe = self.moe
        el = moe.num_local_experts
        self.w13_weight = nn.Parameter(
            torch.empty(
                el,
                moe.w13_rows,
                moe.hidden_size,
                dtype=moe.in_dtype,
                device=self.device,
            ),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(
                el,
                moe.hidden_size,
                moe.intermediate_size,
                dtype=moe.in_dtype,
                device=self.device,
            ),
            requires_grad=False,
        )
        # Fresh weights are uninitialized: every local shard must be loaded
        # before they are prepared.
        self._unloaded = {(e, shard) for e in range(el) for shard in ("w1", "w2", "w3")}

    def weight_loader(
        self, loaded_weight: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        """Load one shard of one expert (global id): w1 (gate), w3 (up) or w2.

        Weights of experts that are not local to this rank are skipped (a
        loader may skip reading them: ``moe.placement.local_experts``). Also
        used to reload weights after ``process_weights_after_loading``.
        """
        moe = self.moe
        if not 0 <= expert_id < moe.num_experts:
            raise ValueError(
                f"expert_id: expected 0..{moe.num_experts - 1}, got {expert_id}"
            )
        local_experts = moe.placement.local_experts
        if expert_id not in local_experts:
            return
        local = expert_id - local_experts.start
        if self.w13_weight is None or self.w2_weight is None:
            self._create_weights()  # reload after the prepared weights replaced them
        assert self.w13_weight is not None and self.w2_weight is not None
        inter, hidden = moe.intermediate_size, moe.hidden_size
        targets = {
            "w1": (self.w13_weight.data[local, :inter], (inter, hidden)),
            "w3": (self.w13_weight.data[local, inter:], (inter, hidden)),
            "w2": (self.w2_weight.data[local], (hidden, inter)),
        }
        if shard_id not in targets:
            raise ValueError(f"shard_id: expected 'w1', 'w2' or 'w3', got {shard_id!r}")
        target, shape = targets[shard_id]
        if tuple(loaded_weight.shape) != shape:
            raise ValueError(
                f"loaded_weight: expected {shape} for {shard_id}, got "
                f"{tuple(loaded_weight.shape)}"
            )
        target.copy_(loaded_weight)
        self._unloaded.discard((local, shard_id))

    def stacked_weight_loader(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Load all experts at once from stacked tensors (checkpoints that
        store them fused): w13 [num_experts, 2I, H] with gate rows first,
        w2 [num_experts, H, I]; this rank keeps its local experts."""
        moe = self.moe
        e, i, h = moe.num_experts, moe.intermediate_size, moe.hidden_size
        for name, t, shape in (("w13", w13, (e, 2 * i, h)), ("w2", w2, (e, h, i))):
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name}: expected stacked {shape}, got {tuple(t.shape)}"
                )
        if self.w13_weight is None or self.w2_weight is None:
            self._create_weights()
        assert self.w13_weight is not None and self.w2_weight is not None
        local_experts = moe.placement.local_experts
        local = slice(local_experts.start, local_experts.stop)
        self.w13_weight.data.copy_(w13[local])
        self.w2_weight.data.copy_(w2[local])
        self._unloaded.clear()

    def process_weights_after_loading(self) -> None:
        """Quantize/repack into the backend's experts.

        Attaches no workspace, scratch or lock tensor to the layer or its
        experts; backends that quantize or re-lay the weights out (all but
        grouped_mm) drop the full-precision ones.
        """
        if self.w13_weight is None or self.w2_weight is None:
            raise RuntimeError(f"{self.layer_name}: no weights loaded")
        if self._unloaded:
            missing = sorted(self._unloaded)
            raise ValueError(
                f"{self.layer_name}: {len(missing)} expert shards were not loaded "
                f"(local expert, shard), e.g. {missing[:4]}"
            )
        experts = make_experts(
            self.moe, self.w13_weight.data, self.w2_weight.data, self.backend
        )
        # A reload copies into the live weights, so graphs captured before it
        # keep pointing at valid storage; after lock (graphs captured) a
        # reload that would need new storage is refused.
        if self.kernel is None:
            self.kernel = self._make_kernel(experts)
        elif not copy_tensors_in_place(self.kernel.experts, experts):
            if (
                is_workspace_manager_initialized()
                and current_workspace_manager().is_locked()
            ):
                raise RuntimeError(
                    f"{self.layer_name}: the reloaded weights do not fit the live "
                    f"weight storage that captured graphs use"
                )
            self.kernel = self._make_kernel(experts)
        if not isinstance(self.kernel.experts, GroupedMMExperts):
            self.w13_weight = self.w2_weight = None

    def _make_kernel(self, experts: FusedMoEExperts) -> FusedMoEModularKernel:
        prepare_finalize = make_prepare_finalize(
            self.all2all_backend,
            self.ep_group,
            self.moe.placement,
            self.device,
            self.replicated_tokens,
        )
        return FusedMoEModularKernel(prepare_finalize, experts)

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        gate_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Route ``hidden_states`` by ``router_logits``, or by the router's
        weight ``gate_weight`` [num_experts, hidden], whose GEMM then runs
        fused with the routing where a kernel does that (one token on a
        GPU: :func:`~.routing.gated_topk`). The experts always take top-k
        ids here: routing inside the decode kernels is
        :meth:`forward_normed`'s (the decoder layer's call)."""
        return torch.ops.vllm.moe_forward(
            hidden_states, router_logits, gate_weight, self.layer_name
        )

    def forward_normed(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        gate_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(rms_norm(hidden_states + residual)), hidden_states +
        residual)``: a decoder layer's residual add and post-attention norm
        taken into the layer, where at one token on a GPU they run inside
        the router's kernel (:func:`~.routing.rms_norm_gated_topk`). At
        decode sizes, experts that route from logits take the router's
        (:meth:`FusedMoEModularKernel.forward_routed`): no routing launch."""
        return torch.ops.vllm.moe_forward_normed(
            hidden_states, residual, norm_weight, norm_eps, gate_weight,
            self.layer_name,
        )  # fmt: skip

    def forward_impl(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        gate_weight: torch.Tensor | None,
    ) -> torch.Tensor:
        kernel = self._loaded_kernel()
        topk_weights, topk_ids = self._route(hidden_states, router_logits, gate_weight)
        return kernel.forward(hidden_states, topk_weights, topk_ids, self.expert_map)

    def forward_normed_impl(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        gate_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = self._loaded_kernel()
        self._check_gate(gate_weight, hidden_states.shape[-1])
        check_norm_operands(hidden_states, residual, norm_weight)
        if kernel.routes_from_logits(hidden_states):
            # Decode sizes: the experts' kernels route from the logits.
            logits, normed, total = rms_norm_gated_logits(
                hidden_states, residual, norm_weight, norm_eps, gate_weight
            )
            routed = kernel.forward_routed(
                normed, logits, self.renormalize, self.expert_map
            )
            return routed, total
        topk_weights, topk_ids, normed, total = rms_norm_gated_topk(
            hidden_states, residual, norm_weight, norm_eps, gate_weight,
            self.moe.experts_per_token, self.renormalize,
        )  # fmt: skip
        out = kernel.forward(normed, topk_weights, topk_ids, self.expert_map)
        return out, total

    def _loaded_kernel(self) -> FusedMoEModularKernel:
        if self.kernel is None:
            raise RuntimeError(
                f"{self.layer_name}: call process_weights_after_loading() first"
            )
        return self.kernel

    def _check_gate(self, gate_weight: torch.Tensor, hidden: int) -> None:
        # Another width would route among the wrong experts silently.
        if gate_weight.shape != (self.moe.num_experts, hidden):
            raise ValueError(
                f"gate_weight: expected [{self.moe.num_experts}, {hidden}] (global "
                f"experts, hidden) for {self.layer_name}, got "
                f"{list(gate_weight.shape)}"
            )

    def _route(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        gate_weight: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (num_tokens, hidden), num_experts = hidden_states.shape, self.moe.num_experts
        topk = self.moe.experts_per_token
        if (router_logits is None) == (gate_weight is None):
            given = "neither" if router_logits is None else "both"
            raise ValueError(
                f"router_logits/gate_weight: expected one of them for "
                f"{self.layer_name}, got {given}"
            )
        if gate_weight is not None:
            self._check_gate(gate_weight, hidden)
            return gated_topk(hidden_states, gate_weight, topk, self.renormalize)
        assert router_logits is not None
        if router_logits.shape != (num_tokens, num_experts):
            raise ValueError(
                f"router_logits: expected [{num_tokens}, {num_experts}] (tokens, "
                f"global experts) for {self.layer_name}, got "
                f"{list(router_logits.shape)}"
            )
        return fused_topk(hidden_states, router_logits, topk, self.renormalize)


def get_moe_layer(layer_name: str) -> FusedMoE:
    try:
        return _layers[layer_name]
    except KeyError:
        raise KeyError(f"no FusedMoE layer named {layer_name!r}") from None


# -- runtime op --------------------------------------------------------------

_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define(
    "moe_forward(Tensor hidden_states, Tensor? router_logits, Tensor? gate_weight, "
    "str layer_name) -> Tensor"
)


def _moe_forward(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    layer_name: str,
) -> torch.Tensor:
    return get_moe_layer(layer_name).forward_impl(
        hidden_states, router_logits, gate_weight
    )


def _moe_forward_fake(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    layer_name: str,
) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)  # contiguous, like the op


_lib.impl("moe_forward", _moe_forward, "CompositeExplicitAutograd")
torch.library.register_fake("vllm::moe_forward", _moe_forward_fake, lib=_lib)

_lib.define(
    "moe_forward_normed(Tensor hidden_states, Tensor residual, Tensor norm_weight, "
    "float norm_eps, Tensor gate_weight, str layer_name) -> (Tensor, Tensor)"
)


def _moe_forward_normed(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    gate_weight: torch.Tensor,
    layer_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return get_moe_layer(layer_name).forward_normed_impl(
        hidden_states, residual, norm_weight, norm_eps, gate_weight
    )


def _moe_forward_normed_fake(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    gate_weight: torch.Tensor,
    layer_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden_states.new_empty(hidden_states.shape), residual.new_empty(
        residual.shape
    )


_lib.impl("moe_forward_normed", _moe_forward_normed, "CompositeExplicitAutograd")
torch.library.register_fake(
    "vllm::moe_forward_normed", _moe_forward_normed_fake, lib=_lib
)
