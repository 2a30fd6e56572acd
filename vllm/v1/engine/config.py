"""What an engine is built with (:class:`EngineConfig`), checked whole
before anything loads: every refusal names the field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.model_executor.layers.fused_moe.prepare_finalize import (
    check_all2all_backend,
)


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # fixed KV cache size (tests, CPU)
    moe_backend: str = "auto"
    quantization: str | None = None  # "fp8", "w4a16" or "w4a8", applied while loading
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # a request reuses the KV cache's blocks of an earlier one's equal prefix
    # (whole blocks; on by default, as in vLLM)
    enable_prefix_caching: bool = True
    seed: int = 0  # dummy weights and the sampling of unseeded requests
    prefix: str = ""  # layer names; unique per engine in a process
    data_parallel_size: int = 1  # ranks, one process (and one GPU) each
    # ranks that split attention heads and dense MLPs, running the same batch
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # shard the experts over the ranks
    all2all_backend: str = "allgather_reducescatter"  # the ranks' token exchange
    distributed_timeout_s: float = 600.0  # bound on every collective of the ranks
    # schedule and fill step N + 1 while the GPU runs step N (a request that
    # stops computes one token past its end); None: on for one rank on a GPU
    # (vLLM's default since 0.14); data-parallel ranks take it when asked
    # (not yet measured on GPUs), tensor-parallel ones and DBO do not
    async_scheduling: bool | None = None
    # dual-batch overlap: every step as two micro-batches on two threads, one's
    # token exchange overlapping the other's compute (expert parallelism only)
    enable_dbo: bool = False

    def __post_init__(self) -> None:
        if self.async_scheduling is None:
            supported = self.world_size == 1
            on = supported and torch.device(self.device).type == "cuda"
            object.__setattr__(self, "async_scheduling", on)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: expected in (0, 1], got "
                f"{self.gpu_memory_utilization}"
            )
        for name in ("data_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size > 1 and (
            self.data_parallel_size > 1 or not self.enable_expert_parallel
        ):
            raise ValueError(
                f"tensor_parallel_size: {self.tensor_parallel_size} ranks need "
                f"enable_expert_parallel=True (the experts split over the same "
                f"ranks) and data_parallel_size=1 (both at once are not "
                f"supported), got enable_expert_parallel="
                f"{self.enable_expert_parallel}, data_parallel_size="
                f"{self.data_parallel_size}"
            )
        if self.data_parallel_size > 1 and not self.enable_expert_parallel:
            raise ValueError(
                f"data_parallel_size: {self.data_parallel_size} ranks need "
                f"enable_expert_parallel=True (data parallelism shards the "
                f"experts; replicated experts are not supported)"
            )
        check_all2all_backend(self.all2all_backend)
        if self.tensor_parallel_size > 1 and self.all2all_backend == "all2all":
            raise ValueError(
                "all2all_backend: tensor-parallel ranks hold the same tokens and "
                "exchange none; leave the default"
            )
        if self.enable_dbo and not (
            self.enable_expert_parallel and self.data_parallel_size > 1
        ):
            raise ValueError(
                f"enable_dbo: needs data_parallel_size > 1 with "
                f"enable_expert_parallel (the micro-batches overlap the ranks' "
                f"token exchange), got data_parallel_size="
                f"{self.data_parallel_size}, enable_expert_parallel="
                f"{self.enable_expert_parallel}"
            )
        if self.async_scheduling and (self.tensor_parallel_size > 1 or self.enable_dbo):
            raise ValueError(
                "async_scheduling: not supported with tensor parallelism (its "
                "ranks check each step's tokens) or dual-batch overlap, got "
                f"tensor_parallel_size={self.tensor_parallel_size}, "
                f"enable_dbo={self.enable_dbo}"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError(
                f"distributed_timeout_s: expected > 0, got {self.distributed_timeout_s}"
            )

    @property
    def world_size(self) -> int:
        """Ranks: one process (and one GPU) each."""
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def expert_parallel(self) -> bool:
        """The experts are sharded over more than one rank."""
        return self.enable_expert_parallel and self.world_size > 1
