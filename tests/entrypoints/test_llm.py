"""``LLM.generate`` on the tiny checkpoint with its locally trained
tokenizer (fp32, CPU)."""

import dataclasses
import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.sampling_params import MAX_SEED
from vllm.v1.request import Request
from vllm.v1.worker.workspace import reset_workspace_manager


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return path, build_tiny_checkpoint(path)


@pytest.fixture(scope="module")
def llm(checkpoint):
    path, hf = checkpoint
    reset_workspace_manager()
    engine = LLM(path, dtype="float32", device="cpu", max_model_len=96)
    yield engine, hf
    reset_workspace_manager()


def test_text_in_text_out_matches_transformers(llm):
    engine, hf = llm
    prompts = ["def load(fp):", "import json\n"]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = engine.tokenizer(prompt)["input_ids"]
        assert out.prompt == prompt and out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        completion = out.outputs[0]
        # A first difference only at a near-tie of transformers' own logits.
        got, want = completion.token_ids, ref[0, len(ids) :].tolist()
        pairs = enumerate(zip(got, want, strict=False))  # EOS may end ours first
        same = next((i for i, (a, b) in pairs if a != b), None)
        if same is not None:
            with torch.no_grad():
                logits = hf(torch.tensor([ids + want[:same]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) < 1e-4
        else:
            assert got == want
        assert completion.text == engine.tokenizer.decode(got, skip_special_tokens=True)
        assert completion.finish_reason in ("length", "stop")


def test_vllms_prompt_dicts_generate_as_text_and_ids_do(llm):
    engine, _ = llm
    ids = engine.tokenizer("import json\n")["input_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    want = engine.generate(["def load(fp):", ids], greedy)
    got = engine.generate(
        [TextPrompt(prompt="def load(fp):"), TokensPrompt(prompt_token_ids=ids)], greedy
    )
    for a, b in zip(want, got, strict=True):
        assert (a.prompt, a.prompt_token_ids) == (b.prompt, b.prompt_token_ids)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    (one,) = engine.generate(TokensPrompt(prompt_token_ids=ids), greedy)
    assert (
        one.prompt is None and one.outputs[0].token_ids == want[1].outputs[0].token_ids
    )
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected a TextPrompt"):
        engine.generate([ids, {"text": "x"}], greedy)  # type: ignore[list-item]


def test_seeds_stops_and_logprobs(llm):
    engine, _ = llm
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=2)
    first, second = engine.generate(["x = 1", "x = 1"], params)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    logprobs = first.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == len(first.outputs[0].token_ids)
    assert all(len(step) in (2, 3) and max(step.values()) <= 0 for step in logprobs)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    (full,) = engine.generate("def f(x):", greedy)
    text = full.outputs[0].text
    assert text  # something to cut
    stop = text[len(text) // 2 :][:2]
    (cut,) = engine.generate(
        "def f(x):", SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    )
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == text[: text.index(stop)]


def test_n_sequences_come_as_one_output_and_each_reproduces(llm):
    engine, _ = llm
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, logprobs=1)
    outs = engine.generate(["x = 1", [5, 6, 7]], params)
    assert len(outs) == 2 and outs[0].request_id != outs[1].request_id
    for out, prompt in zip(outs, ["x = 1", [5, 6, 7]], strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        # sequence i is the single-sequence request seeded seed + i
        singles = engine.generate(
            [prompt] * 3,
            [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, logprobs=1)
             for i in range(3)],
        )  # fmt: skip
        for got, single in zip(out.outputs, singles, strict=True):
            want = single.outputs[0]
            assert (got.token_ids, got.text) == (want.token_ids, want.text)
            assert got.logprobs is not None
            sampled = [
                step[t] for t, step in zip(got.token_ids, got.logprobs, strict=True)
            ]
            assert got.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-5)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (greedy,) = engine.generate(
        "x = 1", SamplingParams(n=2, temperature=0, max_tokens=5)
    )
    first, second = greedy.outputs
    assert first.token_ids == second.token_ids and first.cumulative_logprob is None
    assert params.n == 3 and params.seed == 11  # the caller's params stay as given


def test_n_is_checked_and_the_engine_takes_one_sequence_per_request(llm):
    engine, _ = llm
    request = Request("n3", [1, 2], SamplingParams(n=3))
    with pytest.raises(ValueError, match="n: the engine runs one sequence"):
        engine.engine.add_request(request)
    # the last sequence's seed (seed + n - 1) must be in range
    with pytest.raises(ValueError, match=r"seed: expected None or in \[0, \d+ - \(n"):
        SamplingParams(n=2, seed=MAX_SEED)
    last = SamplingParams(n=2, seed=MAX_SEED - 1).fan_out()[-1]
    assert last.seed == MAX_SEED


def test_stop_reason_names_the_stop_string_or_token(llm):
    engine, _ = llm
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (full,) = engine.generate("def f(x):", greedy)
    tokens, text = full.outputs[0].token_ids, full.outputs[0].text
    assert full.outputs[0].finish_reason == "length"
    assert full.outputs[0].stop_reason is None
    end = next(i for i in range(1, 16) if tokens[i] not in tokens[:i])
    by_token = SamplingParams(
        temperature=0, max_tokens=16, stop_token_ids=[tokens[end]]
    )
    (stopped,) = engine.generate("def f(x):", by_token)
    out = stopped.outputs[0]
    assert out.token_ids == tokens[: end + 1] and out.finish_reason == "stop"
    assert out.stop_reason == tokens[end]

    def text_of(n: int) -> str:  # the text of the first n greedy tokens
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return engine.generate("def f(x):", params)[0].outputs[0].text

    # the stop token's text is left out unless asked for (vLLM's)
    assert out.text == text_of(end) != text_of(end + 1)
    kept = dataclasses.replace(by_token, include_stop_str_in_output=True)
    assert engine.generate("def f(x):", kept)[0].outputs[0].text == text_of(end + 1)
    assert text
    stop = text[len(text) // 2 :][:2]
    by_text = SamplingParams(temperature=0, max_tokens=16, stop=["\x00", stop])
    (cut,) = engine.generate("def f(x):", by_text)
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].stop_reason == stop


def test_chat_renders_the_template_and_generates(llm):
    engine, _ = llm
    tokenizer = engine.get_tokenizer()  # vLLM's accessor
    assert tokenizer is engine.tokenizer and tokenizer.chat_template
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    (out,) = engine.chat(conversation, greedy)
    rendered = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    text = tokenizer.apply_chat_template(
        rendered, add_generation_prompt=True, tokenize=False
    )
    assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == ids
    (plain,) = engine.generate([ids], greedy)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    # several conversations, the template's own variables, continuing a reply
    thinking, continued = engine.chat(
        [conversation, [*rendered, {"role": "assistant", "content": "Sure"}]],
        greedy,
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert thinking.prompt.endswith("Be brief.<|im_end|>\n<|im_start|>user\nhi")
    assert continued.prompt.endswith("<|im_start|>assistant\nSure")
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (templated,) = engine.chat(rendered, greedy, chat_template=own)
    assert templated.prompt == "[system] Be brief.\n[user] hi\n"


def test_chat_errors_name_the_field(llm):
    engine, _ = llm
    hi = [{"role": "user", "content": "hi"}]
    cases: list[tuple[list, dict[str, Any], str]] = [
        (
            [{"role": "robot", "content": "hi"}],
            {},
            r"^conversations\[0\]: messages\[0\]\.role: Input",
        ),
        ([hi, [{"content": "x"}]], {}, r"^conversations\[1\]: messages\[0\]\.role"),
        ([hi, hi * 20], {}, r"^conversations\[1\]: prompt: \d+ tokens"),
        ([[]], {}, r"^conversations\[0\]: messages: expected a non-empty list"),
        (hi, {"continue_final_message": True}, r"^conversations\[0\]: continue_final"),
        (
            hi,
            {"chat_template_kwargs": {"tokenize": True}},
            r"conversations\[0\]: chat_",
        ),
        (hi, {"tools": [{"function": {}}]}, r"^tools\.0\.function\.name: Field"),
    ]
    for messages, options, error in cases:
        with pytest.raises(ValueError, match=error):
            engine.chat(messages, SamplingParams(max_tokens=2), **options)
    assert not engine.engine.has_unfinished_requests()


def test_prompt_logprobs_come_with_the_output(llm):
    """Per prompt token (None for the first); the values themselves are
    checked against transformers in tests/v1/sample."""
    engine, _ = llm
    asked, plain = engine.generate(
        ["def f(x):", "def f(x):"],
        [SamplingParams(max_tokens=3, prompt_logprobs=2), SamplingParams(max_tokens=3)],
    )
    entries = asked.prompt_logprobs
    assert entries is not None and len(entries) == len(asked.prompt_token_ids) > 1
    assert entries[0] is None and plain.prompt_logprobs is None
    for token, entry in zip(asked.prompt_token_ids[1:], entries[1:], strict=True):
        assert entry is not None and token in entry and len(entry) in (2, 3)
        assert max(entry.values()) <= 0


def test_outputs_count_the_prompt_tokens_found_in_the_cache(llm):
    engine, _ = llm
    prompt = "def load(fp, *, cls=None, object_hook=None, parse_float=None): " * 2
    params = SamplingParams(max_tokens=1)
    (first,) = engine.generate(prompt, params)
    (again,) = engine.generate(prompt, params)
    assert len(first.prompt_token_ids) >= 32 and first.num_cached_tokens == 0
    assert again.num_cached_tokens is not None
    assert len(first.prompt_token_ids) - 16 <= again.num_cached_tokens
    assert again.num_cached_tokens < len(first.prompt_token_ids)


def test_bad_prompts_name_their_index(llm):
    engine, _ = llm
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: 100 tokens"):
        engine.generate([[1, 2], [3] * 100], SamplingParams(max_tokens=4))
    with pytest.raises(
        ValueError, match=r"prompts\[0\]: prompt: expected at least one"
    ):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params: expected one per prompt"):
        engine.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match=r"one per prompt \(1\), got 0"):
        engine.generate("a", [])  # not the defaults
    # The engine still serves.
    (ok,) = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert len(ok.outputs[0].token_ids) == 3 and ok.outputs[0].text is not None


def test_a_second_engine_in_the_process_warms_up_and_both_serve(llm, tmp_path):
    first, _ = llm
    # Other routing dims: a new shared scratch in the (locked) manager.
    build_tiny_checkpoint(tmp_path, seed=5, with_tokenizer=False, num_experts=8)
    second = LLM(tmp_path, dtype="float32", device="cpu", max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match=r"prompts\[0\]: sampling_params.stop"):
        second.generate([[1, 2]], SamplingParams(stop="x"))  # no tokenizer
    with pytest.raises(ValueError, match=r"prompts\[1\]: a text prompt needs"):
        second.generate([[1, 2], "text"], params)
    assert not second.engine.has_unfinished_requests()  # prompts[0] withdrawn
    assert len(second.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 3
    assert len(first.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 3


def test_async_scheduling_generates_the_same(llm, checkpoint):
    """Seeded sampling, log-probabilities and stop strings (seen on the
    text one step late) come out as the synchronous engine's."""
    first, _ = llm
    overlapped = LLM(
        checkpoint[0], dtype="float32", device="cpu", max_model_len=96,
        async_scheduling=True,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=20)
    (full,) = first.generate("def f(x):", greedy)
    text = full.outputs[0].text
    stop = text[len(text) // 2 :][:2]
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
        greedy,
    ]
    prompts = ["x = 1", "def f(x):", "import os"]
    for want, got in zip(
        first.generate(prompts, params),
        overlapped.generate(prompts, params),
        strict=True,
    ):
        a, b = want.outputs[0], got.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
        )
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert list(x) == list(y)  # fp32 sums of other batch shapes
            assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)
    assert not overlapped.engine.has_unfinished_requests()


def test_the_generation_config_sets_defaults_and_ends_at_its_eos(
    llm, checkpoint, tmp_path
):
    first, _ = llm
    assert first.get_default_sampling_params() == SamplingParams()  # no such fields
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (full,) = first.generate([[1, 2, 3]], greedy)
    tokens = full.outputs[0].token_ids
    end = next(i for i in range(2, 12) if tokens[i] not in tokens[:i])
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0, "eos_token_id": [tokens[end]]})
    )
    configured = LLM(
        checkpoint[0], generation_config=str(tmp_path), dtype="float32",
        device="cpu", max_model_len=96,
    )  # fmt: skip
    assert configured.get_default_sampling_params().temperature == 0
    (stopped,) = configured.generate([[1, 2, 3]])  # greedy, by the file
    assert stopped.outputs[0].token_ids == tokens[: end + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    (ignored,) = configured.generate([[1, 2, 3]], greedy)
    assert ignored.outputs[0].token_ids == tokens
    assert greedy.stop_token_ids == []  # the caller's params stay as given


def test_generation_imports_without_the_servers_packages():
    """The GPU image has no pydantic (the server's, and chat's): LLM and
    its engine must import without it."""
    code = (
        "import sys; sys.modules['pydantic'] = None; "
        "from vllm import LLM, SamplingParams; import vllm.v1.engine.core"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
