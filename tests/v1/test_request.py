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
