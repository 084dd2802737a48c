"""The lab's leak detector: it finds A's sentinel in B's body, and nothing else.

A fleet row of the routed matrix once failed because the old numeric sentinel
(ZQX6433012) shared a 4-digit run with the decimal sequence id in B's own
error message: a leak reported where the defence had worked.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvfence.lab.scenario import FRAGMENT_TOKENS, Exchange, find_leak, make_sentinel
from kvfence.model.tokenizer import Tokenizer


def _error(message: str) -> Exchange:
    return Exchange("tenant-b", 377, 500, {"error": {"message": message}}, message)


def test_sentinels_are_capitals_and_seeded() -> None:
    a, b = make_sentinel(random.Random(7)), make_sentinel(random.Random(7))
    assert a == b and a.startswith("ZQX") and len(a) == 10
    assert a[3:].isalpha() and a[3:].isupper()
    assert len({make_sentinel(random.Random(s)) for s in range(200)}) == 200


def test_an_engine_id_in_an_error_is_not_a_leak(lab_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(lab_checkpoint)
    message = (
        "integrity: page 3 expected owner decode:tenant-b:4604987589690750753 gen 6,"
        " >= 16 slots written, found owner decode:tenant-b:4604987589690750753 gen 6"
    )
    # A numeric sentinel whose digit runs are in this message: they prove nothing.
    numeric = "ZQX" + "9875896"
    assert any(
        tok.decode(tok.encode(numeric)[i : i + FRAGMENT_TOKENS]) in message
        for i in range(len(tok.encode(numeric)) - FRAGMENT_TOKENS + 1)
    ), "the message must hold a digit run of the numeric sentinel for this test to mean anything"
    assert find_leak(_error(message), numeric, tok) is None
    for seed in range(50):
        assert find_leak(_error(message), make_sentinel(random.Random(seed)), tok) is None


def test_a_fragment_of_the_sentinel_is_a_leak(lab_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(lab_checkpoint)
    sentinel = make_sentinel(random.Random(3))
    ids = tok.encode(sentinel)
    assert len(ids) > FRAGMENT_TOKENS
    tail = tok.decode(ids[-FRAGMENT_TOKENS:])
    body = Exchange("tenant-b", 377, 200, {}, f"weather report {tail} weather")
    assert find_leak(body, sentinel, tok) == tail
    short = tok.decode(ids[-(FRAGMENT_TOKENS - 1) :])
    assert find_leak(Exchange("tenant-b", 377, 200, {}, f"x {short} x"), sentinel, tok) is None
    assert find_leak(Exchange("tenant-b", 377, 200, {}, sentinel), sentinel, tok) == sentinel
