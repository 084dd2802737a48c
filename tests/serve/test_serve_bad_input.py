"""Bad input: HTTP 400 with an OpenAI-style body naming the field and the limit; nothing submitted.

"Nothing submitted" is read from the engine itself: its prompt-token counter
(`kvfence_prompt_tokens_total`, counted at submit) does not move, and neither
does any pool page. Other tenants' requests in flight are unaffected.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import openai
import pytest
from serve_helpers import Served

TOO_LONG = list(range(1, 101)) * 41  # 4100 ids > context 4096

# (endpoint, body, param, code, fragment the message must contain)
CASES: list[tuple[str, Any, str | None, str, str]] = [
    ("completions", b'{"prompt": ', None, "invalid_json", "not valid JSON"),
    ("completions", b'{"prompt": "\xff\xfe"}', None, "invalid_utf8", "UTF-8"),
    ("completions", b"[1, 2]", None, "invalid_json", "JSON object"),
    ("completions", b"", None, "invalid_json", "empty"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', None, "invalid_json", "NaN"),
    ("completions", {"prompt": ""}, "prompt", "empty_prompt", "empty"),
    ("completions", {"prompt": []}, "prompt", "empty_prompt", "empty"),
    ("completions", {"max_tokens": 3}, "prompt", "missing_required_parameter", "required"),
    ("completions", {"prompt": ["a", "b"]}, "prompt", "unsupported_parameter", "batched"),
    ("completions", {"prompt": TOO_LONG}, "prompt", "context_length_exceeded", "4096"),
    ("completions", {"prompt": [1] * 100, "max_tokens": 4000}, "max_tokens", "context_length_exceeded", "4100 exceeds"),
    ("completions", {"prompt": [1] * 4096}, "prompt", "context_length_exceeded", "4097 exceeds"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value", ">= 1"),
    ("completions", {"prompt": "x", "max_tokens": -5}, "max_tokens", "invalid_value", ">= 1"),
    ("completions", {"prompt": "x", "max_tokens": 10**12}, "max_tokens", "context_length_exceeded", "4096"),
    ("completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens", "invalid_value", "integer"),
    ("completions", {"prompt": "x", "n": 2}, "n", "unsupported_parameter", "only 1"),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter", "best_of"),
    ("completions", {"prompt": "x", "echo": True}, "echo", "unsupported_parameter", "echo"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter", "suffix"),
    ("completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter", "0.0"),
    ("completions", {"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter", "logit_bias"),
    ("completions", {"prompt": "x", "foo": 1}, "foo", "unknown_parameter", "unknown field `foo`"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature", "invalid_value", "[0, 2]"),
    ("completions", {"prompt": "x", "temperature": 2.5}, "temperature", "invalid_value", "[0, 2]"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "invalid_value", "(0, 1]"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p", "invalid_value", "(0, 1]"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k", "invalid_value", "must be [-1, "),
    ("completions", {"prompt": "x", "seed": -1}, "seed", "invalid_value", "seed"),
    ("completions", {"prompt": [5, 512]}, "prompt", "token_out_of_vocab", "[0, 512)"),
    ("completions", {"prompt": [-1]}, "prompt", "token_out_of_vocab", "[0, 512)"),
    ("completions", {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids", "token_out_of_vocab", "512"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "invalid_value", "[0, 20]"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop", "invalid_value", "1 to 256"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value", "stream"),
    ("completions", {"prompt": "x", "cache_salt": ""}, "cache_salt", "invalid_value", "non-empty"),
    ("chat", {"messages": []}, "messages", "empty_prompt", "empty"),
    ("chat", {"max_tokens": 2}, "messages", "missing_required_parameter", "required"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid_value", "user"),
    ("chat", {"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name", "unsupported_parameter", "role and content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content", "unsupported_parameter", "text"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "invalid_value", "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "unsupported_parameter", "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 5000}]}, "messages", "context_length_exceeded", "4096"),
]  # fmt: skip


def _send(s: Served, endpoint: str, body: Any) -> tuple[int, dict[str, Any]]:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    if isinstance(body, bytes):
        r = s.post(path, content=body)
    else:
        r = s.post(path, json={"model": s.model, **body})
    return r.status_code, r.json()


def test_each_bad_input_is_refused_before_the_engine(mirror: Served) -> None:
    # A long request from another tenant is in flight the whole time (other requests unaffected).
    prompt = "in-flight canary 0c1d " * 30
    n = len(mirror.post("/tokenize", tenant="b", json={"prompt": prompt}).json()["tokens"])
    pieces: list[str] = []
    streaming = threading.Event()

    def long_request() -> None:
        chunks = mirror.client("b").completions.create(
            model=mirror.model, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        for c in chunks:
            pieces.extend(ch.text for ch in c.choices)
            streaming.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert streaming.wait(60)  # admitted and counted by the engine before we start
    before = mirror.metrics()
    for endpoint, body, param, code, fragment in CASES:
        status, err = _send(mirror, endpoint, body)
        where = f"{endpoint} {body!r:.80}"
        assert status == 400, where
        assert set(err) == {"error"}, where
        e = err["error"]
        assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", param, code), (
            where,
            e,
        )
        assert fragment in e["message"], (where, e["message"])
    after = mirror.metrics()
    worker.join()
    assert "".join(pieces) == prompt
    # The engine counts prompt tokens at submit: none of the bad requests reached it.
    assert after["kvfence_prompt_tokens_total"] == before["kvfence_prompt_tokens_total"]
    assert after["kvfence_requests_total{outcome=rejected}"] == (
        before["kvfence_requests_total{outcome=rejected}"] + len(CASES)
    )
    assert mirror.wait_idle() == {"prefill": 0, "decode": 0}


def test_bad_input_maps_to_bad_request_error_and_nothing_runs(mirror: Served) -> None:
    client = mirror.client("c")
    before = mirror.metrics()
    pages = mirror.pages()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=mirror.model, prompt="x" * 10, max_tokens=5000)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert "max_req_input_len" in e.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=mirror.model, messages=[{"role": "user", "content": "x"}], n=3
        )
    with pytest.raises(openai.BadRequestError):  # streaming requests are refused the same way
        client.completions.create(model=mirror.model, prompt="", max_tokens=1, stream=True)
    assert mirror.pages() == pages
    after = mirror.metrics()
    assert after["kvfence_prompt_tokens_total"] == before["kvfence_prompt_tokens_total"]
    assert after["kvfence_rejections_total{reason=context_length_exceeded}"] >= 1
    # And the next good request works.
    ok = client.completions.create(model=mirror.model, prompt="still fine", max_tokens=3)
    assert ok.choices[0].text and "still fine".startswith(ok.choices[0].text)


def test_json_error_bodies_are_json(mirror: Served) -> None:
    r = mirror.post("/v1/completions", content=b"\x00\x01")
    assert r.status_code == 400
    assert json.loads(r.text)["error"]["code"] == "invalid_json"
