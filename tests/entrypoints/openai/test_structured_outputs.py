"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` through
the official client (random weights: only the grammar makes the outputs
valid), with async scheduling on (the server's conftest)."""

import json
import re

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL
from tests.entrypoints.openai.utils import RemoteOpenAIServer

# a dependency; the GPU image may lack it (its tests are the CPU's)
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def client(server: RemoteOpenAIServer) -> openai.OpenAI:
    return server.client()


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
    assert value["n"] in (1, 22, 333)


def test_response_format_json_schema_in_chat(client):
    compact = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=80, n=3, seed=1)
    out = client.chat.completions.create(**kwargs, extra_body=compact)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        check_schema(choice.message.content)
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    # OpenAI's field: whitespace allowed, so a random model may not finish
    out = client.chat.completions.create(
        **kwargs, response_format=schema_format, temperature=0
    )
    for choice in out.choices:
        text = choice.message.content
        if choice.finish_reason == "stop":
            check_schema(text)
        else:
            assert text.lstrip().startswith("{")
    chunks = client.chat.completions.create(**kwargs, extra_body=compact, stream=True)
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        check_schema(text)


def test_structured_outputs_in_completions(client):
    kwargs = dict(model=MODEL, prompt="x = ", max_tokens=20, n=4, seed=3)
    for spec, check in (
        ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"regex": "[0-9]{2}\\.[0-9]"}, lambda t: re.fullmatch(r"\d\d\.\d", t)),
        ({"grammar": 'root ::= "a" ("b" | "c")'}, lambda t: t in ("ab", "ac")),
    ):
        out = client.completions.create(
            **kwargs, extra_body={"structured_outputs": spec}
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop" and check(choice.text), (spec, choice)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "Regex"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "pattern"),
        (
            {"structured_outputs": {"choice": "ab"}},
            "structured_outputs.choice",
            "a list",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "nope"}},
                }
            },
            "response_format",
            "Unsupported",
        ),
        (
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"regex": "a"},
            },
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_bad_formats_are_400s_naming_the_field(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=body
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and message in error["message"], error
    # the server goes on serving
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
