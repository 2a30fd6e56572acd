import numpy as np
import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import (
    TokenHistory,
    TokenMasks,
    adjusted_logits,
    filtered_probs,
    sample,
    sample_async,
)


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = logits.expand(n, -1)
    return [t.token_id for t in sample(rows, [params] * n, [gen] * n)]


def test_greedy_is_the_argmax_with_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    out = sample(logits, [SamplingParams(temperature=0, logprobs=2)] * 3, [None] * 3)
    reference = torch.log_softmax(logits, dim=-1)
    for row, token in zip(reference, out, strict=True):
        assert token.token_id == int(row.argmax())
        assert token.logprob == pytest.approx(float(row.max()))
        assert list(token.top_logprobs) == row.topk(2).indices.tolist()


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 9.9e-6])
def test_temperatures_below_the_greedy_bound_are_greedy(temperature):
    """Dividing the logits by them overflows fp32 (NaN probabilities drew
    token 0): below vLLM's bound they take the argmax, seed or not."""
    torch.manual_seed(5)
    logits = torch.randn(4, 50) * 8
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.greedy and not SamplingParams(temperature=1e-5).greedy
    out = sample(logits, [params] * 4, [torch.Generator().manual_seed(3)] * 4)
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()


def test_logprobs_only_for_the_rows_that_ask():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    asks = [None, 0, 3, None]  # 0: the sampled token's logprob only
    params = [SamplingParams(temperature=0, logprobs=n) for n in asks]
    out = sample(logits, params, [None] * 4)
    reference = torch.log_softmax(logits, dim=-1)
    for n, row, token in zip(asks, reference, out, strict=True):
        assert token.token_id == int(row.argmax())
        if n is None:
            assert token.logprob != token.logprob and not token.top_logprobs  # NaN
        else:
            assert token.logprob == pytest.approx(float(row.max()))
            assert list(token.top_logprobs) == row.topk(n).indices.tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(2, 100)
    params = SamplingParams(temperature=1.0, seed=7)

    def run(batch: torch.Tensor, where: int) -> int:
        gens: list[torch.Generator | None] = [None] * batch.shape[0]
        gens[where] = torch.Generator().manual_seed(7)
        return sample(batch, [params] * batch.shape[0], gens)[where].token_id

    alone = [run(logits[:1], 0) for _ in range(3)]
    assert len(set(alone)) == 1
    assert run(torch.cat([logits[1:], logits[:1]]), 1) == alone[0]


def test_filters_keep_exactly_the_reference_sets():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))

    def kept(**kw) -> set[int]:
        probs = filtered_probs(logits[None], [SamplingParams(**kw)])[0]
        return set(probs.nonzero().flatten().tolist())

    assert kept(top_k=2) == {0, 1}
    assert kept(top_p=0.69) == {0, 1}  # 0.4 + 0.3 reaches it
    assert kept(top_p=0.71) == {0, 1, 2}
    assert kept(min_p=0.3) == {0, 1, 2}  # >= 0.3 * 0.4
    assert kept(top_k=3, top_p=0.5) == {0, 1}
    probs = filtered_probs(logits[None], [SamplingParams(top_k=2)])[0]
    torch.testing.assert_close(probs[:2], torch.tensor([0.4, 0.3]) / 0.7)


def test_samples_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    tokens = torch.tensor(draws(logits[None], SamplingParams(top_p=0.8), 4000))
    assert set(tokens.tolist()) <= {0, 1}
    share = float((tokens == 0).float().mean())
    assert share == pytest.approx(0.5 / 0.8, abs=0.03)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -1.0),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("logprobs", -1),
        ("stop", [""]),
        ("seed", 2**64),
        ("seed", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", float("nan")),
        ("logit_bias", {3: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("min_tokens", -1),
        ("min_tokens", 17),  # past max_tokens (16)
    ],
)
def test_bad_values_are_named(field, value):
    with pytest.raises(ValueError, match=f"{field}: expected"):
        SamplingParams(**{field: value})


def test_one_params_per_row():
    with pytest.raises(ValueError, match="params/generators: expected 2"):
        sample(torch.zeros(2, 4), [SamplingParams()], [None])


def test_one_stop_string_is_not_its_characters():
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]


def test_a_mixed_batch_filters_each_row_as_alone():
    torch.manual_seed(3)
    logits = torch.randn(4, 64) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2, top_k=40),
        SamplingParams(temperature=0.5),
    ]
    batch = filtered_probs(logits, params)
    for row, p in enumerate(params):
        alone = filtered_probs(logits[row : row + 1], [p])[0]
        torch.testing.assert_close(batch[row], alone)
    assert torch.count_nonzero(batch[0]) == 5  # its top_k
    assert 0 < torch.count_nonzero(batch[1]) < 64  # its top_p
    assert torch.count_nonzero(batch[3]) == 64  # no filter: nothing dropped


def test_greedy_seeded_and_unseeded_rows_in_one_batch():
    torch.manual_seed(4)
    logits = torch.randn(3, 80)
    greedy = SamplingParams(temperature=0)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    unseeded = SamplingParams(temperature=0.9)
    out = sample(
        logits,
        [greedy, seeded, unseeded],
        [None, torch.Generator().manual_seed(11), None],
    )
    assert out[0].token_id == int(logits[0].argmax())
    (alone,) = sample(logits[1:2], [seeded], [torch.Generator().manual_seed(11)])
    assert out[1].token_id == alone.token_id
    assert 0 <= out[2].token_id < 80


def reference_penalties(logits, params, prompts, outputs):
    """One row at a time, token by token, as the docstring states them."""
    out = logits.clone()
    for row, (p, prompt, output) in enumerate(
        zip(params, prompts, outputs, strict=True)
    ):
        for token in range(logits.shape[1]):
            count = output.count(token)
            value = float(out[row, token])
            if token in prompt or count:
                rep = p.repetition_penalty
                value = value / rep if value > 0 else value * rep
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            out[row, token] = value
    return out


def test_penalties_match_the_reference():
    """Rows with each penalty alone, all three, none; repeated tokens, an
    empty history, and tokens still pending on the device (counted as the
    output's last)."""
    torch.manual_seed(5)
    vocab = 40
    logits = torch.randn(5, vocab)
    params = [
        SamplingParams(presence_penalty=0.7),
        SamplingParams(temperature=0, frequency_penalty=-1.25),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(),
        SamplingParams(
            presence_penalty=-0.3, frequency_penalty=0.9, repetition_penalty=0.6
        ),
    ]
    prompts = [[1, 2, 3], [4], [5, 5, 6, 7], [8], [9, 10]]
    outputs = [[3, 3, 11], [12, 12, 12, 4], [], [13], [10, 14, 14]]
    pending = torch.tensor([11, -1, 15, 16, 9])
    history = TokenHistory([np.array(p) for p in prompts], outputs, pending)
    before = logits.clone()
    got = adjusted_logits(logits, params, history)
    assert torch.equal(logits, before)  # a copy: the raw logits give logprobs
    counted = [
        o + ([int(t)] if t >= 0 else []) for o, t in zip(outputs, pending, strict=True)
    ]
    expected = reference_penalties(logits, params, prompts, counted)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got, logits)
    torch.testing.assert_close(got[3], logits[3])  # no penalty: untouched


def test_penalties_steer_greedy_rows_and_leave_logprobs_raw():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=1)]
    history = TokenHistory([np.array([0])], [[1, 1]])
    (token,) = sample(logits, params, [None], history)
    assert token.token_id == 2  # 3 - 2 * 1 < 2
    raw = torch.log_softmax(logits, -1)[0]
    assert token.logprob == pytest.approx(float(raw[2]))
    assert list(token.top_logprobs) == [1]
    with pytest.raises(ValueError, match="history: expected the rows' tokens"):
        sample(logits, params, [None])
    for prompt, output in (([0], [4]), ([-1], [1])):  # a token out of the vocabulary
        bad = TokenHistory([np.array(prompt)], [output])
        with pytest.raises(
            ValueError, match=r"history: expected token ids in \[0, 4\)"
        ):
            sample(logits, params, [None], bad)


def test_logit_bias_adds_to_its_tokens_before_the_penalties():
    """+100 makes a token the greedy pick, -100 removes the argmax; the bias
    comes before the penalties (vLLM's order: a repetition penalty scales
    the biased logit); rows without one are untouched; logprobs stay raw;
    an id past the vocabulary (it would land in the next row) is refused."""
    torch.manual_seed(6)
    logits = torch.randn(3, 20)
    logits[2, 2] = 2.0
    top = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=0),
        SamplingParams(temperature=0, logit_bias={top: -100.0}),
        SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={2: -4.0}),
    ]
    history = TokenHistory([np.array([0])] * 3, [[], [], [2]])
    got = adjusted_logits(logits, params, history)
    expected = logits.clone()
    expected[0, 7] += 100
    expected[1, top] -= 100
    expected[2, 0] = expected[2, 0] / 2 if expected[2, 0] > 0 else expected[2, 0] * 2
    expected[2, 2] = (2.0 - 4.0) * 2  # biased, then seen: negative, so times 2
    torch.testing.assert_close(got, expected)
    tokens = sample(logits, params, [None] * 3, history)
    assert tokens[0].token_id == 7
    assert tokens[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[7]))
    assert tokens[1].token_id == int(logits[1].topk(2).indices[1])
    # biases alone need no history
    (alone,) = sample(logits[:1], params[:1], [None])
    assert alone.token_id == 7
    with pytest.raises(ValueError, match="logit_bias: expected token ids < 20"):
        adjusted_logits(logits[:1], [SamplingParams(logit_bias={20: 1.0})], None)


def test_banned_tokens_are_never_sampled_and_logprobs_stay_raw():
    torch.manual_seed(4)
    logits = torch.randn(2, 40)
    greedy, rand = SamplingParams(temperature=0, logprobs=0), SamplingParams()
    top = logits.topk(5).indices.tolist()
    banned = {0: top[0][:1], 1: top[1]}  # the argmax; the five most likely
    (first,) = [t for t in sample_async(
        logits[:1], [greedy], [None], banned={0: banned[0]}
    ).tolist()]  # fmt: skip
    assert first.token_id == top[0][1]  # the runner-up
    reference = torch.log_softmax(logits[0], -1)[top[0][1]]
    assert first.logprob == pytest.approx(float(reference))
    rows = logits[1:].expand(200, -1)
    gen = torch.Generator().manual_seed(0)
    drawn = sample_async(
        rows, [rand] * 200, [gen] * 200, banned={i: banned[1] for i in range(200)}
    ).tolist()
    assert not {t.token_id for t in drawn} & set(banned[1])
    unbanned = sample_async(rows, [rand] * 200, [gen] * 200).tolist()
    assert {t.token_id for t in unbanned} & set(banned[1])  # they would be drawn
    with pytest.raises(ValueError, match=r"banned: expected token ids in \[0, 40\)"):
        adjusted_logits(logits, [greedy, rand], None, {1: [40]})


def pack(rows: list[set[int]], vocab: int) -> torch.Tensor:
    """Allowed token sets as xgrammar's bitmask (bit t % 32 of word t // 32)."""
    words = np.zeros((len(rows), -(-vocab // 32)), dtype=np.uint32)
    for i, tokens in enumerate(rows):
        for t in tokens:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def test_token_masks_confine_their_rows_and_logprobs_stay_raw():
    torch.manual_seed(5)
    logits = torch.randn(3, 70)  # three words, the last one partial
    greedy, rand = SamplingParams(temperature=0, logprobs=0), SamplingParams()
    order = logits[0].argsort(descending=True).tolist()
    keep = {order[9], order[3], 69, 31}  # bits in every word, the sign bit too
    masks = TokenMasks([0, 2], pack([keep, {5, 64}], 70))
    first, free, third = sample_async(
        logits, [greedy, greedy, greedy], [None] * 3, masks=masks
    ).tolist()
    assert first.token_id == max(keep, key=lambda t: float(logits[0, t]))
    assert free.token_id == int(logits[1].argmax())  # row 1 has no mask
    assert third.token_id == max((5, 64), key=lambda t: float(logits[2, t]))
    reference = torch.log_softmax(logits[0], -1)[first.token_id]
    assert first.logprob == pytest.approx(float(reference))
    rows = logits[:1].expand(300, -1)
    gen = torch.Generator().manual_seed(0)
    masks = TokenMasks(list(range(300)), pack([keep] * 300, 70))
    drawn = sample_async(rows, [rand] * 300, [gen] * 300, masks=masks).tolist()
    assert {t.token_id for t in drawn} == keep  # all of them, nothing else
    # a row whose mask and bans leave nothing gets its bans lifted
    only = TokenMasks([0, 1], pack([{7}, {7, 8}], 70))
    stuck, free = sample_async(
        logits[:2], [greedy, greedy], [None] * 2, banned={0: [7], 1: [7]}, masks=only
    ).tolist()
    assert (stuck.token_id, free.token_id) == (7, 8)


@pytest.mark.gpu
def test_sampling_never_waits_for_the_stream():
    """Under async scheduling the host samples step N + 1 while the GPU runs
    step N: a copy from pageable memory or a read of a device value would
    wait for it. torch's sync debug mode makes any such wait an error; a
    batch with every feature (filters, a seed, penalties with a pending
    token, a bias, logprobs, banned tokens) samples without one."""
    device = torch.device("cuda")
    logits = torch.randn(5, 300, device=device)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0, presence_penalty=1.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.5, frequency_penalty=0.5, logit_bias={3: 5.0}),
    ]
    generators = [None, None, torch.Generator(device).manual_seed(7), None, None]
    prompts = [
        np.array([1, 2]),
        np.array([3]),
        np.array([4]),
        np.array([5, 6]),
        np.array([7]),
    ]
    outputs = [[8], [], [9, 9], [10, 11], [12]]
    history = TokenHistory(
        prompts, outputs, torch.tensor([-1, 2, -1, 5, 9], device=device)
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sample_async(
            logits, params, generators, history=history, banned={1: [4, 5]}
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens = batch.tolist()
    assert len(tokens) == 5 and tokens[0].token_id == int(logits[0].argmax())
    assert len(tokens[0].top_logprobs) == 3
