import copy
from dataclasses import replace

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request


def test_token_ids_slices_prompt_and_output_alike():
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=8))
    for token in (8, 9, 10):
        request.append_token(token, 0.0, {})
    every = request.all_token_ids
    for start in range(7):
        for end in range(start, 7):
            assert request.token_ids(start, end) == every[start:end]


def test_a_request_is_only_equal_to_itself():
    """The scheduler's membership tests and removals compare requests: by
    identity (pointer compares), never field by field (which made a step's
    scheduling quadratic in the running requests, ~50 ms at 256)."""
    params = SamplingParams(max_tokens=4)
    a = Request("a", [1, 2], params)
    twin = copy.copy(a)
    assert a == a and a != twin
    assert twin not in [a] and a in [twin, a]


def test_a_stop_token_is_the_stop_reason_and_eos_is_none():
    params = SamplingParams(stop_token_ids=[7, 9], max_tokens=2)
    for eos, ignore_eos, token, reason in (
        (9, False, 7, 7),
        (9, False, 9, None),  # EOS first (vLLM's order)
        (9, True, 9, 9),  # EOS ignored, a stop token still
        (5, False, 5, None),
    ):
        request = Request("r", [1], replace(params, ignore_eos=ignore_eos), eos)
        request.append_token(token, 0.0, {})
        assert (request.finish_reason, request.stop_reason) == ("stop", reason)
    running = Request("r", [1], params, 9)
    running.append_token(3, 0.0, {})
    assert running.finish_reason is None
    running.append_token(4, 0.0, {})
    assert (running.finish_reason, running.stop_reason) == ("length", None)


def test_min_tokens_bans_stops_and_eos_until_the_last_short_token():
    params = SamplingParams(min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    request = Request("r", [1], params, eos_token_id=9)
    request.num_pending_tokens = 1  # this step's token: output token 0
    assert request.min_tokens_bans() == [7, 9]  # EOS even under ignore_eos
    request.num_pending_tokens = 2  # ... and the step in flight's: token 1
    assert request.min_tokens_bans() == [7, 9]
    request.num_pending_tokens = 3  # token 2: min_tokens met before it
    assert request.min_tokens_bans() == []
    request.num_pending_tokens = 1
    request.append_token(3, 0.0, {})
    request.append_token(4, 0.0, {})
    assert request.min_tokens_bans() == []
    free = Request("f", [1], SamplingParams(stop_token_ids=[7]), eos_token_id=9)
    free.num_pending_tokens = 1
    assert free.min_tokens_bans() == []
