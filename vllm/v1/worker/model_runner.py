"""A runner for the MoE decoder that follows the workspace lifecycle.

init workspace manager -> load weights -> warm up at every size that will
run (largest first) -> capture CUDA graphs on the warm-up stream -> lock.
After that nothing may ask for new workspace: execution replays the graphs
(or runs eagerly on CPU), and a weight reload copies new weights into the
live storage, so the captured graphs keep working and read them.

Lock buffers of the Marlin and Humming experts are per stream: after lock,
an eager run of those backends works only on the warm-up stream; graph
replays work from any stream.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm.logger import init_logger
from vllm.model_executor.models.moe_decoder import (
    MoEDecoder,
    MoEDecoderConfig,
    load_checkpoint,
)
from vllm.v1.worker.workspace import (
    WorkspaceManager,
    current_workspace_manager,
    init_workspace_manager,
    is_workspace_manager_initialized,
)

logger = init_logger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    logits: torch.Tensor


@dataclass
class ModelRunner:
    """Loads, warms up, captures and runs one MoE decoder on one device."""

    model_dir: Path
    device: torch.device
    capture_sizes: tuple[int, ...] = (1, 8, 32)
    backend: str = "auto"
    prefix: str = "model"  # layer names; unique per runner in a process
    model: MoEDecoder | None = None
    graphs: dict[int, _Graph] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if not self.capture_sizes or min(self.capture_sizes) < 1:
            raise ValueError(
                f"capture_sizes: expected token counts >= 1, got {self.capture_sizes}"
            )
        self.capture_sizes = tuple(sorted(set(self.capture_sizes), reverse=True))
        # Warm-up and capture share one stream: stream-scoped resources
        # (lock buffers) created during warm-up are the ones graphs use.
        self.stream = (
            torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        )

    warmed: bool = False

    @property
    def manager(self) -> WorkspaceManager:
        return current_workspace_manager()

    def load_model(self) -> None:
        config = MoEDecoderConfig.from_json(self.model_dir / "config.json")
        if not is_workspace_manager_initialized():
            init_workspace_manager(self.device)
        self.model = MoEDecoder(
            config, prefix=self.prefix, backend=self.backend, device=self.device
        )
        self.model.load_weights(load_checkpoint(self.model_dir).items())
        self.model.process_weights_after_loading()

    def _model(self) -> MoEDecoder:
        if self.model is None:
            raise RuntimeError("call load_model() first")
        return self.model

    @torch.inference_mode()
    def warmup_and_capture(self) -> None:
        """Run every capture size (largest first), capture graphs, lock."""
        model = self._model()
        vocab = model.config.vocab_size
        if self.stream is not None:  # weights were prepared on the current stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in self.capture_sizes:
            with self._on_stream():  # inputs made and used on one stream
                model(torch.randint(0, vocab, (size,), device=self.device))
        if self.stream is not None:
            pool = None  # one memory pool for all sizes, largest captured first
            for size in self.capture_sizes:
                with self._on_stream():
                    ids = torch.zeros(size, dtype=torch.long, device=self.device)
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                    logits = model(ids)
                pool = graph.pool()
                self.graphs[size] = _Graph(graph, ids, logits)
        self.manager.lock()
        self.warmed = True
        logger.info(
            "warmed up at %s tokens, %d graphs, workspace locked (%d bytes)",
            list(self.capture_sizes),
            len(self.graphs),
            self.manager.memory_report().total_bytes,
        )

    def _on_stream(self) -> AbstractContextManager[object]:
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        )

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab]: on CUDA, the smallest captured graph that fits
        (padded); on CPU, an eager run in the warmed-up workspace."""
        model = self._model()
        tokens = input_ids.shape[0]
        if not self.warmed:
            raise RuntimeError("call warmup_and_capture() first")
        if not 1 <= tokens <= self.capture_sizes[0]:
            raise ValueError(
                f"input_ids: expected 1..{self.capture_sizes[0]} tokens (the largest "
                f"warmed size), got {tokens}"
            )
        if not self.graphs:
            return model(input_ids)
        entry = self.graphs[min(s for s in self.graphs if s >= tokens)]
        entry.input_ids.zero_()  # padding rows route like any token; sliced off
        entry.input_ids[:tokens].copy_(input_ids)
        entry.graph.replay()
        return entry.logits[:tokens].clone()

    def reload_weights(self, model_dir: Path | None = None) -> None:
        """Load a checkpoint into the live model; needs no new workspace."""
        model = self._model()
        model.load_weights(load_checkpoint(model_dir or self.model_dir).items())
        model.process_weights_after_loading()
