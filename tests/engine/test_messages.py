"""Typed PD messages: every type round-trips; anything malformed is a MessageError, never a crash."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfence.engine.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Bootstrap,
    BootstrapReady,
    ErrorInfo,
    Failure,
    MessageError,
    PageRef,
    PrefillWork,
    RoomRegistration,
    SamplingParams,
    TokenChunk,
    TransferDone,
    TransferManifest,
    decode_message,
    encode_message,
)

CI = settings(derandomize=True, database=None, deadline=None)

PAGES = (PageRef(3, 0), PageRef(7, 2))
SAMPLES: list[Any] = [
    Bootstrap("room-1", "tenant-a", 100, 16, SamplingParams(max_tokens=16, temperature=0.0)),
    BootstrapReady("room-1", PAGES),
    PrefillWork(
        "room-1",
        "tenant-a",
        (1, 2, 3),
        SamplingParams(seed=7, stop_token_ids=(2,), logprobs=3),
        PAGES,
        "tenant-a/salt",
        "tcp://127.0.0.1:5555",
    ),
    TransferManifest("room-1", "tenant-a", 20, 2, PAGES, "sha256:ab", 42, ((42, -0.5), (7, -1.25))),
    TokenChunk("room-1", (5, 6), (((5, -0.1),), ((6, -0.2), (9, -3.0))), "stop", 16),
    TokenChunk("room-1", ()),
    Failure("room-1", ErrorInfo(400, "invalid_request_error", "too long", "messages", None)),
    Abort("room-1", "client disconnected"),
    TransferDone("room-1", False),
    RoomRegistration("room-1", "tenant-a", 20, PAGES, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
]


def test_samples_cover_the_original_protocol() -> None:
    covered = {type(m).__name__ for m in SAMPLES}
    assert covered <= set(MESSAGE_TYPES)
    assert len(covered) >= 8


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_sample_round_trips_exactly(msg: Any) -> None:
    raw = encode_message(msg)
    assert json.loads(raw)["type"] == type(msg).__name__
    back = decode_message(raw)
    assert back == msg and type(back) is type(msg)
    assert encode_message(back) == raw


# ---- every registered type, generated from its own type hints ------------------------------


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in args))
    if hint is type(None):
        return st.none()
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    if dataclasses.is_dataclass(hint):
        return dataclass_strategy(hint)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(-(2**63), 2**63),
        str: st.text(max_size=12),
        bool: st.booleans(),
        float: st.floats(allow_nan=False),
    }
    return simple[hint]


def dataclass_strategy(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: st.just(PROTOCOL_VERSION) if f.name == "version" else strategy_for(hints[f.name])
        for f in dataclasses.fields(cls)
    }

    def build(kwargs: dict[str, Any]) -> Any:
        try:
            return cls(**kwargs)
        except MessageError:  # a value its own validation refuses (e.g. top_p 0)
            return None

    return st.fixed_dictionaries(fields).map(build).filter(lambda m: m is not None)


ANY_MESSAGE = st.sampled_from(sorted(MESSAGE_TYPES)).flatmap(
    lambda name: dataclass_strategy(MESSAGE_TYPES[name])
)


@settings(CI, max_examples=300, suppress_health_check=[HealthCheck.filter_too_much])
@given(ANY_MESSAGE)
def test_every_message_type_round_trips(msg: Any) -> None:
    back = decode_message(encode_message(msg))
    assert back == msg and type(back) is type(msg)


# ---- malformed input ------------------------------------------------------------------------


def body_of(msg: Any) -> dict[str, Any]:
    return json.loads(encode_message(msg))["body"]  # type: ignore[no-any-return]


def raw(type_name: Any, body: Any) -> bytes:
    return json.dumps({"type": type_name, "body": body}).encode()


BAD: dict[str, tuple[bytes, str]] = {
    "not-json": (b"{nope", "not a JSON message"),
    "bad-utf8": (b'{"type": "\xff"}', "not a JSON message"),
    "empty": (b"", "not a JSON message"),
    "deeply-nested": (b"[" * 100_000 + b"]" * 100_000, "not a JSON message"),
    "huge-int-literal": (b'{"type": "Abort", "body": {"room": ' + b"9" * 5000 + b"}}", "JSON"),
    "a-list": (b"[1, 2]", "exactly 'type' and 'body'"),
    "no-body": (b'{"type": "Abort"}', "exactly 'type' and 'body'"),
    "extra-top-level": (
        json.dumps({"type": "Abort", "body": body_of(Abort("r", "x")), "x": 1}).encode(),
        "exactly 'type' and 'body'",
    ),
    "unknown-type": (raw("Shutdown", {}), "unknown message type 'Shutdown'"),
    "type-not-a-string": (raw(["Abort"], {}), "unknown message type"),
    "body-not-object": (raw("Abort", [1]), "body must be an object"),
    "wrong-version": (
        raw("Abort", {"room": "r", "reason": "x", "version": PROTOCOL_VERSION + 1}),
        f"version {PROTOCOL_VERSION + 1}",
    ),
    "missing-field": (raw("Abort", {"room": "r"}), "Abort"),
    "unknown-field": (raw("Abort", {"room": "r", "reason": "x", "admin": True}), "unknown fields"),
    "unknown-nested-field": (
        raw("Failure", {"room": "r", "error": {**body_of(SAMPLES[6])["error"], "trace": "."}}),
        "ErrorInfo has unknown fields",
    ),
    "str-for-int": (raw("TransferDone", {"room": "r", "ok": True, "version": "1"}), "int"),
    "bool-for-int": (
        raw("Bootstrap", {"room": "r", "tenant": "t", "num_prompt_tokens": True, "max_tokens": 1}),
        "must be int",
    ),
    "int-for-bool": (raw("TransferDone", {"room": "r", "ok": 1}), "must be bool"),
    "float-for-int": (
        raw("Bootstrap", {"room": "r", "tenant": "t", "num_prompt_tokens": 1.5, "max_tokens": 1}),
        "must be int",
    ),
    "int-for-str": (raw("Abort", {"room": 5, "reason": "x"}), "must be str"),
    "null-for-str": (raw("Abort", {"room": None, "reason": "x"}), "must be str"),
    "str-for-list": (raw("BootstrapReady", {"room": "r", "pages": "0,1"}), "must be a list"),
    "wrong-pair-arity": (
        raw("TokenChunk", {"room": "r", "token_ids": [1], "logprobs": [[[1, -0.5, 9]]]}),
        "must have 2 items",
    ),
    "float-overflow": (
        raw("TokenChunk", {"room": "r", "token_ids": [1], "logprobs": [[[1, 10**400]]]}),
        "out of range",
    ),
    "bad-sampling": (
        raw("Bootstrap", {**body_of(SAMPLES[0]), "sampling": {"top_p": 0.0}}),
        "top_p",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_message_is_a_message_error(case: str) -> None:
    data, message = BAD[case]
    with pytest.raises(MessageError, match=message):
        decode_message(data)


# ---- fuzz: nothing but MessageError, ever ---------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def assert_decodes_or_refuses(data: bytes) -> None:
    try:
        msg = decode_message(data)
    except MessageError:
        return
    assert type(msg) in MESSAGE_TYPES.values()


@settings(CI, max_examples=400)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    assert_decodes_or_refuses(data)


@settings(CI, max_examples=400)
@given(st.sampled_from(sorted(MESSAGE_TYPES)) | st.text(max_size=8), JSON)
def test_fuzz_random_json_bodies(type_name: str, body: Any) -> None:
    assert_decodes_or_refuses(raw(type_name, body))


@settings(CI, max_examples=400)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_one_field_of_a_valid_message(msg: Any, data: st.DataObject) -> None:
    """A valid message with one field replaced by random JSON (the likeliest corruption)."""
    body = body_of(msg)
    key = data.draw(st.sampled_from(sorted(body)))
    body[key] = data.draw(JSON)
    assert_decodes_or_refuses(raw(type(msg).__name__, body))
