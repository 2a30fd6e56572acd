"""Grammars on the tiny checkpoint's locally trained tokenizer: the masks
against a brute-force oracle, the errors, and whole generations (random
weights: only the grammar makes the outputs valid)."""

import concurrent.futures
import json
import re
import sys
import threading
from dataclasses import replace

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.tiny_checkpoint import (
    build_tiny_checkpoint,
    train_tokenizer,
)
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1 import structured_output
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.workspace import reset_workspace_manager

# a dependency; the GPU image may lack it (its tests are the CPU's)
pytest.importorskip("xgrammar")

VOCAB = 320
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, VOCAB + 7)  # logits padded


def allowed(masks, i: int, vocab: int) -> set[int]:
    words = masks.bitmask[i].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def test_masks_allow_exactly_the_tokens_that_continue_a_choice(tokenizer, manager):
    choices = ["import json", 'say "hi"\\', "imp"]
    matcher = manager.matcher(StructuredOutputsParams(choice=choices))
    text = ""
    for step in range(4):
        masks = manager.token_masks([None, matcher], torch.device("cpu"))
        assert masks is not None and masks.rows == [1]
        want = {
            t
            for t in range(VOCAB)
            if (piece := tokenizer.decode([t]))
            and any(c.startswith(text + piece) for c in choices)
        }
        got = allowed(masks, 0, VOCAB + 7)
        if step and text in choices:
            want.add(tokenizer.eos_token_id)  # a choice may end here
        assert got == want, step
        token = min(want - {tokenizer.eos_token_id})  # walk some path
        assert matcher.accept_token(token)
        text += tokenizer.decode([token])
    assert manager.token_masks([None, None], torch.device("cpu")) is None


def test_a_choice_past_the_bmp_matches_its_utf8_bytes(tokenizer, manager):
    choice = "ok 😀 é"
    matcher = manager.matcher(StructuredOutputsParams(choice=[choice, "no"]))
    for token in tokenizer(choice)["input_ids"]:
        assert matcher.accept_token(token), token
    assert matcher.accept_token(tokenizer.eos_token_id)  # and it ends there


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"regex": "[0-9"}, r"^structured_outputs\.regex: Regex parsing error at"),
        ({"json": "{not json"}, r"^structured_outputs\.json: "),
        ({"json": {"type": "nonsense"}}, r"^structured_outputs\.json: Unsupported"),
        ({"grammar": "root ::= "}, r"^structured_outputs\.grammar: EBNF parser"),
    ],
)
def test_bad_grammars_are_named(manager, spec, error):
    params = StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=error):
        manager.validate(params)  # the check, parsing only
    with pytest.raises(ValueError, match=error):
        manager.submit(params).result()  # the compile on the worker thread


def test_params_hold_exactly_one_grammar():
    for spec in ({}, {"regex": "a", "choice": ["a"]}, {"json_object": False}):
        with pytest.raises(ValueError, match="structured_outputs: expected exactly"):
            StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=r"structured_outputs\.choice: expected"):
        StructuredOutputsParams(choice=["a", ""])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_structured")
    build_tiny_checkpoint(path)
    return path


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generations_match_their_grammars(checkpoint, tokenizer, async_scheduling):
    reset_workspace_manager()
    llm = LLM(
        checkpoint, dtype="float32", device="cpu", max_model_len=96,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    choices = ["yes", "no", 'maybe "so"']
    specs = [
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    ]
    prompts = ["x = 1", "def f(x):", [5, 6, 7]]
    params = [
        SamplingParams(
            n=3, temperature=1.0, seed=i, max_tokens=60, structured_outputs=s
        )
        for i, s in enumerate(specs)
    ]
    # any object: a random model's keys and strings need not end, a bias on
    # "}" closes it (at the first place the grammar allows)
    params[3] = replace(
        params[3], logit_bias={tokenizer.convert_tokens_to_ids("}"): 30.0}
    )
    # every grammar and a free request in one batch
    outs = llm.generate(
        [p for p in prompts for _ in specs] + ["x"],
        [*params * 3, SamplingParams(max_tokens=4)],
    )
    for out in outs[:-1]:
        for seq in out.outputs:
            assert seq.finish_reason == "stop", seq  # each grammar completed
    texts = [[s.text for s in out.outputs] for out in outs[:-1]]
    for i, spec in enumerate(specs):
        for text in (t for p in range(3) for t in texts[p * 4 + i]):
            if spec.choice:
                assert text in choices
            elif spec.regex:
                assert re.fullmatch(spec.regex, text)
            elif spec.json:
                value = json.loads(text)
                assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
                assert value["n"] in (1, 22, 333)
            else:
                assert isinstance(json.loads(text), dict)
    assert len(outs[-1].outputs[0].token_ids) == 4  # the free one unaffected
    with pytest.raises(ValueError, match=r"prompts\[1\]: structured_outputs\.regex"):
        llm.generate(
            ["a", "b"],
            [
                SamplingParams(),
                SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")),
            ],
        )
    assert not llm.engine.has_unfinished_requests()
    reset_workspace_manager()


def test_async_scheduling_and_preemption_change_no_token(checkpoint):
    """Grammar and free requests together, seeded: the same tokens with the
    step in flight resolved early, and recomputed after preemptions (8 KV
    blocks for ~500 tokens)."""
    regex = StructuredOutputsParams(regex=r"[a-z]{3,12}-[0-9]{2,9}")
    schema = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=40,
            logprobs=1,
            structured_outputs=(None, regex, schema)[i % 3],
        )
        for i in range(8)
    ]
    prompts = [[5 + i] * (10 + 3 * i) for i in range(8)]
    runs = []
    for engine_args in (
        {},
        {"async_scheduling": True},
        {"async_scheduling": True, "num_kv_blocks": 8},
    ):
        reset_workspace_manager()
        llm = LLM(
            checkpoint, dtype="float32", device="cpu", max_model_len=96,
            **engine_args,
        )  # fmt: skip
        outs = llm.generate(prompts, params)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].text) for o in outs])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    for _, text in runs[0][1::3]:
        assert re.fullmatch(regex.regex or "", text)
    reset_workspace_manager()


def test_without_xgrammar_such_a_request_is_refused_by_name(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails
    with pytest.raises(ValueError, match="structured_outputs: needs the xgrammar"):
        StructuredOutputManager(tokenizer, VOCAB)


def test_the_grammar_wins_over_min_tokens_and_ignore_eos(checkpoint):
    """Where only the stop token fits, min_tokens' ban is lifted (never a
    token outside the grammar); a complete grammar ends the request under
    ignore_eos too."""
    reset_workspace_manager()
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_model_len=96)
    yes = StructuredOutputsParams(choice=["yes"])
    for extra in ({"min_tokens": 8}, {"ignore_eos": True}):
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                temperature=temperature, max_tokens=20, structured_outputs=yes,
                **extra,
            )  # fmt: skip
            (out,) = llm.generate("x = 1", params)
            assert out.outputs[0].text == "yes", (extra, temperature)
            assert out.outputs[0].finish_reason == "stop"
    reset_workspace_manager()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_compiling_grammar_holds_back_only_its_own_sample(
    checkpoint, monkeypatch, async_scheduling
):
    """While a grammar compiles (held here until released) its request
    computes its prompt but the last token and samples nothing; a request
    behind it in the queue runs to its end, and the engine never waits on
    compiles with a step in flight; an aborted request's queued compile is
    cancelled; then the held request finishes as it would have without the
    wait. A compile that fails aborts only its request."""
    reset_workspace_manager()
    llm = LLM(
        checkpoint, dtype="float32", device="cpu", max_model_len=96,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    engine = llm.engine
    regex = StructuredOutputsParams(regex=r"[a-z]{3,12}-[0-9]{2,9}")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30)
    prompts = {"short": [7], "long": [5, 6, 7] * 9}
    (unheld,) = llm.generate(
        [prompts["long"]], replace(params, structured_outputs=regex)
    )

    release = threading.Event()
    compile_grammar = StructuredOutputManager.matcher

    def held(manager, grammar):
        assert release.wait(60)
        return compile_grammar(manager, grammar)

    monkeypatch.setattr(StructuredOutputManager, "matcher", held)
    grammar_requests = {
        name: Request(name, ids, replace(params, structured_outputs=regex))
        for name, ids in prompts.items()
    }
    aborted = Request("aborted", [5], replace(params, structured_outputs=regex))
    free = Request("free", [9, 10], SamplingParams(max_tokens=5))
    for request in (*grammar_requests.values(), aborted, free):
        engine.add_request(request)
    queued = aborted.compiling
    assert queued is not None
    engine.finish_request("aborted")
    waits = []

    def wait(futures, timeout, return_when):
        assert engine._in_flight is None  # nothing runs on the device
        waits.append(timeout)
        return concurrent.futures.wait(futures, timeout, return_when)

    monkeypatch.setattr(structured_output, "wait", wait)
    while engine.has_unfinished_requests() and free.finish_reason is None:
        engine.step()
    assert queued.cancelled() and not waits  # the free request had steps to run
    assert free.finish_reason == "length" and len(free.output_token_ids) == 5
    for request in grammar_requests.values():
        assert not request.output_token_ids and request.num_pending_tokens == 0
        assert request.num_computed_tokens == len(request.prompt_token_ids) - 1
    release.set()
    while engine.has_unfinished_requests():
        engine.step()
    long = grammar_requests["long"]
    assert long.output_token_ids == unheld.outputs[0].token_ids
    text = llm.tokenizer.decode(long.output_token_ids, skip_special_tokens=True)
    assert re.fullmatch(regex.regex or "", text)
    assert grammar_requests["short"].finish_reason == "stop"

    def failing(manager, grammar):
        raise ValueError("structured_outputs.regex: out of memory")

    monkeypatch.setattr(StructuredOutputManager, "matcher", failing)
    failed = Request("failed", [5], replace(params, structured_outputs=regex))
    engine.add_request(failed)
    engine.add_request(free := Request("free", [9, 10], SamplingParams(max_tokens=5)))
    while engine.has_unfinished_requests():
        engine.step()
    assert failed.finish_reason == "abort" and not failed.output_token_ids
    assert free.finish_reason == "length"
    reset_workspace_manager()
