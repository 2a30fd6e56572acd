import copy

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
