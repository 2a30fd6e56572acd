import random

import pytest

from vllm.model_executor.model_loader.tiny_checkpoint import train_tokenizer
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

TEXT = "héllo wörld ✓ 日本語 done"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(320)


def test_pieces_are_whole_characters_and_add_up(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT) // 2  # multi-byte characters span tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.update([token]) for token in ids]
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) + detok.flush() == TEXT
    assert any(piece == "" for piece in pieces)  # a held-back partial character


def test_stop_strings_straddling_pieces_cut_the_text(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["wörld", "never"])
    pieces = [detok.update([token]) for token in ids]
    assert detok.stop_string == "wörld" and detok.text == "héllo "
    assert "".join(pieces) == "héllo " and detok.update([ids[0]]) == ""
    assert detok.flush() == ""


def test_a_stop_string_at_the_start_emits_nothing(tokenizer):
    """Text shorter than the hold-back (the longest stop string less one)
    stays held: none of a stop string that opens the output leaks."""
    ids = tokenizer("Observation: done")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["Observation:"])
    pieces = [detok.update([token]) for token in ids]
    assert detok.stop_string == "Observation:" and detok.text == ""
    assert pieces == [""] * len(ids) and detok.flush() == ""
    held = IncrementalDetokenizer(tokenizer, stop=["Observation:"])
    assert held.update(ids[:2]) == "" and held.flush() == held.text != ""


def test_the_token_that_ended_the_request_stays_out_of_the_text(tokenizer):
    ids = tokenizer("ab cd")["input_ids"]
    dropped = IncrementalDetokenizer(tokenizer)
    assert dropped.update(ids, stop_terminated=True) + dropped.flush() == (
        tokenizer.decode(ids[:-1])
    )
    kept = IncrementalDetokenizer(tokenizer, include_stop=True)
    assert kept.update(ids, stop_terminated=True) + kept.flush() == "ab cd"


def test_a_stop_string_counts_only_past_the_first_min_tokens(tokenizer):
    ids = tokenizer("ab ab ab ab")["input_ids"]
    first_ab = len(tokenizer("ab")["input_ids"])
    early = IncrementalDetokenizer(tokenizer, stop=["ab"], min_tokens=0)
    early.update(ids)
    assert early.stopped and early.text == ""
    late = IncrementalDetokenizer(tokenizer, stop=["ab"], min_tokens=first_ab)
    for token in ids:
        late.update([token])
    assert late.stopped and late.text == "ab "  # the first "ab" is its min_tokens'
    # one that starts in that text and ends past it counts (vLLM's rule)
    straddling = IncrementalDetokenizer(tokenizer, stop=["b a"], min_tokens=first_ab)
    straddling.update(ids)
    assert straddling.stopped and straddling.text == "a"
    never = IncrementalDetokenizer(tokenizer, stop=["ab"], min_tokens=len(ids))
    assert never.update(ids) + never.flush() == "ab ab ab ab" and not never.stopped


def test_the_stop_string_kept_and_special_tokens_shown_when_asked(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    kept = IncrementalDetokenizer(tokenizer, stop=["wörld", "llo"], include_stop=True)
    assert "".join(kept.update([t]) for t in ids) == "héllo"
    assert kept.stop_string == "llo"
    # the first to appear; of those starting together, the shortest
    tie = IncrementalDetokenizer(tokenizer, stop=["lo", "llo", "l"], include_stop=True)
    assert tie.update(ids) + tie.flush() == "hél" and tie.stop_string == "l"
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for skip, want in ((True, "héllo"), (False, "<|im_end|>héllo")):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        text = detok.update([special, *tokenizer("héllo")["input_ids"]])
        assert text + detok.flush() == want


def test_flush_keeps_bytes_that_never_became_a_character(tokenizer):
    ids = tokenizer("✓")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids[:-1]) == ""  # an incomplete character: held back
    assert detok.flush() == tokenizer.decode(ids[:-1])


class CountingTokenizer:
    """Counts the tokens each ``decode`` reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, token_ids, **kwargs):
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def test_each_update_decodes_a_window_not_the_sequence(tokenizer):
    ids = tokenizer(TEXT * 20)["input_ids"]
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.update([token]) for token in ids) + detok.flush()
    assert text == TEXT * 20
    # Whole-sequence decoding reads ~len(ids)^2 / 2 tokens; windows of a
    # few tokens read a small multiple of len(ids).
    assert counting.decoded < 10 * len(ids)


@pytest.mark.parametrize("seed", range(20))
def test_random_tokens_and_specials_add_up_to_the_whole_decode(tokenizer, seed):
    # Random ids split characters anywhere and leave stray bytes (U+FFFD).
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for i in range(0, len(ids), 3):
        pieces.append(detok.update(ids[i : i + 3]))
    assert "".join(pieces) + detok.flush() == tokenizer.decode(
        ids, skip_special_tokens=True
    )
    assert not any(piece.endswith("\ufffd") for piece in pieces)


def test_flush_cuts_at_a_stop_string_in_the_held_back_tail(tokenizer):
    ids = tokenizer("ab✓")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["b"])
    assert detok.update(ids[:-1]) == ""  # ends in a partial character
    assert detok.flush() == "a" and detok.stopped and detok.text == "a"
