"""``/v1/models`` and ``/v1/completions`` through the official client."""

import asyncio

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL
from tests.entrypoints.openai.utils import SERVER_DTYPE, RemoteOpenAIServer
from vllm.model_executor.model_loader.tiny_checkpoint import TINY_CONFIG

PROMPT = "def load(fp, *, cls=None):"


@pytest.fixture(scope="module")
def client(server: RemoteOpenAIServer) -> openai.OpenAI:
    return server.client()


def prompt_len(server: RemoteOpenAIServer, prompt: str) -> int:
    body = httpx.post(server.url_for("tokenize"), json={"prompt": prompt}).json()
    return int(body["count"])


def test_models_list(client, tiny_model):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "tiny-alias"]
    assert models[0].owned_by == "vllm"
    assert models[0].model_extra == {
        "root": str(tiny_model),
        "max_model_len": MAX_MODEL_LEN,
    }


def test_greedy_completion_and_usage(client, server):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason in ("length", "stop")
    usage = out.usage
    assert usage is not None
    assert usage.prompt_tokens == prompt_len(server, PROMPT)
    assert 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The served alias answers the same (greedy, the same batch of one).
    again = client.completions.create(
        model="tiny-alias", prompt=PROMPT, max_tokens=6, temperature=0
    )
    assert again.choices[0].text == choice.text and again.model == "tiny-alias"


@pytest.mark.parametrize("logprobs", [None, 2])
def test_streamed_text_is_the_non_streamed_text(client, server, logprobs):
    kwargs = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logprobs=logprobs,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    if logprobs is not None:
        streamed = [
            t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens
        ]
        assert streamed == whole.choices[0].logprobs.tokens


def test_n_choices_with_a_seed_differ_and_reproduce(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, seed=7)
    first = client.completions.create(**kwargs, temperature=1.0)
    second = client.completions.create(**kwargs, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    assert 3 <= first.usage.completion_tokens <= 3 * 8


def test_several_prompts_text_and_token_ids(client, server):
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPT}).json()
    out = client.completions.create(
        model=MODEL,
        prompt=[PROMPT, "import json\n"],
        max_tokens=4,
        temperature=0,
        n=2,
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: n copies
    # Alone in their batches, text and its token ids generate alike.
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **kwargs)
    by_ids = client.completions.create(prompt=ids["tokens"], **kwargs)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert out.usage.prompt_tokens == ids["count"] + prompt_len(server, "import json\n")


def test_stop_strings_cut_the_text(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:2]
    assert stop
    cut = client.completions.create(**kwargs, stop=[stop, "never seen"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert full.choices[0].model_extra["stop_reason"] is None  # length
    assert cut.choices[0].model_extra["stop_reason"] == stop  # vLLM's field
    chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_a_stop_token_is_the_stop_reason(client, server):
    """Every token but EOS stops: the first one sampled is the reason."""
    eos = httpx.post(
        server.url_for("tokenize"),
        json={"prompt": "<|im_end|>", "add_special_tokens": False},
    ).json()["tokens"]
    stops = [t for t in range(TINY_CONFIG["vocab_size"]) if t not in eos]
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=stream,
            extra_body={"stop_token_ids": stops},
        )  # fmt: skip
        last = list(out)[-1] if stream else out
        choice = last.choices[0]
        assert choice.finish_reason == "stop", stream
        assert choice.model_extra["stop_reason"] in stops


def test_penalties_reach_the_sampler(client):
    """OpenAI's presence and frequency penalties and vLLM's repetition
    penalty (an extra field) change a greedy completion that repeats
    tokens: none of the three is ignored."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    tokens = plain.choices[0].text
    assert len(set(tokens)) < len(tokens)  # it repeats, so penalties bite
    for openai_field, vllm_field in (
        ({"presence_penalty": 2.0}, {}),
        ({"frequency_penalty": 2.0}, {}),
        ({}, {"repetition_penalty": 5.0}),
    ):
        out = client.completions.create(
            **kwargs, **openai_field, extra_body={"ignore_eos": True, **vllm_field}
        )
        assert out.choices[0].text != tokens, (openai_field, vllm_field)


def test_logit_bias_forces_a_token(client, server):
    """OpenAI's ``logit_bias``: +100 on one token makes every greedy token
    that one."""
    tokens = httpx.post(server.url_for("tokenize"), json={"prompt": "a"}).json()
    (token,) = tokens["tokens"]
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == "a" * 5


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None
    n = out.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == n
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == n
    for token, lp, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # The top 3 and the sampled one (tokens whose text is alike, such
        # as partial characters, share a key).
        assert lp <= 0 and 1 <= len(top) <= 4 and token in top
        assert lp >= max(top.values()) - 1e-6  # greedy takes the best
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_async_client(server):
    async def run() -> list[int]:
        client = server.async_client()
        outs = await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL,
                    prompt=f"x = {i}",
                    max_tokens=2 + i,
                    extra_body={"ignore_eos": True},
                )
                for i in range(4)
            )
        )
        await client.close()
        return [o.usage.completion_tokens for o in outs]

    assert asyncio.run(run()) == [2, 3, 4, 5]


def test_echo_puts_the_prompt_and_its_logprobs_first(client, server):
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=2)
    plain = client.completions.create(prompt=PROMPT, **kwargs).choices[0]
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kwargs).choices[0]
    assert echoed.text == PROMPT + plain.text
    num_prompt = prompt_len(server, PROMPT)
    lp, plain_lp = echoed.logprobs, plain.logprobs
    assert len(lp.tokens) == num_prompt + len(plain_lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[num_prompt:] == plain_lp.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain_lp.token_logprobs)
    assert lp.text_offset[num_prompt] == len("".join(lp.tokens[:num_prompt]))
    # A prompt token's entry is the next-token distribution after the ones
    # before it: what a completion of those tokens reports for its first.
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPT}).json()
    head = client.completions.create(prompt=ids["tokens"][:-1], **kwargs)
    first = head.choices[0].logprobs.top_logprobs[0]
    last = lp.top_logprobs[num_prompt - 1]
    assert last is not None and lp.tokens[num_prompt - 1] in last
    tol = 1e-3 if SERVER_DTYPE == "float32" else 0.1  # other batch shapes
    for token in set(first) & set(last):
        assert first[token] == pytest.approx(last[token], abs=tol)
    assert len(set(first) & set(last)) >= 2  # the top-2 agree


def test_streamed_echo_starts_every_choice_with_the_prompt(client):
    prompts = [PROMPT, "x = '🙂中文' # ünï"]  # characters split over tokens
    kwargs = dict(model=MODEL, prompt=prompts, max_tokens=5, n=2)
    kwargs |= dict(temperature=0, echo=True, logprobs=1)
    whole = sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)
    texts = [""] * 4
    logprobs: list[dict[str, list]] = [
        {"tokens": [], "token_logprobs": [], "text_offset": []} for _ in range(4)
    ]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if not texts[choice.index]:
                assert choice.text.startswith(prompts[choice.index // 2])
            texts[choice.index] += choice.text
            for field, values in logprobs[choice.index].items():
                values += getattr(choice.logprobs, field)
    assert texts == [c.text for c in whole]
    for choice, got in zip(whole, logprobs, strict=True):
        offsets = choice.logprobs.text_offset
        assert offsets == sorted(offsets)  # never back past the prompt
        assert got["text_offset"] == offsets
        assert got["tokens"] == choice.logprobs.tokens
        assert got["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, server):
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, logprobs=1, echo=True)
    full = client.completions.create(max_tokens=3, **kwargs).choices[0].logprobs
    out = client.completions.create(max_tokens=0, **kwargs)
    (choice,) = out.choices
    num_prompt = prompt_len(server, PROMPT)
    assert choice.text == PROMPT and out.usage.completion_tokens == 0
    assert choice.finish_reason == "length"
    assert choice.logprobs.tokens == full.tokens[:num_prompt]
    assert choice.logprobs.token_logprobs == pytest.approx(
        full.token_logprobs[:num_prompt]
    )
    text, tokens = "", list[str]()
    for chunk in client.completions.create(max_tokens=0, stream=True, **kwargs):
        for streamed in chunk.choices:
            text += streamed.text
            tokens += streamed.logprobs.tokens if streamed.logprobs else []
    assert (text, tokens) == (PROMPT, choice.logprobs.tokens)
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="and no min_tokens"):
        client.completions.create(max_tokens=0, extra_body={"min_tokens": 1}, **kwargs)
