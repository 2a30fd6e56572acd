"""The engine's model runner: turns a step's scheduled chunks into logits.

Lifecycle (the engine calls these in order, then locks the workspace
manager): ``profile_run`` (one step at the largest token budget: the MoE
scratch and workspaces grow to it, and its peak sizes the KV cache) ->
``initialize_kv_cache`` -> ``capture_graphs`` (CUDA only, unless
``enforce_eager``).

Every GPU step, eager or replayed, runs on the runner's own stream, the one
it warmed up and captured on: the lock buffers of the Marlin and Humming
experts are per stream, and after lock the manager hands out no others.
Callers wrap each step and what reads its logits in ``on_stream()``.

Every step replays a CUDA graph captured at the next size up; the graphs
read the step from persistent input buffers that every step fills:

- pure-decode steps (every request computes one token), by requests: the
  padding rows are requests of one token whose key and value go to the null
  block, one cache block past the pool's (no request ever owns it). Their
  logits land in rows of one buffer that all of them share (a graph's
  outputs stay allocated: a logits tensor per graph cost 1.3 GB at 256
  sequences and Qwen3's vocabulary);
- steps with prefill, by tokens (the largest is the token budget): the
  request count is always ``max_num_seqs``, the padding requests have no
  tokens, and the padding tokens belong to no request (their keys and
  values go to the null block, their attention rows are zeros, their
  outputs are never read). These graphs end at the hidden states of the
  sampling rows, and the head runs after the replay.

An eager step there takes tens of milliseconds of host time for its
launches alone (48 layers), several times the GPU's share of a mixed step.

Expert parallelism (``dp_group``: the ranks step in lockstep): before each
step the ranks agree on its shape (one all-gather of token counts and
whether the step decodes, read on the host): all replay graphs of one
size, the smallest that holds every rank's step (a decode graph only if
every rank decodes), ranks without requests replaying padding; where none
holds it, all run eagerly, each knowing the others' counts. Either way the
MoE layers' token exchange reads its counts from the host
(``DPMetadata``): no device sync, so the graphs hold it. The ``all2all``
backend's split sizes depend on the routing and are read on the host: its
engine runs eagerly.

Dual-batch overlap (``dbo``, expert parallelism: eager steps): a step's
requests split into two micro-batches of about equal tokens, each run on its
own thread (:func:`~vllm.v1.worker.ubatching.run_ubatches`: its workspace
slot and, in the expert-parallel group, its communicator) and CUDA stream,
so that one's token exchange overlaps the other's compute. A micro-batch
without requests runs a one-token forward: every rank calls every MoE
layer's collectives once per ubatch. The profile run grows both slots to
the whole token budget (one request may fill a micro-batch), running both
at once so that the peak it measures holds both.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from vllm.distributed import GroupCoordinator
from vllm.forward_context import DPMetadata, set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention, bind_kv_cache
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.utils import to_device
from vllm.v1.attention.backends.torch_paged import PagedAttentionMetadata
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.scheduler import ScheduledChunk
from vllm.v1.cudagraph_dispatcher import (
    StepPlan,
    decode_capture_sizes,
    mixed_capture_sizes,
    plan_step,
)
from vllm.v1.worker.ubatching import balanced_split, run_ubatches_on_streams

logger = init_logger(__name__)

T = TypeVar("T")

_CPU_FULL_SEQUENCES = 16


@dataclass
class _StepGraph:
    graph: torch.cuda.CUDAGraph
    # decode: logits [size, vocab]; prefill: hidden states of the sampling
    # rows [max_num_seqs, hidden]. Rewritten by every replay.
    output: torch.Tensor


def query_bound(chunks: list[ScheduledChunk]) -> int:
    """The step's ``max_query_len``: its longest chunk, and at least 2 when
    a chunk reads keys that the step itself stores (``reads_step_kv``):
    decode batches (bound 1) store theirs inside attention, where other
    programs of the launch may read first."""
    longest = max(c.end - c.start for c in chunks)
    return max(longest, 2) if any(c.reads_step_kv for c in chunks) else longest


class GPUModelRunner:
    def __init__(
        self,
        model: Qwen3MoeForCausalLM,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enforce_eager: bool,
        dbo: bool = False,
        dp_group: GroupCoordinator | None = None,
    ) -> None:
        self.model, self.device, self.block_size = model, device, block_size
        # expert parallelism: the ranks that agree on each step's shape (the
        # micro-batches of dual-batch overlap exchange their own counts)
        assert not (dbo and dp_group), "dual-batch overlap plans no steps"
        self.dp_group = dp_group
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enforce_eager = enforce_eager
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # one stream per micro-batch under dual-batch overlap
        self.ubatch_streams = [
            torch.cuda.Stream(device) if device.type == "cuda" else None
            for _ in range(2 if dbo else 0)
        ]
        if self.stream is not None:  # the weights were written on the default one
            self.stream.wait_stream(torch.cuda.current_stream(device))
        tokens, seqs = max_num_batched_tokens, max_num_seqs
        max_blocks = -(-max_model_len // block_size)
        with self.on_stream():
            self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
            self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
            self.slot_mapping = torch.zeros(tokens, dtype=torch.long, device=device)
            self.query_start_loc = torch.zeros(
                seqs + 1, dtype=torch.int32, device=device
            )
            self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
            self.block_table = torch.zeros(
                seqs, max_blocks, dtype=torch.int32, device=device
            )
            self.logits_rows = torch.zeros(seqs, dtype=torch.long, device=device)
        self.null_block = -1  # set with the KV cache
        self.graphs: dict[int, _StepGraph] = {}  # decode, by requests
        self.mixed_graphs: dict[int, _StepGraph] = {}  # with prefill, by tokens
        self._last_tokens: torch.Tensor | None = None  # remember_sampled
        self._last_rows: dict[str, int] = {}

    def on_stream(self) -> AbstractContextManager[object]:
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        )

    # -- setup ---------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One step of ``max_num_batched_tokens`` dummy tokens, the largest
        batch the engine runs: sequences as long as a step computes (the
        attention's peak); logits for at most ``max_num_seqs`` rows, as the
        steps compute them."""
        budget = self.max_num_batched_tokens
        longest = min(self.max_model_len, budget)
        lens = [longest] * (budget // longest)
        lens += [budget % longest] if budget % longest else []
        pool = BlockPool(sum(-(-n // self.block_size) for n in lens), self.block_size)
        for i, n in enumerate(lens):
            pool.allocate(str(i), n)
        with self.on_stream():
            bind_kv_cache(self.model, pool.num_blocks, self.block_size)
            meta = PagedAttentionMetadata.build(
                pool, [(str(i), 0, n) for i, n in enumerate(lens)], self.device
            )
            ids = torch.zeros(budget, dtype=torch.long, device=self.device)
            positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
            rows = min(self.max_num_seqs, budget)

            def forward() -> None:
                with set_forward_context(meta):
                    self.model.compute_logits(self.model(ids, positions)[-rows:])

            if self.ubatch_streams:  # at once: the peak holds both
                self._run_ubatches([forward] * len(self.ubatch_streams))
            else:
                forward()
        self._synchronize()
        for layer in self._attention_layers():
            layer.kv_cache = None  # the profile run's cache goes first

    def kv_block_bytes(self) -> int:
        """Bytes of one block of every layer's keys and values."""
        itemsize = next(self.model.parameters()).element_size()
        return sum(
            2 * self.block_size * m.num_kv_heads * m.head_size * itemsize
            for m in self._attention_layers()
        )

    def num_kv_blocks(self, gpu_memory_utilization: float) -> int:
        """Blocks that fit in ``gpu_memory_utilization`` of the GPU after the
        profile run's peak (one kept back for the null block); on the CPU,
        room for 16 sequences of ``max_model_len``."""
        if self.device.type != "cuda":
            per_seq = -(-self.max_model_len // self.block_size)
            return min(self.max_num_seqs, _CPU_FULL_SEQUENCES) * per_seq
        total = torch.cuda.get_device_properties(self.device).total_memory
        peak = torch.cuda.max_memory_allocated(self.device)
        return int((gpu_memory_utilization * total - peak) // self.kv_block_bytes()) - 1

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Caches of ``num_blocks`` pool blocks plus the null block."""
        with self.on_stream():
            bind_kv_cache(self.model, num_blocks + 1, self.block_size)
        self.null_block = num_blocks

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """The graphs of steps with prefill, then of decode steps, each
        largest first (all share one memory pool) and warmed up eagerly
        first: the capture sees no first-time allocation or compilation."""
        if self.stream is None or self.enforce_eager:
            return
        seqs = self.max_num_seqs
        mixed_sizes = mixed_capture_sizes(self.max_num_batched_tokens)
        decode_sizes = decode_capture_sizes(min(seqs, self.max_num_batched_tokens))
        pool = None
        with self.on_stream():
            for size in mixed_sizes:
                self._fill_mixed_padding(0, 0, size)
                # any max_query_len > 1 launches the prefill kernels
                meta = self._metadata(seqs, size, max_query_len=size)
                self._forward_sampling_rows(size, meta)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                    hidden = self._forward_sampling_rows(size, meta)
                pool = graph.pool()
                self.mixed_graphs[size] = _StepGraph(graph, hidden)
            shared_logits: torch.Tensor | None = None
            for size in decode_sizes:
                self._fill_decode_padding(0, size)
                meta = self._metadata(size, size, max_query_len=1)
                logits = self._forward_logits(size, meta)
                if shared_logits is None:  # the largest size comes first
                    shared_logits = torch.empty_like(logits)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                    shared_logits[:size].copy_(self._forward_logits(size, meta))
                pool = graph.pool()
                self.graphs[size] = _StepGraph(graph, shared_logits[:size])
        self._synchronize()
        logger.info(
            "captured CUDA graphs: steps with prefill of %s tokens, decode "
            "batches of %s requests",
            mixed_sizes,
            decode_sizes,
        )

    # -- steps ---------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], pool: BlockPool) -> torch.Tensor:
        """Logits [chunks that sample, vocab] of the step's ``chunks``, whose
        blocks ``pool`` holds. Call inside ``on_stream()``. After a replay
        they may be a view of the graph's output, which the next replay
        rewrites: consume them on the stream before the next step (as
        sampling does) or copy them."""
        num_seqs = len(chunks)
        num_tokens = self._fill_inputs(chunks, pool)
        ends = self._sampling_rows(chunks)
        if self.ubatch_streams:
            return self._execute_ubatches(chunks, ends)
        plan = self._plan(num_tokens, decode=query_bound(chunks) == 1)
        if plan.size is not None and plan.decode:
            if plan.size > num_seqs:
                self._fill_decode_padding(num_seqs, plan.size)
            entry = self.graphs[plan.size]
            entry.graph.replay()
            if len(ends) == num_seqs:  # a slice: no index copy, no kernel
                return entry.output[:num_seqs]
            return entry.output[self._rows(ends)]
        if plan.size is not None:
            self._fill_mixed_padding(num_seqs, num_tokens, plan.size)
            rows = np.zeros(self.max_num_seqs, np.int64)
            rows[: len(ends)] = ends
            self.logits_rows.copy_(torch.from_numpy(rows), non_blocking=True)
            entry = self.mixed_graphs[plan.size]
            entry.graph.replay()
            return self.model.compute_logits(entry.output[: len(ends)])
        hidden = self._eager_hidden(chunks, num_tokens, plan.dp_metadata)
        return self.model.compute_logits(hidden[self._rows(ends)])

    @torch.inference_mode()
    def execute_keeping_rows(
        self, chunks: list[ScheduledChunk], pool: BlockPool, rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`execute`, eagerly and in one batch (no graphs, no
        micro-batches), also returning the hidden states of the step's
        ``rows`` (a prompt's log-probabilities need every row's logits).
        One rank's step only: ranks that exchange tokens must agree on
        graphs, which this does not ask them."""
        num_tokens = self._fill_inputs(chunks, pool)
        hidden = self._eager_hidden(chunks, num_tokens, None)
        logits = self.model.compute_logits(
            hidden[self._rows(self._sampling_rows(chunks))]
        )
        return logits, hidden[self._rows(rows)]

    @staticmethod
    def _sampling_rows(chunks: list[ScheduledChunk]) -> list[int]:
        """Rows of the chunks that sample, from the host (a device mask would
        sync before the replay); all of a decode step's rows sample."""
        ends, end = [], 0
        for chunk in chunks:
            end += chunk.end - chunk.start
            if chunk.samples:
                ends.append(end - 1)
        return ends

    def _eager_hidden(
        self,
        chunks: list[ScheduledChunk],
        num_tokens: int,
        dp_metadata: DPMetadata | None,
    ) -> torch.Tensor:
        meta = self._metadata(len(chunks), num_tokens, query_bound(chunks))
        with set_forward_context(meta, dp_metadata):
            return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _plan(self, num_tokens: int, decode: bool) -> StepPlan:
        """How this step runs. Under expert parallelism the ranks agree
        first (one all-gather of their shapes, read on the host): all replay
        graphs of one size (their token exchanges match), or all run
        eagerly, each knowing the others' token counts."""
        group = self.dp_group
        if group is None:
            return plan_step(num_tokens, decode, self.graphs, self.mixed_graphs)
        # On the device group: NCCL answers faster than a host round trip
        # over TCP. Under lockstep scheduling the GPU is idle here; under
        # async scheduling the read waits for the step in flight (only the
        # host work before the plan overlaps it).
        shape = torch.tensor([num_tokens, decode], device=self.device)
        shapes = group.all_gather(shape).view(-1, 2).tolist()
        counts = [n for n, _ in shapes]
        all_decode = all(d for _, d in shapes)
        plan = plan_step(max(counts), all_decode, self.graphs, self.mixed_graphs)
        if plan.size is None:
            return replace(plan, dp_metadata=DPMetadata(counts))
        return plan

    def _uniform_dp(self, num_tokens: int) -> DPMetadata | None:
        """Under expert parallelism, ``num_tokens`` on every rank: what a
        graph's forward runs with (the ranks replay one size)."""
        if self.dp_group is None:
            return None
        return DPMetadata([num_tokens] * self.dp_group.world_size)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return to_device(rows, torch.long, self.device)

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """An idle data-parallel rank's share of a step, which calls every MoE
        layer as the busy ranks' steps do: one token through the model
        outside any batch (no KV cache, no logits), per micro-batch; or, where
        the ranks replay graphs, a replay of the agreed one with padding
        only. Call inside ``on_stream()``."""
        if self.ubatch_streams:
            self._run_ubatches([self._dummy_forward] * len(self.ubatch_streams))
            return
        plan = self._plan(1, decode=True)
        if plan.size is None:
            with set_forward_context(None, plan.dp_metadata):
                self._dummy_forward()
        elif plan.decode:
            self._fill_decode_padding(0, plan.size)
            self.graphs[plan.size].graph.replay()
        else:
            self._fill_mixed_padding(0, 0, plan.size)
            self.logits_rows.zero_()  # a larger last step's rows are out of range
            self.mixed_graphs[plan.size].graph.replay()

    def _dummy_forward(self) -> None:
        token = torch.zeros(1, dtype=torch.long, device=self.device)
        self.model(token, token)

    def _execute_ubatches(
        self, chunks: list[ScheduledChunk], ends: list[int]
    ) -> torch.Tensor:
        """The step (its inputs filled) as two micro-batches of about equal
        tokens: the logits of both, in order."""
        lens = [c.end - c.start for c in chunks]
        split = balanced_split(lens)
        prefix, total = sum(lens[:split]), sum(lens)

        def forward(s0: int, s1: int, t0: int, t1: int) -> torch.Tensor | None:
            if s0 == s1:  # no request: this ubatch's share of the collectives
                self._dummy_forward()
                return None
            meta = PagedAttentionMetadata(
                query_start_loc=self.query_start_loc[s0 : s1 + 1] - t0,
                seq_lens=self.seq_lens[s0:s1],
                block_table=self.block_table[s0:s1],
                slot_mapping=self.slot_mapping[t0:t1],
                block_size=self.block_size,
                max_query_len=max(lens[s0:s1]),
            )
            rows = self._rows([e - t0 for e in ends if t0 <= e < t1])
            with set_forward_context(meta):
                hidden = self.model(self.input_ids[t0:t1], self.positions[t0:t1])
                return self.model.compute_logits(hidden[rows])

        parts = ((0, split, 0, prefix), (split, len(chunks), prefix, total))
        logits = self._run_ubatches([partial(forward, *part) for part in parts])
        return torch.cat([part for part in logits if part is not None])

    def _run_ubatches(self, fns: list[Callable[[], T]]) -> list[T]:
        """``fns[i]`` as micro-batch i on its stream, concurrently."""
        return run_ubatches_on_streams(fns, self.ubatch_streams, self.stream)

    def _fill_inputs(self, chunks: list[ScheduledChunk], pool: BlockPool) -> int:
        """Write the step into the persistent buffers; returns its tokens.
        The index math is numpy's (a few hundred values: torch's CPU
        dispatch per op would cost more than the work)."""
        n = len(chunks)
        ids: list[int] = []
        pending: list[tuple[int, int]] = []  # (token index, row of last step)
        for c in chunks:
            known = c.request.num_known_tokens
            ids += c.request.token_ids(c.start, min(c.end, known))
            if c.end > known:  # the last step's sample, still on the device
                pending.append((len(ids), self._last_rows[c.request.request_id]))
                ids.append(0)
        num_tokens = len(ids)
        starts = np.fromiter((c.start for c in chunks), np.int64, n)
        query_lens = np.fromiter((c.end - c.start for c in chunks), np.int64, n)
        tables = [pool.block_table(c.request.request_id) for c in chunks]
        table = np.zeros((n, max(map(len, tables))), np.int32)
        for row, blocks in zip(table, tables, strict=True):
            row[: len(blocks)] = blocks
        # Per token: its request, its position, its cache slot.
        query_start = np.zeros(n + 1, np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        request = np.repeat(np.arange(n), query_lens)
        positions = starts[request] + np.arange(num_tokens) - query_start[request]
        slots = table[request, positions // self.block_size].astype(np.int64)
        slots = slots * self.block_size + positions % self.block_size
        # non_blocking: no stream sync per copy; the driver stages pageable
        # host memory before the call returns, so the host arrays may go.
        for buffer, values in (
            (self.input_ids[:num_tokens], np.asarray(ids, np.int64)),
            (self.positions[:num_tokens], positions),
            (self.slot_mapping[:num_tokens], slots),
            (self.query_start_loc[: n + 1], query_start.astype(np.int32)),
            (self.seq_lens[:n], (starts + query_lens).astype(np.int32)),
            (self.block_table[:n, : table.shape[1]], table),
        ):
            buffer.copy_(torch.from_numpy(values), non_blocking=True)
        if pending:
            self._fill_pending(pending)
        return num_tokens

    def _fill_pending(self, pending: list[tuple[int, int]]) -> None:
        """Input tokens that the last step sampled, copied on the device."""
        assert self._last_tokens is not None
        if all(dst == src == i for i, (dst, src) in enumerate(pending)):
            # steady decode: the same requests, in the same order
            self.input_ids[: len(pending)].copy_(self._last_tokens[: len(pending)])
            return
        # (a blocking copy here would wait for the step in flight)
        dst, src = to_device(np.array(pending), torch.long, self.device).unbind(1)
        self.input_ids.index_copy_(0, dst, self._last_tokens[src])

    def remember_sampled(self, tokens: torch.Tensor, request_ids: list[str]) -> None:
        """The step's sampled ``tokens`` [R] (device) of ``request_ids``:
        with async scheduling the next step's inputs, before the host has
        them."""
        self._last_tokens = tokens
        self._last_rows = {r: i for i, r in enumerate(request_ids)}

    def _fill_decode_padding(self, start: int, size: int) -> None:
        """Rows ``start:size`` of a decode batch: one token each at position
        0, its key and value in the null block."""
        self.input_ids[start:size] = 0
        self.positions[start:size] = 0
        self.slot_mapping[start:size] = self.null_block * self.block_size
        self.seq_lens[start:size] = 1
        self.block_table[start:size, 0] = self.null_block
        self.query_start_loc[start + 1 : size + 1] = torch.arange(
            start + 1, size + 1, dtype=torch.int32
        )

    def _fill_mixed_padding(self, num_seqs: int, num_tokens: int, size: int) -> None:
        """A step with prefill padded to ``size`` tokens and ``max_num_seqs``
        requests: requests from ``num_seqs`` on have no tokens, and tokens
        from ``num_tokens`` on write their keys and values to the null block
        (never to a slot a request owns, as the last step's would)."""
        self.slot_mapping[num_tokens:size] = self.null_block * self.block_size
        self.query_start_loc[num_seqs + 1 :] = num_tokens

    def _metadata(
        self, num_seqs: int, num_tokens: int, max_query_len: int
    ) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_table=self.block_table[:num_seqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            block_size=self.block_size,
            max_query_len=max_query_len,
        )

    def _forward_logits(self, size: int, meta: PagedAttentionMetadata) -> torch.Tensor:
        with set_forward_context(meta, self._uniform_dp(size)):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
            return self.model.compute_logits(hidden)

    def _forward_sampling_rows(
        self, size: int, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        with set_forward_context(meta, self._uniform_dp(size)):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
            return hidden[self.logits_rows]

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
