"""Admission without a server: header + body in, `Prepared` or a 4xx out, nothing allocated.

The same rules the HTTP tests check end to end (test_serve_bad_input.py), here
as plain function calls: the seam where new admission rules go.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from kvfence.engine.sizing import GateReport
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.admission import Admission, Prepared
from kvfence.serve.config import Capacity, ServeConfig
from kvfence.serve.errors import ApiError
from kvfence.serve.protocol import Kind
from kvfence.serve.tenants import Tenant, TenantRegistry
from kvfence.serve.tokenizing import INLINE_BYTES, encodings

KEY_A = "sk-aaaaaaaaaaaaaaaaaaaa"
KEY_B = "sk-bbbbbbbbbbbbbbbbbbbb"
CTX, EDGE = 256, 64


@pytest.fixture(scope="module")
def admission(checkpoint: Path) -> Admission:
    tok = Tokenizer.from_dir(checkpoint)
    config = ServeConfig("tiny", CTX, tok.vocab_size, allow_undersized_pool=True)
    capacity = Capacity(GateReport(EDGE, CTX, 1.0), EDGE, True, False, EDGE)
    tenants = TenantRegistry((Tenant("a", (KEY_A,)), Tenant("b", (KEY_B,))))
    return Admission(tok, config, capacity, tenants)


def body(**fields: object) -> bytes:
    return json.dumps({"prompt": "hello", **fields}).encode()


def refused(admission: Admission, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as e:
        admission.admit("completion", "a", raw)
    return e.value


def test_authenticate_refuses_a_missing_or_wrong_key(admission: Admission) -> None:
    assert admission.authenticate(f"Bearer {KEY_B}") == "b"
    for header in (None, "Bearer nope", f"Bearer {KEY_A}x"):
        with pytest.raises(ApiError) as e:
            admission.authenticate(header)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"


def test_admit_prepares_a_good_request_in_the_tenants_namespace(admission: Admission) -> None:
    prep = admission.admit("completion", "a", body(max_tokens=4))
    assert prep.tenant == "a" and prep.prompt_ids and prep.sampling.max_tokens == 4
    assert prep.cache_namespace == "tenant:a"
    salted = admission.admit("completion", "a", body(cache_salt="s1"))
    other = admission.admit("completion", "a", body(cache_salt="s2"))
    assert salted.cache_namespace.startswith("tenant:a/salt:")
    assert salted.cache_namespace != other.cache_namespace  # I8: the salt splits the cache


def test_admit_enforces_the_edge_limit_before_anything_runs(admission: Admission) -> None:
    """I4: with an undersized pool, prompt + max_tokens above the pool is a 400 naming it."""
    e = refused(admission, body(max_tokens=EDGE))
    assert e.status == 400 and e.code == "pool_capacity_exceeded" and e.param == "max_tokens"
    assert f"limit of {EDGE} tokens" in e.message
    e = refused(admission, json.dumps({"prompt": list(range(CTX + 1))}).encode())
    assert e.code == "context_length_exceeded" and e.param == "prompt"


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"", 400, "invalid_json"),
        (body(model="other"), 404, "model_not_found"),
        (json.dumps({"prompt": [10**9]}).encode(), 400, "token_out_of_vocab"),
        (body(stop_token_ids=[-1]), 400, "token_out_of_vocab"),
        (body(n=2), 400, "unsupported_parameter"),
    ],
)
def test_admit_refuses_bad_input_with_a_named_error(
    admission: Admission, raw: bytes, status: int, code: str
) -> None:
    e = refused(admission, raw)
    assert (e.status, e.code) == (status, code), e.message


def test_chat_is_encoded_through_the_template(admission: Admission) -> None:
    chat = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    prep = admission.admit("chat", "b", chat.encode())
    bare = admission.tokenizer.encode("hello")
    assert prep.req.kind == "chat" and len(prep.prompt_ids) > len(bare)


class _ThreadsSeen:
    """The real tokenizer, recording which thread encodes each text (an observer, no stand-in)."""

    def __init__(self, real: object) -> None:
        self.real = real
        self.encodes: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def encode(self, text: str, **kw: object) -> object:
        self.encodes.append((threading.current_thread().name, len(text)))
        return self.real.encode(text, **kw)  # type: ignore[attr-defined]

    def encode_batch(self, texts: list[str], **kw: object) -> object:
        self.encodes.extend((threading.current_thread().name, len(t)) for t in texts)
        return self.real.encode_batch(texts, **kw)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_large_prompt_is_tokenized_once_in_the_pool_not_on_the_loop(
    checkpoint: Path, kind: Kind
) -> None:
    """Above INLINE_BYTES the prompt is encoded in the pool's thread; `admit` then uses those
    ids (encoded once), so nothing is tokenized on the event loop's thread."""
    tok = Tokenizer.from_dir(checkpoint)
    seen = _ThreadsSeen(tok.backend)
    tok.backend = seen  # type: ignore[assignment]
    config = ServeConfig("tiny", 4096, tok.vocab_size)
    capacity = Capacity(GateReport(4096, 4096, 1.0), 4096, False, False, 4096)
    admission = Admission(tok, config, capacity, TenantRegistry((Tenant("a", (KEY_A,)),)))
    text = "the " * (INLINE_BYTES // 4 + 10)
    obj = (
        {"prompt": text}
        if kind == "completion"
        else {"messages": [{"role": "user", "content": text}]}
    )
    raw = json.dumps({**obj, "max_tokens": 1}).encode()

    async def admit() -> tuple[Prepared, str]:
        ahead = await admission.encode_ahead(kind, raw)
        with encodings(ahead):
            return admission.admit(kind, "a", raw), threading.current_thread().name

    prep, loop_thread = asyncio.run(admit())
    threads = [name for name, _ in seen.encodes]
    assert len(threads) == 1 and threads[0] != loop_thread, seen.encodes
    assert threads[0].startswith("kvf-tokenize"), seen.encodes
    chat = [{"role": "user", "content": text}]
    expected = text if kind == "completion" else tok.apply_chat_template(chat)
    assert list(prep.prompt_ids) == tok.encode(expected)
