"""The runner lifecycle: load -> warm up -> (capture) -> lock -> run -> reload."""

from pathlib import Path

import pytest
import torch

from vllm.model_executor.models.moe_decoder import (
    MoEDecoder,
    MoEDecoderConfig,
    load_checkpoint,
    save_random_checkpoint,
)
from vllm.v1.worker.model_runner import ModelRunner
from vllm.v1.worker.workspace import reset_workspace_manager

CONFIG = MoEDecoderConfig(
    vocab_size=64,
    hidden_size=128,
    num_layers=3,
    num_experts=8,
    experts_per_token=2,
    intermediate_size=64,
)
_prefixes = iter(range(10**9))


def reference_logits(model_dir: Path, input_ids: torch.Tensor, device) -> torch.Tensor:
    """A fresh model on the same checkpoint, eager, without the runner."""
    model = MoEDecoder(CONFIG, prefix=f"ref{next(_prefixes)}", device=device)
    model.load_weights(load_checkpoint(model_dir).items())
    model.process_weights_after_loading()
    with torch.inference_mode():
        return model(input_ids)


@pytest.fixture
def checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    save_random_checkpoint(CONFIG, first, seed=0)
    save_random_checkpoint(CONFIG, second, seed=1)
    return first, second


def test_lifecycle_and_reload_after_lock(checkpoints, device):
    first, second = checkpoints
    reset_workspace_manager()
    try:
        runner = ModelRunner(first, device, capture_sizes=(1, 4, 16), prefix="runner")
        runner.load_model()
        with pytest.raises(RuntimeError, match="warmup"):
            runner.execute(torch.zeros(1, dtype=torch.long, device=device))
        runner.warmup_and_capture()
        assert runner.manager.is_locked()
        report = runner.manager.memory_report()
        # Three MoE layers share one permute scratch in the only slot.
        assert len(report.resources_of_type("MoEPermuteScratch")) == 1
        total = report.total_bytes
        for tokens in (1, 3, 16):
            ids = torch.randint(0, CONFIG.vocab_size, (tokens,), device=device)
            logits = runner.execute(ids)
            expected = reference_logits(first, ids, device)
            torch.testing.assert_close(logits, expected, rtol=2e-2, atol=2e-2)
        with pytest.raises(ValueError, match="input_ids"):
            runner.execute(torch.zeros(17, dtype=torch.long, device=device))

        runner.reload_weights(second)  # locked: must need no new workspace
        # Token counts whose replay runs the eager reference's MoE path (on a
        # GPU up to 8 tokens route by route, above that sorted): across paths
        # bf16 rounding may flip a near-tied route, a whole expert's worth.
        for tokens in (3, 16):
            ids = torch.randint(0, CONFIG.vocab_size, (tokens,), device=device)
            torch.testing.assert_close(
                runner.execute(ids),
                reference_logits(second, ids, device),
                rtol=2e-2,
                atol=2e-2,
            )
        assert runner.manager.memory_report().total_bytes == total
    finally:
        reset_workspace_manager()
