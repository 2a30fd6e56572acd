"""The engine's step loop: schedule -> build the batch -> run the model ->
sample -> update the requests.

Construction follows the lifecycle: init the workspace manager -> load the
model -> a profile run at the largest token budget (the MoE layers' scratch
and workspaces grow to it) -> size the KV cache (``gpu_memory_utilization``
of the GPU after the profile run's peak; on the CPU room for 16 sequences of
``max_model_len``) -> capture CUDA graphs for decode batches -> lock the
manager. After that a step that would need new workspace is an error. The
model runs in a :class:`~vllm.v1.worker.gpu_model_runner.GPUModelRunner`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.transformers_utils.config import load_hf_config
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.scheduler import Scheduler, SchedulerConfig
from vllm.v1.request import Request
from vllm.v1.sample.sampler import sample
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    init_workspace_manager,
    is_workspace_manager_initialized,
)

logger = init_logger(__name__)

BLOCK_SIZE = 16


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
    quantization: str | None = None  # "fp8" or "w4a16", applied while loading
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    seed: int = 0  # dummy weights and the sampling of unseeded requests
    prefix: str = ""  # layer names; unique per engine in a process

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: expected in (0, 1], got "
                f"{self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of the pool's blocks in use


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        # Sizes are checked before minutes of loading.
        positions = load_hf_config(config.model).get("max_position_embeddings")
        self.max_model_len = config.max_model_len or positions or 4096
        if positions is not None and self.max_model_len > positions:
            raise ValueError(
                f"max_model_len: expected <= the model's max_position_embeddings="
                f"{positions}, got {self.max_model_len}"
            )
        scheduler_config = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        torch.manual_seed(config.seed)
        if not is_workspace_manager_initialized():
            init_workspace_manager(self.device)
        manager = current_workspace_manager()
        # Another engine of this process may have locked it: this one warms
        # up too (the slots are shared; engines run one at a time). Locked
        # again whatever happens.
        manager.unlock()
        try:
            self._setup(scheduler_config)
        finally:
            manager.lock()
        logger.info(
            "KV cache: %d blocks of %d tokens", self.pool.num_blocks, BLOCK_SIZE
        )

    def _setup(self, scheduler_config: SchedulerConfig) -> None:
        config = self.config
        model = get_model(
            config.model,
            load_format=config.load_format,
            dtype=config.dtype,
            device=self.device,
            moe_backend=config.moe_backend,
            quantization=config.quantization,
            seed=config.seed,
            prefix=config.prefix,
        )
        assert isinstance(model, Qwen3MoeForCausalLM)
        self.model = model
        if self.device.type == "cuda":
            # The peak must not count weights that loading dropped (the
            # full-precision experts that quantization replaced).
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.runner = GPUModelRunner(
            model,
            self.device,
            BLOCK_SIZE,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.enforce_eager,
        )
        self.runner.profile_run()
        num_blocks = config.num_kv_blocks or self.runner.num_kv_blocks(
            config.gpu_memory_utilization
        )
        if num_blocks * BLOCK_SIZE < self.max_model_len:
            raise ValueError(
                f"gpu_memory_utilization/max_model_len: the KV cache holds "
                f"{max(num_blocks, 0) * BLOCK_SIZE} tokens, fewer than "
                f"max_model_len={self.max_model_len}"
            )
        self.pool = BlockPool(num_blocks, BLOCK_SIZE)
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_decode_graphs()
        self.scheduler = Scheduler(scheduler_config, self.pool)

    # -- requests ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request after checking it (errors name the field; the
        engine state is untouched when one is raised)."""
        params, ids = request.sampling_params, request.prompt_token_ids
        total = len(ids) + params.max_tokens
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt: expected at least one token, got none")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(
                f"prompt: token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}"
            )
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs: expected <= {vocab}, got {params.logprobs}")
        if self.scheduler.has_request(request.request_id):
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        if total > self.max_model_len:
            raise ValueError(
                f"prompt: {len(request.prompt_token_ids)} tokens + max_tokens="
                f"{request.sampling_params.max_tokens} exceed max_model_len="
                f"{self.max_model_len}"
            )
        if request.sampling_params.seed is not None:
            request.generator = torch.Generator(self.device).manual_seed(
                request.sampling_params.seed
            )
        self.scheduler.add_request(request)

    def finish_request(self, request_id: str, reason: str = "abort") -> None:
        self.scheduler.finish_request(request_id, reason)

    def stats(self) -> SchedulerStats:
        pool = self.pool
        return SchedulerStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            1.0 - pool.num_free_blocks / pool.num_blocks,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it."""
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler: requests wait but none can run")
            return []
        sampling = [c for c in chunks if c.samples]
        with self.runner.on_stream():  # the step's logits are read there
            logits = self.runner.execute(chunks, self.pool)
            tokens = sample(
                logits,
                [c.request.sampling_params for c in sampling],
                [c.request.generator for c in sampling],
            )
        for chunk, token in zip(sampling, tokens, strict=True):
            chunk.request.append_token(
                token.token_id, token.logprob, token.top_logprobs
            )
        return self.scheduler.finish_step(chunks)
