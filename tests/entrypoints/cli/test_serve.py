"""``vllm serve``'s command line (in-process: nothing is served)."""

import pytest

from vllm.entrypoints.cli.main import main

FLAGS = [
    "--host", "--port", "--served-model-name", "--api-key", "--max-model-len",
    "--gpu-memory-utilization", "--dtype", "--quantization", "--load-format",
    "--max-num-seqs", "--max-num-batched-tokens", "--enforce-eager", "--seed",
    "--chat-template", "--tensor-parallel-size", "--data-parallel-size",
    "--enable-expert-parallel",
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
        (["-tp", "2"], "--tensor-parallel-size: only 1 is supported"),
        (["--data-parallel-size", "4"], "--data-parallel-size: only 1 is supported"),
        (["--enable-expert-parallel"], "--enable-expert-parallel: not supported"),
    ],
)
def test_parallelism_is_refused_before_loading(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_engine_refusal_is_a_usage_error(capsys, monkeypatch):
    def refuse(args):
        raise ValueError("max_model_len: expected <= 512, got 4096")

    monkeypatch.setattr("vllm.entrypoints.openai.api_server.run_server", refuse)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/some/model", "--max-model-len", "4096"])
    assert exit_info.value.code == 2
    assert "max_model_len: expected <= 512" in capsys.readouterr().err
