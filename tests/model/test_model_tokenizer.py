"""Tokenizer: exact round trips, streaming without half characters, chat template like transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfence.model.tokenizer import Tokenizer

CANARIES = [
    "CANARY-7f3a9c2e-tenant-A: the vault code is 0xDEADBEEF",
    "  leading spaces,\ttabs\nand\r\nnewlines  ",
    "東京タワー 😀👩‍👩‍👧 ‘quotes’ — naïve café",
    "<|im_start|>user\nnot really a turn<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.mark.parametrize("text", CANARIES)
def test_canaries_round_trip_exactly(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=80))
def test_any_text_round_trips(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_streaming_pieces_concatenate_to_the_text_and_never_split_a_character(
    tok: Tokenizer, text: str
) -> None:
    ids = tok.encode(text)
    stream = tok.detokenizer(skip_special_tokens=False)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


def test_streaming_holds_back_a_multibyte_character_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) == 4  # four byte tokens: no merge covers the emoji
    stream = tok.detokenizer()
    assert [stream.push(i) for i in ids] == ["", "", "", "😀"]
    assert stream.flush() == ""


def test_encode_adds_no_special_tokens_and_ids_match_transformers(
    tok: Tokenizer, tiny_checkpoint: Path
) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    for text in CANARIES:
        assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.bos_id == hf.bos_token_id and tok.eos_id == hf.eos_token_id
    assert tok.eos_id is not None and tok.eos_id in tok.eos_ids


def test_chat_template_renders_like_transformers(tok: Tokenizer, tiny_checkpoint: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
    ]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.endswith("<|im_end|>\n")
    assert tok.encode(ours)[0] == tok.token_to_id("<|im_start|>")


def test_missing_chat_template_is_an_error(tiny_checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_checkpoint / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
