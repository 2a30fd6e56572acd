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
    assert detok.stopped and detok.text == "héllo "
    assert "".join(pieces) == "héllo " and detok.update([ids[0]]) == ""
    assert detok.flush() == ""


def test_flush_keeps_bytes_that_never_became_a_character(tokenizer):
    ids = tokenizer("✓")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids[:-1]) == ""  # an incomplete character: held back
    assert detok.flush() == tokenizer.decode(ids[:-1])
