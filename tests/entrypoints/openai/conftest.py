"""One tiny checkpoint and one live server shared by the directory's
modules (a start costs seconds); ``test_dummy_server.py`` runs its own,
tokenizer-less one, which its last test shuts down."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.openai.utils import (
    API_KEY,
    SERVER_DTYPE,
    RemoteOpenAIServer,
)
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint

MODEL = "tiny"
MAX_MODEL_LEN = 512
SERVER_ARGS = [
    "--dtype", SERVER_DTYPE,
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-batched-tokens", "512",
    "--served-model-name", MODEL, "tiny-alias",
    "--api-key", API_KEY,
    "--uvicorn-log-level", "warning",
    # the GPU default (on the CPU it is off): the tests see its semantics
    "--async-scheduling",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights and a trained tokenizer with Qwen's chat template."""
    path = tmp_path_factory.mktemp("tiny_qwen3_moe_server")
    build_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteOpenAIServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RemoteOpenAIServer(tiny_model, SERVER_ARGS, log) as remote:
        yield remote
