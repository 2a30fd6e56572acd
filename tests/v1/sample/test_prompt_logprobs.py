"""``prompt_logprobs`` on the engine (fp32, CPU) against ``transformers``'
log-softmax of the same checkpoint's logits: every prompt token's
log-probability and top-k, whatever splits the prompt (a batch, chunked
prefill, preemption, asynchronous steps, a cached prefix that such a
request must not take), and the generated tokens unchanged."""

import itertools

import pytest
import torch

from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request
from vllm.v1.worker.workspace import reset_workspace_manager

_prefixes = (f"prompt_logprobs_test_{i}." for i in itertools.count())
_gen = torch.Generator().manual_seed(1)
PROMPTS = [
    torch.randint(0, 320, (int(n),), generator=_gen).tolist()
    for n in torch.randint(1, 41, (12,), generator=_gen)
]
PROMPTS[0] = PROMPTS[1][:]  # the same prompt twice: a cached prefix to refuse
PROMPTS[3] = PROMPTS[3][:1]  # nothing to predict
# 17 tokens: at a 16-token budget its second chunk is its last prompt token
PROMPTS[7] = torch.randint(0, 320, (17,), generator=_gen).tolist()
NUM_TOP = [3, 0, None, 5] * 3  # None: not asked


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_prompt_logprobs")
    return path, build_tiny_checkpoint(path, with_tokenizer=False)


def run(path, **kwargs) -> list[Request]:
    reset_workspace_manager()
    try:
        args = {"max_model_len": 64, "max_num_seqs": 16} | kwargs
        config = EngineConfig(
            path, dtype="float32", device="cpu", prefix=next(_prefixes), **args
        )
        engine = EngineCore(config)
        requests = [
            Request(
                f"r{i}",
                prompt,
                SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=k),
            )
            for i, (prompt, k) in enumerate(zip(PROMPTS, NUM_TOP, strict=True))
        ]
        engine.add_request(requests[1])  # alone first: its blocks get cached
        while engine.has_unfinished_requests():
            engine.step()
        for request in requests[:1] + requests[2:]:
            engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
        return requests
    finally:
        reset_workspace_manager()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 64},
        {"max_num_batched_tokens": 8},  # chunked prefill
        {"max_num_batched_tokens": 32, "num_kv_blocks": 5},  # preemption
        {"max_num_batched_tokens": 16, "async_scheduling": True},
    ],
    ids=["batched", "chunked", "preempted", "async"],
)
def test_prompt_logprobs_match_transformers(checkpoint, kwargs):
    path, hf = checkpoint
    requests = run(path, **kwargs)
    if "num_kv_blocks" in kwargs:  # an asking request recomputed its prompt
        asking = [r for r, k in zip(requests, NUM_TOP, strict=True) if k is not None]
        assert sum(r.num_preemptions for r in asking) > 0
    plain = run(path, max_num_batched_tokens=64)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in plain]
    for request, k in zip(requests, NUM_TOP, strict=True):
        if k is None:
            continue
        prompt = request.prompt_token_ids
        assert request.num_cached_tokens == 0  # needs every row's logits
        assert len(request.prompt_logprobs) == len(prompt)
        assert request.prompt_logprobs[0] is None
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)
        for j in range(1, len(prompt)):
            entry = request.prompt_logprobs[j]
            assert entry is not None
            target = prompt[j]
            torch.testing.assert_close(
                entry[target], want[j - 1, target].item(), atol=1e-4, rtol=0
            )
            values, ids = want[j - 1].topk(k)
            top = {t: lp for t, lp in entry.items() if t != target or target in ids}
            assert sorted(top) == sorted(ids.tolist())
            for t, v in zip(ids.tolist(), values.tolist(), strict=True):
                torch.testing.assert_close(entry[t], v, atol=1e-4, rtol=0)


def test_more_than_20_prompt_logprobs_are_refused(checkpoint):
    path, _ = checkpoint
    reset_workspace_manager()
    try:
        engine = EngineCore(
            EngineConfig(path, dtype="float32", device="cpu", prefix=next(_prefixes))
        )
        request = Request("r", [1, 2], SamplingParams(prompt_logprobs=21))
        with pytest.raises(ValueError, match="prompt_logprobs: expected <= 20"):
            engine.add_request(request)
        assert not engine.has_unfinished_requests()
    finally:
        reset_workspace_manager()
    with pytest.raises(ValueError, match="prompt_logprobs: expected None or >= 0"):
        SamplingParams(prompt_logprobs=-1)
