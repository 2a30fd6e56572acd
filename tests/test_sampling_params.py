from vllm.sampling_params import SamplingParams


def test_fan_out_gives_each_sequence_its_own_seed():
    one = SamplingParams(temperature=0.5)
    assert one.fan_out() == [one]
    seeded = SamplingParams(n=3, seed=40, top_k=5)
    children = seeded.fan_out()
    assert [(c.n, c.seed, c.top_k) for c in children] == [
        (1, 40, 5),
        (1, 41, 5),
        (1, 42, 5),
    ]
    unseeded = SamplingParams(n=2, max_tokens=3).fan_out()
    assert [(c.n, c.seed, c.max_tokens) for c in unseeded] == [(1, None, 3)] * 2
    assert seeded.n == 3 and seeded.seed == 40  # the parent stays as given
