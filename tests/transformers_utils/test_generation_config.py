import json

import pytest

from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.generation_config import (
    GenerationDefaults,
    load_generation_defaults,
)

QWEN3 = {  # Qwen3-30B-A3B's file, as published
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def write(path, config) -> None:
    (path / "generation_config.json").write_text(json.dumps(config))


def test_the_sampling_fields_cap_and_eos_ids_are_read(tmp_path):
    write(tmp_path, QWEN3)
    defaults = load_generation_defaults(tmp_path)
    assert defaults.sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert defaults.eos_token_ids == (151645, 151643)
    params = defaults.default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 0.95)
    assert params.min_p == SamplingParams().min_p  # not in the file
    # Hugging Face's own defaults are no recommendation; -1 is vLLM's "all"
    write(tmp_path, {"eos_token_id": 7, "top_k": 50, "temperature": 1.0})
    assert load_generation_defaults(tmp_path) == GenerationDefaults(eos_token_ids=(7,))
    write(tmp_path, {"top_k": -1, "min_p": None, "max_new_tokens": 64})
    defaults = load_generation_defaults(tmp_path)
    assert defaults == GenerationDefaults({"top_k": 0}, 64)
    assert defaults.default_sampling_params().max_tokens == 64
    write(tmp_path, {"top_k": 20.0})
    assert load_generation_defaults(tmp_path).sampling == {"top_k": 20}


def test_vllm_keeps_only_the_eos_ids_and_a_directory_is_read(tmp_path):
    write(tmp_path, {**QWEN3, "max_new_tokens": 8})
    vllm_defaults = load_generation_defaults(tmp_path, "vllm")
    assert vllm_defaults == GenerationDefaults(eos_token_ids=(151645, 151643))
    other = tmp_path / "other"
    other.mkdir()
    write(other, {"temperature": 0.0})
    assert load_generation_defaults(tmp_path, str(other)).sampling == {
        "temperature": 0.0
    }
    assert load_generation_defaults(other / "absent") == GenerationDefaults()
    with pytest.raises(ValueError, match="generation_config: expected 'auto', 'vllm'"):
        load_generation_defaults(tmp_path, str(other / "absent"))


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"temperature": -1}, "temperature: expected a finite value >= 0"),
        ({"top_p": "high"}, "top_p: expected a number, got 'high'"),
        ({"top_k": 2.5}, "top_k: expected a whole number, got 2.5"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id: expected token ids"),
        ({"eos_token_id": -3}, "eos_token_id: expected token ids"),
        ({"eos_token_id": True}, "eos_token_id: expected token ids"),
        ({"max_new_tokens": 0}, "max_new_tokens: expected >= 1, got 0"),
    ],
)
def test_bad_values_name_the_file_and_field(tmp_path, config, match):
    write(tmp_path, config)
    with pytest.raises(ValueError, match=match) as error:
        load_generation_defaults(tmp_path)
    assert "generation_config.json" in str(error.value)


def test_the_eos_ids_stop_unless_eos_is_ignored_and_the_cap_holds():
    defaults = GenerationDefaults({}, None, (9, 4))
    given = SamplingParams(stop_token_ids=[4, 5])
    stopping = defaults.apply(given)
    assert stopping.stop_token_ids == [4, 5, 9]
    assert given.stop_token_ids == [4, 5]  # the caller's params are not changed
    ignoring = SamplingParams(ignore_eos=True, stop_token_ids=[5])
    assert defaults.apply(ignoring) is ignoring
    plain = SamplingParams()
    assert GenerationDefaults().apply(plain) is plain
    capped = GenerationDefaults(max_tokens=8).apply(
        SamplingParams(max_tokens=100, min_tokens=20)
    )
    assert (capped.max_tokens, capped.min_tokens) == (8, 8)
    short = SamplingParams(max_tokens=4)
    assert GenerationDefaults(max_tokens=8).apply(short) is short
