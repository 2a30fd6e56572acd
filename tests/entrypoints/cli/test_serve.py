"""``vllm serve``'s command line (in-process), and one live server with
data + expert parallelism (two ranks on the CPU)."""

import argparse
import time
from pathlib import Path

import pytest

from tests.entrypoints.openai.utils import (
    API_KEY,
    SERVER_DTYPE,
    RemoteOpenAIServer,
    needs_two_ranks,
)
from vllm.entrypoints.cli import serve
from vllm.entrypoints.cli.main import main
from vllm.model_executor.layers.fused_moe import prepare_finalize
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint

FLAGS = [
    "--host", "--port", "--served-model-name", "--api-key", "--max-model-len",
    "--gpu-memory-utilization", "--dtype", "--quantization", "--load-format",
    "--max-num-seqs", "--max-num-batched-tokens", "--enforce-eager", "--seed",
    "--chat-template", "--tensor-parallel-size", "--data-parallel-size",
    "--enable-expert-parallel", "--all2all-backend", "--enable-prefix-caching",
    "--generation-config", "--reasoning-parser", "--enable-prompt-tokens-details",
    "--enable-auto-tool-choice", "--tool-call-parser",
]  # fmt: skip


def test_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in FLAGS:
        assert flag in help_text
    assert help_text.count("(default:") >= len(FLAGS)
    for default in ("(default: 8000)", "(default: 0.9)", "(default: 256)"):
        assert default in help_text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-tp", "2"], "--tensor-parallel-size: 2 ranks need --enable-expert"),
        (
            ["-tp", "2", "-dp", "2", "--enable-expert-parallel"],
            "--tensor-parallel-size: 2 ranks need --enable-expert",
        ),
        (["-tp", "0"], "--tensor-parallel-size: expected >= 1"),
        (["--data-parallel-size", "4"], "--data-parallel-size: 4 ranks need --enable"),
        (["-dp", "0", "--enable-expert-parallel"], "--data-parallel-size: expected"),
        (["-dp", "2", "--enable-expert-parallel", "--all2all-backend", "x"], "invalid"),
        (["--reasoning-parser", "deepseek"], "invalid choice: 'deepseek'"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: needs --tool-call"),
        (["--tool-call-parser", "mistral"], "invalid choice: 'mistral'"),
        (["--port", "99999"], "--port: expected a port in [0, 65535], got 99999"),
    ],
)
def test_bad_flags_are_refused_before_loading(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--data-parallel-size", "2", "--enable-expert-parallel"],
            (2, True, "allgather_reducescatter", 1),
        ),
        (
            ["-dp", "4", "--enable-expert-parallel", "--all2all-backend", "all2all"],
            (4, True, "all2all", 1),
        ),
        (
            ["-tp", "2", "--enable-expert-parallel"],
            (1, True, "allgather_reducescatter", 2),
        ),
        ([], (1, False, "allgather_reducescatter", 1)),
    ],
)
def test_parallelism_flags_reach_the_server(monkeypatch, flags, expected):
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr("vllm.entrypoints.openai.api_server.run_server", seen.append)
    main(["serve", "/some/model", *flags])
    (args,) = seen
    got = (
        args.data_parallel_size,
        args.enable_expert_parallel,
        args.all2all_backend,
        args.tensor_parallel_size,
    )
    assert got == expected


def test_an_engine_refusal_is_a_usage_error(capsys, monkeypatch):
    def refuse(args):
        raise ValueError("max_model_len: expected <= 512, got 4096")

    monkeypatch.setattr("vllm.entrypoints.openai.api_server.run_server", refuse)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/some/model", "--max-model-len", "4096"])
    assert exit_info.value.code == 2
    assert "max_model_len: expected <= 512" in capsys.readouterr().err


def test_a_chat_template_that_is_no_file_nor_template_is_refused(capsys, tmp_path):
    """A mistyped path is not taken as the template's text (every prompt
    would be that path)."""
    model = tmp_path / "tiny"
    build_tiny_checkpoint(model)
    missing = str(tmp_path / "chat.jinja")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model), "--chat-template", missing])
    assert exit_info.value.code == 2
    assert f"--chat-template: expected a file or a Jinja template, got '{missing}'" in (
        capsys.readouterr().err
    )


def test_the_all2all_choices_are_the_layers():
    # Spelled out in the CLI so that --help imports no engine.
    assert serve.ALL2ALL_BACKENDS == prepare_finalize.ALL2ALL_BACKENDS


def running(pid: int) -> bool:
    """Alive and not a zombie (Linux)."""
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


@needs_two_ranks
def test_a_data_and_expert_parallel_server_serves_and_stops(tmp_path):
    build_tiny_checkpoint(tmp_path, with_tokenizer=False)
    args = ["--dtype", SERVER_DTYPE, "--max-model-len", "64", "--api-key", API_KEY]
    args += ["--data-parallel-size", "2", "--enable-expert-parallel"]
    with RemoteOpenAIServer(tmp_path, args, tmp_path / "server.log") as server:
        completion = server.client().completions.create(
            model=str(tmp_path),
            prompt=[[1, 2, 3], [4, 5, 6, 7, 8, 9]],  # one per rank
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert [c.finish_reason for c in completion.choices] == ["length"] * 2
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 8
        pid = server.proc.pid
        # Rank 1 and multiprocessing's resource tracker.
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert children
        assert server.stop() == 0  # SIGTERM: the workers stop with the server
    # The resource tracker leaves once it sees the server gone.
    deadline = time.monotonic() + 5.0
    while [c for c in children if running(int(c))]:
        assert time.monotonic() < deadline, "a child outlived the server"
        time.sleep(0.05)
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-4000:]
