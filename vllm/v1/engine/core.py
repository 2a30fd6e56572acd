"""The engine's step loop: schedule -> build the batch -> run the model ->
sample -> update the requests.

Construction follows the lifecycle: init the workspace manager -> load the
model -> a profile run at the largest token budget (the MoE layers' scratch
and workspaces grow to it) -> size the KV cache (``gpu_memory_utilization``
of the GPU after the profile run's peak; on the CPU room for 16 sequences of
``max_model_len``) -> capture CUDA graphs for decode batches -> lock the
manager. After that a step that would need new workspace is an error. The
model runs in a :class:`~vllm.v1.worker.gpu_model_runner.GPUModelRunner`.

Data + expert parallelism (``data_parallel_size`` > 1 with
``enable_expert_parallel``): one ``EngineCore`` per rank, each the engine of
its own requests (its workspace manager, KV cache and scheduler) with the
MoE layers sharded over the expert-parallel group, which must be
initialized first; :class:`~vllm.v1.engine.dp_engine.DPEngineCore` starts
the ranks and steps them in lockstep. Their runners agree on each step's
shape and replay CUDA graphs of one size (eager with the ``all2all``
backend or dual-batch overlap), and a rank without work runs
:meth:`EngineCore.execute_dummy_batch` so that its MoE layers meet the
other ranks' collectives. ``enable_expert_parallel`` with one rank is a
no-op (it holds every expert), and ``data_parallel_size`` > 1 without it is
refused: data parallelism exists here to shard the experts.

Tensor + expert parallelism (``tensor_parallel_size`` > 1 with
``enable_expert_parallel``, ``data_parallel_size`` 1): the ranks split the
attention heads, the dense MLPs and the experts, and every rank runs the
same batch: each one's engine gets the same requests (from
``DPEngineCore``), the ranks agree on one KV cache size, and their
schedulers, steps and samples stay identical (the logits are, after the
all-reduces, and unseeded requests draw from each engine's own generator,
seeded alike).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm.distributed import (
    CollectiveError,
    GroupCoordinator,
    get_ep_group,
    get_tp_group,
    model_parallel_is_initialized,
)
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.transformers_utils.config import load_hf_config
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.utils import to_device
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from vllm.v1.engine.config import EngineConfig
from vllm.v1.request import Request, RequestStatus
from vllm.v1.sample.prompt_logprobs import (
    MAX_PROMPT_LOGPROBS,
    PromptLogprobsBatch,
    prompt_rows_of,
)
from vllm.v1.sample.sampler import SampledBatch, TokenHistory, sample_async
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    init_workspace_manager,
    is_workspace_manager_initialized,
)

logger = init_logger(__name__)

# An engine with nothing to run but requests whose grammars compile waits for
# them this long per step (then looks at its inbox again).
GRAMMAR_POLL_S = 0.005

BLOCK_SIZE = 16


@dataclass(frozen=True)
class _Launched:
    """A step on the device: its chunks, those that sample, their tokens."""

    chunks: list[ScheduledChunk]
    sampling: list[ScheduledChunk]
    sampled: SampledBatch
    done: torch.cuda.Event | None  # recorded after it where the wait is bounded
    prompt_logprobs: PromptLogprobsBatch | None = None


@dataclass(frozen=True)
class StepShape:
    """What one step computed (on this rank): decode-only when every
    request took one token (the steps that replay a CUDA graph where
    graphs are captured)."""

    tokens: int
    requests: int

    @property
    def decode_only(self) -> bool:
        return self.tokens == self.requests > 0


@dataclass(frozen=True)
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of the pool's blocks in use
    # since the start, in tokens: asked of the prefix cache by requests
    # joining a batch, and found there
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        # Sizes are checked before minutes of loading.
        positions = load_hf_config(config.model).get("max_position_embeddings")
        given = config.max_model_len
        self.max_model_len = given if given is not None else positions or 4096
        if positions is not None and self.max_model_len > positions:
            raise ValueError(
                f"max_model_len: expected <= the model's max_position_embeddings="
                f"{positions}, got {self.max_model_len}"
            )
        scheduler_config = SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            micro_batched=config.enable_dbo,
        )
        # Checked before loading; None without expert (tensor) parallelism.
        self.ep_group = self._expert_parallel_group()
        self.tp_group = get_tp_group() if config.tensor_parallel_size > 1 else None
        torch.manual_seed(config.seed)
        # Unseeded requests draw from the engine's own generator: nothing
        # else in the process advances it, so tensor-parallel ranks (which
        # must sample alike) stay in step whatever the caller does.
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self._structured: StructuredOutputManager | None = None
        num_ubatches = 2 if config.enable_dbo else 1
        if not is_workspace_manager_initialized():
            init_workspace_manager(self.device, num_ubatches=num_ubatches)
        manager = current_workspace_manager()
        if manager.num_ubatches < num_ubatches:
            raise ValueError(
                f"enable_dbo: the process's workspace manager has "
                f"{manager.num_ubatches} ubatch slot(s), the micro-batches need "
                f"{num_ubatches}; reset_workspace_manager() first"
            )
        # Another engine of this process may have locked it: this one warms
        # up too (the slots are shared; engines run one at a time). Locked
        # again whatever happens.
        manager.unlock()
        try:
            self._setup(scheduler_config)
        finally:
            manager.lock()
        # what this engine's warm-up left in the manager: all it will hold
        self.workspace_report = manager.memory_report()
        logger.info(
            "KV cache: %d blocks of %d tokens; workspace at lock: %d bytes in %d "
            "slot(s)",
            self.pool.num_blocks,
            BLOCK_SIZE,
            self.workspace_report.total_bytes,
            len(self.workspace_report.slots),
        )

    def _expert_parallel_group(self) -> GroupCoordinator | None:
        """This rank's expert-parallel group; None without expert
        parallelism."""
        config = self.config
        if not config.expert_parallel:
            return None
        group = get_ep_group() if model_parallel_is_initialized() else None
        if group is None or group.world_size != config.world_size:
            raise ValueError(
                f"data_parallel_size x tensor_parallel_size: {config.world_size} "
                f"ranks with enable_expert_parallel need an initialized "
                f"expert-parallel group of that size in every rank, got "
                f"{'none' if group is None else group.world_size}; build the "
                f"engine with DPEngineCore or LLM(data_parallel_size=...)"
            )
        if config.enable_dbo and not group.ubatch_groups:
            raise ValueError(
                "enable_dbo: the expert-parallel group has one communicator; "
                "the micro-batches need initialize_model_parallel(num_ubatches=2)"
            )
        return group

    def _setup(self, scheduler_config: SchedulerConfig) -> None:
        config, ep_group = self.config, self.ep_group
        # Graphs need the token exchange's sizes known before the step: the
        # all2all backend's come from the routing, and the micro-batches of
        # dual-batch overlap are split per step.
        eager_ep = ep_group is not None and (
            config.all2all_backend == "all2all" or config.enable_dbo
        )
        if eager_ep and not config.enforce_eager:
            logger.info(
                "expert parallelism with %s: every step runs eagerly (no CUDA graphs)",
                "dual-batch overlap" if config.enable_dbo else "the all2all backend",
            )
        model = get_model(
            config.model,
            load_format=config.load_format,
            dtype=config.dtype,
            device=self.device,
            moe_backend=config.moe_backend,
            quantization=config.quantization,
            seed=config.seed,
            prefix=config.prefix,
            ep_group=ep_group,
            all2all_backend=config.all2all_backend,
            tp_group=self.tp_group,
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
            config.enforce_eager or eager_ep,
            dbo=config.enable_dbo,
            # tensor-parallel ranks run the same steps: nothing to agree on
            dp_group=None if eager_ep or self.tp_group is not None else ep_group,
        )
        self.runner.profile_run()
        num_blocks = config.num_kv_blocks or self.runner.num_kv_blocks(
            config.gpu_memory_utilization
        )
        if self.tp_group is not None:  # one batch on every rank: one cache size
            mine = torch.tensor([num_blocks], device=self.device)
            num_blocks = int(self.tp_group.all_gather(mine).min())
        if num_blocks * BLOCK_SIZE < self.max_model_len:
            raise ValueError(
                f"gpu_memory_utilization/max_model_len: the KV cache holds "
                f"{max(num_blocks, 0) * BLOCK_SIZE} tokens, fewer than "
                f"max_model_len={self.max_model_len}"
            )
        self.pool = BlockPool(num_blocks, BLOCK_SIZE, config.enable_prefix_caching)
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_graphs()
        self.scheduler = Scheduler(scheduler_config, self.pool)
        # steps whose graphs hold collectives: their host sync is bounded
        self._bounded_wait = ep_group is not None and bool(self.runner.graphs)
        self.last_tokens: dict[str, int] = {}  # tensor parallelism: by request
        self.last_step = StepShape(0, 0)
        self._in_flight: _Launched | None = None

    # -- requests ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request after checking it (errors name the field; the
        engine state is untouched when one is raised)."""
        self.check_request(request)
        if self.scheduler.has_request(request.request_id):
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        params = request.sampling_params
        if params.structured_outputs is not None:
            structured = self._structured_output()
            if self.tp_group is None:
                structured.start(request)
            else:  # compiled at once on every rank: their schedules stay equal
                request.grammar = structured.matcher(params.structured_outputs)
        if params.seed is not None:
            request.generator = torch.Generator(self.device).manual_seed(params.seed)
        self.scheduler.add_request(request)

    def _structured_output(self) -> StructuredOutputManager:
        """The grammar compiler, made with the first request that needs it
        (with the checkpoint's tokenizer)."""
        if self._structured is None:
            tokenizer = get_tokenizer(self.config.model)
            if tokenizer is None:
                raise ValueError(
                    "structured_outputs: needs the tokenizer files in the "
                    "checkpoint directory"
                )
            vocab = self.model.config.vocab_size
            self._structured = StructuredOutputManager(tokenizer, vocab)
        return self._structured

    def check_request(self, request: Request) -> None:
        """Raise ``ValueError`` naming the field if this engine's model
        cannot run ``request`` (its prompt, length, logprobs, logit bias or
        grammar)."""
        params, ids = request.sampling_params, request.prompt_token_ids
        total = len(ids) + params.max_tokens
        vocab = self.model.config.vocab_size
        if params.structured_outputs is not None:
            structured = self._structured_output()
            if self.tp_group is None:
                structured.validate(params.structured_outputs)
            else:  # compiled now: no rank can fail to compile it when added
                structured.matcher(params.structured_outputs)
        if params.n != 1:
            raise ValueError(
                f"n: the engine runs one sequence per request (fan them out with "
                f"SamplingParams.fan_out()), got {params.n}"
            )
        if not ids:
            raise ValueError("prompt: expected at least one token, got none")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(
                f"prompt: token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}"
            )
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs: expected <= {vocab}, got {params.logprobs}")
        if params.prompt_logprobs is not None:
            if params.prompt_logprobs > MAX_PROMPT_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs: expected <= {MAX_PROMPT_LOGPROBS}, got "
                    f"{params.prompt_logprobs}"
                )
            if self.runner.dp_group is not None or self.config.enable_dbo:
                raise ValueError(
                    "prompt_logprobs: not supported where ranks or micro-batches "
                    "agree on CUDA graphs (data parallelism with graphs, "
                    "dual-batch overlap): such a step runs eagerly on its own"
                )
        if params.logit_bias and (largest := max(params.logit_bias)) >= vocab:
            raise ValueError(f"logit_bias: expected token ids < {vocab}, got {largest}")
        stops = params.stop_token_ids
        if stops and not 0 <= min(stops) <= max(stops) < vocab:
            raise ValueError(
                f"stop_token_ids: expected token ids in [0, {vocab}), got {stops}"
            )
        if total > self.max_model_len:
            raise ValueError(
                f"prompt: {len(request.prompt_token_ids)} tokens + max_tokens="
                f"{request.sampling_params.max_tokens} exceed max_model_len="
                f"{self.max_model_len}"
            )

    def finish_request(self, request_id: str, reason: str = "abort") -> None:
        self.scheduler.finish_request(request_id, reason)

    def finish_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        self.scheduler.finish_requests(request_ids, reason)

    def stats(self) -> SchedulerStats:
        pool = self.pool
        scheduler = self.scheduler
        return SchedulerStats(
            len(scheduler.running),
            len(scheduler.waiting),
            1.0 - pool.num_free_blocks / pool.num_blocks,
            scheduler.prefix_cache_queries,
            scheduler.prefix_cache_hits,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the step ------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it. With
        ``async_scheduling`` the step is launched and the one before it
        resolved: the host schedules and fills step N + 1 while the GPU
        still runs step N, and the requests returned finished in step N."""
        if self._structured is not None and self._structured.compiling:
            for failed in self._structured.take_compiled():
                self.scheduler.finish_request(failed.request_id, "abort")
        chunks = self.scheduler.schedule()
        self.last_step = StepShape(sum(c.end - c.start for c in chunks), len(chunks))
        launched, finished = self._launch(chunks) if chunks else (None, None)
        if not self.config.async_scheduling:
            return self._resolve(launched) if launched else self._stalled()
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            return self._resolve(previous)
        return finished if finished is not None else self._stalled()

    def _stalled(self) -> list[Request]:
        """Nothing resolved this step. Where nothing runs on the device
        either: a short wait if grammars compile (rather than a loop of
        empty steps; not on ranks stepped in lockstep, whose peers would
        wait too), else an error if requests wait (none can ever run)."""
        if self._in_flight is not None:
            return []
        if self._structured is not None and self._structured.compiling:
            if self.ep_group is None:
                self._structured.wait_compiling(GRAMMAR_POLL_S)
        elif self.scheduler.has_unfinished():
            raise RuntimeError("scheduler: requests wait but none can run")
        return []

    def _launch(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[_Launched, list[Request] | None]:
        """The step's forward and sampling queued on the device; and where
        its grammar rows' masks needed the step in flight's tokens, that
        step resolved (while this one's forward runs) and its finished
        requests."""
        sampling = [c for c in chunks if c.samples]
        params = [c.request.sampling_params for c in sampling]
        rows, prompt_rows = prompt_rows_of(chunks)
        prompt_logprobs = None
        with self.runner.on_stream():  # the step's logits are read there
            if prompt_rows:
                logits, hidden = self.runner.execute_keeping_rows(
                    chunks, self.pool, rows
                )
                prompt_logprobs = PromptLogprobsBatch(
                    hidden, prompt_rows, self.model.compute_logits
                )
            else:
                logits = self.runner.execute(chunks, self.pool)
            finished, masks = None, None
            grammars = [c.request.grammar for c in sampling]
            if self._in_flight is not None and any(
                g is not None and c.request.num_pending_tokens > 1
                for c, g in zip(sampling, grammars, strict=True)
            ):  # a grammar's next mask needs the token in flight
                finished, self._in_flight = self._resolve(self._in_flight), None
            if self._structured is not None:
                live = [  # (a request that finished there samples in vain)
                    None if c.request.status is RequestStatus.FINISHED else g
                    for c, g in zip(sampling, grammars, strict=True)
                ]
                masks = self._structured.token_masks(live, logits.device)
            history = None
            if any(p.penalized for p in params):
                history = self._token_history([c.request for c in sampling])
            sampled = sample_async(
                logits,
                params,
                [c.request.generator for c in sampling],
                self.generator,
                history,
                {
                    row: bans
                    for row, c in enumerate(sampling)
                    if (bans := c.request.min_tokens_bans())
                },
                masks,
            )
            done = None
            if self._bounded_wait:
                done = torch.cuda.Event()
                done.record()
        if self.config.async_scheduling:  # the next step's inputs
            self.runner.remember_sampled(
                sampled.device_tokens, [c.request.request_id for c in sampling]
            )
        return _Launched(chunks, sampling, sampled, done, prompt_logprobs), finished

    def _token_history(self, requests: list[Request]) -> TokenHistory:
        """What the requests' penalties count. Under async scheduling a
        request's last token may still be the step in flight's, on the
        device: taken from there (a request's pending tokens are this step's
        and, past one, the step in flight's)."""
        pending = None
        if any(r.num_pending_tokens > 1 for r in requests):
            assert self._in_flight is not None  # it sampled those tokens
            rows = {
                c.request.request_id: i for i, c in enumerate(self._in_flight.sampling)
            }
            tokens = self._in_flight.sampled.device_tokens
            index = [
                rows[r.request_id] if r.num_pending_tokens > 1 else -1 for r in requests
            ]
            where = to_device(index, torch.long, tokens.device)
            pending = torch.where(where >= 0, tokens[where.clamp(min=0)], -1)
        return TokenHistory(
            [r.prompt_array for r in requests],
            [r.output_token_ids for r in requests],
            pending,
        )

    def _resolve(self, launched: _Launched) -> list[Request]:
        """The launched step's tokens appended; its finished requests."""
        if launched.done is not None:
            self._wait_bounded(launched.done)
        if launched.prompt_logprobs is not None:
            for rows, entries in launched.prompt_logprobs.tolist():
                rows.request.add_prompt_logprobs(rows.first_token, entries)
        tokens = launched.sampled.tolist()
        refused = set()
        for chunk, token in zip(launched.sampling, tokens, strict=True):
            request = chunk.request
            grammar = request.grammar
            live = request.status is not RequestStatus.FINISHED
            # the grammar takes a token before it is appended: one it
            # refuses never is
            if (
                grammar is not None
                and live
                and not grammar.accept_token(token.token_id)
            ):
                request.finish("abort")
                refused.add(request.request_id)
            request.resolve_token(token.token_id, token.logprob, token.top_logprobs)
            running = grammar is not None and request.finish_reason is None
            if running and grammar.is_terminated():  # its stop token is in
                request.finish("stop")  # (under ignore_eos too)
        if self.tp_group is not None:  # what the other ranks must have sampled
            self.last_tokens = {  # (a refused token: none, as the ranks report)
                c.request.request_id: t.token_id
                for c, t in zip(launched.sampling, tokens, strict=True)
                if c.request.request_id not in refused
            }
        return self.scheduler.finish_step(launched.chunks)

    def _wait_bounded(self, done: torch.cuda.Event) -> None:
        """Wait for ``done`` at most ``distributed_timeout_s``: collectives
        captured in a CUDA graph are outside NCCL's watchdog, and a peer that
        died mid-step would hang them (and a plain sync) forever."""
        deadline = time.monotonic() + self.config.distributed_timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"a step's expert-parallel collectives did not finish within "
                    f"distributed_timeout_s={self.config.distributed_timeout_s}s: "
                    f"a peer died or stopped answering"
                )
            time.sleep(0)  # yield, no timer: a sleep costs ~60 us, 2% of a step

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """An idle data-parallel rank's share of a step, which calls every
        MoE layer as the busy ranks' steps do (no sampling; see
        ``GPUModelRunner.execute_dummy``)."""
        with self.runner.on_stream():
            self.runner.execute_dummy()
