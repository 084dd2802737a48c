"""What a JSON body may hold at the edge, on a live loopback server.

Lone UTF-16 surrogates anywhere (prompt, chat content, /tokenize, cache_salt,
stop, a key) are a 400 naming the field, never a 500; an integer-valued number
such as 258.0 is the integer JSON Schema says it is; a prompt with more
characters than any text that fits the context is refused before it is
tokenized; a 405 lists the allowed method in `Allow`. After each case another
tenant is served and no page is held.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hardening_helpers import Live, live_server

IO_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(hardening_checkpoint: Path) -> Iterator[Live]:
    with live_server(hardening_checkpoint) as live:
        yield live


@pytest.fixture(autouse=True)
def _still_serving(server: Live) -> Iterator[None]:
    yield
    r = _post(server, "/v1/completions", b'{"prompt": "still", "max_tokens": 2}', tenant="b")
    assert r.status_code == 200, r.text
    assert server.settle() == {"prefill": 0, "decode": 0}


def _post(server: Live, path: str, raw: bytes, tenant: str | None = None) -> httpx.Response:
    headers = {**server.auth(tenant), "Content-Type": "application/json"}
    return httpx.post(server.url + path, headers=headers, content=raw, timeout=IO_TIMEOUT_S)


# Raw bodies: json.dumps would refuse to write a lone surrogate, a client's JSON need not.
SURROGATES = [
    ("/v1/completions", rb'{"prompt": "\ud800x", "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"prompt": "hi", "cache_salt": "s\udfff"}', "cache_salt"),
    ("/v1/completions", rb'{"prompt": "hi", "stop": ["ok", "\udc00"]}', "stop[1]"),
    (
        "/v1/chat/completions",
        rb'{"messages": [{"role": "user", "content": "a\ud83d"}]}',
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]}',
        "messages[0].content[0].text",
    ),
    ("/tokenize", rb'{"prompt": "\ud800"}', "prompt"),
    ("/v1/completions", rb'{"prompt": "hi", "\ud800": 1}', "\\ud800"),
]


@pytest.mark.parametrize(("path", "raw", "field"), SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    server: Live, path: str, raw: bytes, field: str
) -> None:
    r = _post(server, path, raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_unicode", error
    assert "surrogate" in error["message"], error


def test_a_surrogate_pair_is_one_character_and_served(server: Live) -> None:
    r = _post(server, "/v1/completions", rb'{"prompt": "\ud83d\ude00 ok", "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4.0, "seed": 7.0, "top_k": 5.0}'),
        ("/v1/completions", b'{"prompt": [5, 6.0, 7e0], "max_tokens": 2, "logprobs": 1.0}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"max_completion_tokens": 3.0, "stop_token_ids": [9.0]}',
        ),
        ("/detokenize", b'{"tokens": [40.0, 41]}'),
    ],
)
def test_integer_valued_numbers_are_integers(server: Live, path: str, raw: bytes) -> None:
    r = _post(server, path, raw)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"prompt": "hi", "max_tokens": 4.5}', "max_tokens"),
        (b'{"prompt": [5, 6.5], "max_tokens": 2}', "prompt"),
        (b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
    ],
)
def test_fractional_or_infinite_numbers_are_not(server: Live, raw: bytes, field: str) -> None:
    r = _post(server, "/v1/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_prompt_longer_than_any_that_fits_is_refused_untokenized(server: Live, path: str) -> None:
    limit = server.parts.config.context_length * 128 * 4  # context x longest token x folding
    raw = b'{"prompt": "' + b"a" * (limit + 1) + b'"}'
    r = _post(server, path, raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded", error
    assert f"no text over {limit} characters" in error["message"], error


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/completions", "POST"),
        ("DELETE", "/v1/chat/completions", "POST"),
        ("PUT", "/tokenize", "POST"),
        ("POST", "/v1/models", "GET"),
        ("PATCH", "/server_info", "GET"),
        ("POST", "/health", "GET"),
    ],
)
def test_a_405_lists_the_allowed_method(server: Live, method: str, path: str, allowed: str) -> None:
    r = httpx.request(method, server.url + path, headers=server.auth(), timeout=IO_TIMEOUT_S)
    assert r.status_code == 405 and r.headers.get("allow") == allowed, (r.headers, r.text)
    assert allowed in r.json()["error"]["message"]


def test_tokenize_counts_a_text_over_the_context(server: Live) -> None:
    """The character bound is the only one /tokenize applies: it counts, it does not refuse."""
    ctx = server.parts.config.context_length
    r = _post(server, "/tokenize", b'{"prompt": "' + b"ab " * (2 * ctx) + b'"}')
    assert r.status_code == 200 and r.json()["count"] > ctx, r.text[:300]
