"""The public address of `kvfence serve --disaggregated`: tenant routes only (the edge).

sglang-router serves its control plane on its inference port; the stack binds it on a
private loopback port and puts kvfence's edge on the public one. Through the public URL,
no key, a tenant key and even the operator key cannot list, add or remove a worker, and no
answer carries the router credential; the control plane answers only at `admin_url` with
the operator key. The edge authenticates (401, not the router's 500), parses bodies before
the router re-serialises them (`rid`, a temperature of 1e308), serves the routes the router
does not, and ends a stream cut by a killed decode worker with an error event and [DONE].
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sgl_helpers import OPERATOR_KEY, Fleet, fleet

pytestmark = pytest.mark.slow

ADMIN_PROBES: tuple[tuple[str, str, dict[str, Any] | None], ...] = (
    ("GET", "/workers", None),
    ("GET", "/get_loads", None),
    ("POST", "/workers", {"url": "http://127.0.0.1:9", "worker_type": "decode"}),
    ("POST", "/add_worker?url=http://127.0.0.1:9", None),
    ("POST", "/remove_worker?url=http://127.0.0.1:9", None),
    ("POST", "/flush_cache", None),
    ("GET", "/list_workers", None),
)


@pytest.fixture(scope="module")
def stack(sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(sgl_checkpoint, tmp_path_factory.mktemp("edge")) as f:
        yield f


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _admin_listing(f: Fleet) -> list[dict[str, Any]]:
    r = httpx.get(f"{f.stack.admin_url}/workers", headers=_bearer(OPERATOR_KEY), timeout=10)
    assert r.status_code == 200, r.text
    return list(r.json()["workers"])


def _complete(
    f: Fleet, key: str | None, extra: dict[str, Any], path: str = "/v1/completions"
) -> httpx.Response:
    body: dict[str, Any] = {"model": f.model, "prompt": "edge check", "max_tokens": 2}
    if path == "/v1/chat/completions":
        body = {"model": f.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    elif path == "/generate":
        body = {"text": "edge check", "sampling_params": {"max_new_tokens": 2}}
    return httpx.post(f"{f.url}{path}", headers=_bearer(key), json={**body, **extra}, timeout=60)


def test_the_public_address_cannot_list_add_or_remove_a_worker(stack: Fleet) -> None:
    before = _admin_listing(stack)
    assert len(before) == len(stack.stack.workers)
    ids = [str(w.get("id") or w.get("worker_id")) for w in before]
    probes = [*ADMIN_PROBES, *(("DELETE", f"/workers/{i}", None) for i in ids)]
    probes += [("GET", f"/workers/{i}", None) for i in ids]
    keys = {"no key": None, "tenant key": stack.keys["tenant-a"], "operator key": OPERATOR_KEY}
    seen = []
    for who, key in keys.items():
        for method, path, body in probes:
            r = httpx.request(
                method, f"{stack.url}{path}", headers=_bearer(key), json=body, timeout=30
            )
            seen.append((who, method, path, r.status_code))
            assert r.status_code in (404, 405), (who, method, path, r.status_code, r.text)
            assert stack.stack.secret not in r.text and "/r/" not in r.text, (who, path)
            assert "error" in r.json(), r.text
    after = _admin_listing(stack)
    assert sorted(w["url"] for w in after) == sorted(w["url"] for w in before), (seen, after)
    # Every tenant is still served: nothing was removed.
    assert _complete(stack, stack.keys["tenant-b"], {}).status_code == 200


def test_the_router_control_plane_wants_the_operator_key(stack: Fleet) -> None:
    """Defence in depth on the private (loopback) address: the admin role only."""
    url = f"{stack.stack.admin_url}/workers"
    assert stack.stack.admin_url.startswith("http://127.0.0.1:")
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers=_bearer(stack.keys["tenant-a"]), timeout=10).status_code == 401
    assert OPERATOR_KEY in stack.stack.admin_keys  # one operator credential for the stack
    added = httpx.post(url, json={"url": "http://127.0.0.1:9", "worker_type": "decode"}, timeout=10)
    assert added.status_code == 401, added.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_a_bad_key_is_a_401_on_every_generation_route(stack: Fleet, path: str) -> None:
    for key in (None, "sk-not-a-key", "sk-operator-not-it"):
        r = _complete(stack, key, {}, path)
        assert r.status_code == 401, (path, key, r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers.get("www-authenticate") == "Bearer"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_a_client_rid_is_refused_on_every_generation_route(stack: Fleet, path: str) -> None:
    r = _complete(stack, stack.keys["tenant-a"], {"rid": "mine"}, path)
    assert r.status_code == 400, (path, r.status_code, r.text)
    assert r.json()["error"]["param"] == "rid", r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_temperature_the_router_would_narrow_is_a_400(stack: Fleet, path: str) -> None:
    r = _complete(stack, stack.keys["tenant-a"], {"temperature": 1e308}, path)
    assert r.status_code == 400, (path, r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == "temperature" and "2" in err["message"], err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_without_a_model_is_served_as_at_a_single_server(stack: Fleet, path: str) -> None:
    """The router refuses a completion without `model` (422) and sends a chat on as "unknown"."""
    r = _complete(stack, stack.keys["tenant-a"], {}, path)
    body = json.loads(r.request.content)
    del body["model"]
    r = httpx.post(f"{stack.url}{path}", headers=_bearer(stack.keys["tenant-a"]), json=body)
    assert r.status_code == 200 and r.json()["model"] == stack.model, (path, r.text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_null_fields_are_served_as_absent_as_at_a_single_server(stack: Fleet, path: str) -> None:
    """The router's types refuse a null where they want a value (`echo`, `n`: 422)."""
    nulls = {"echo": None, "n": None, "seed": None, "stop": None, "logit_bias": None}
    r = _complete(stack, stack.keys["tenant-a"], nulls, path)
    assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_values_the_router_would_refuse_are_sent_as_their_equivalents(
    stack: Fleet, path: str
) -> None:
    """top_p 5e-324 is 0 in the router's f32 and top_k 0 ("off") is refused on its chat."""
    r = _complete(stack, stack.keys["tenant-a"], {"top_p": 5e-324, "top_k": 0}, path)
    assert r.status_code == 200, (path, r.text)


def test_an_empty_message_the_router_refuses_is_a_400_with_its_code(stack: Fleet) -> None:
    """sglang-router refuses empty message content; the schema lists `messages:empty_content`."""
    empty = {"messages": [{"role": "user", "content": ""}]}
    r = _complete(stack, stack.keys["tenant-a"], empty, "/v1/chat/completions")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages", r.text
    assert err["code"] == "empty_content", r.text


def test_an_answer_with_logprobs_is_json(stack: Fleet) -> None:
    """The router labels it application/octet-stream."""
    r = _complete(stack, stack.keys["tenant-a"], {"logprobs": 1})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.headers
    assert r.json()["choices"][0]["logprobs"]["tokens"], r.text


def test_token_ids_on_completions_are_a_400_naming_the_prompt(stack: Fleet) -> None:
    """sglang-router 0.3.2 cannot take them on /v1/completions (its own 422 otherwise)."""
    r = _complete(stack, stack.keys["tenant-a"], {"prompt": [17, 18, 19]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "input_ids" in r.text, r.text


def test_the_routes_the_router_does_not_serve(stack: Fleet) -> None:
    key_a = _bearer(stack.keys["tenant-a"])
    u = stack.url
    for method, path in [("GET", "/v1/models"), ("GET", "/get_server_info"),
                         ("GET", "/openapi.json"), ("GET", "/server_info")]:  # fmt: skip
        assert httpx.request(method, u + path, timeout=30).status_code == 401, path
        r = httpx.request(method, u + path, headers=key_a, timeout=30)
        assert r.status_code == 200, (path, r.text)
        assert stack.stack.secret not in r.text and "/r/" not in r.text, path
    models = httpx.get(f"{u}/v1/models", headers=key_a, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [stack.model]
    tok = httpx.post(f"{u}/tokenize", headers=key_a, json={"prompt": "hello"}, timeout=30)
    assert tok.status_code == 200 and tok.json()["count"] == len(stack.tokenizer.encode("hello"))
    assert httpx.post(f"{u}/tokenize", json={"prompt": "hello"}, timeout=30).status_code == 401
    assert httpx.get(f"{u}/metrics", headers=key_a, timeout=30).status_code == 403
    assert httpx.get(f"{u}/metrics", headers=_bearer(OPERATOR_KEY), timeout=30).status_code == 200
    assert httpx.get(f"{u}/health", timeout=30).status_code == 200
    wrong = httpx.get(f"{u}/v1/completions", headers=key_a, timeout=30)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", wrong.headers
    assert httpx.get(f"{u}/no/such/route", timeout=30).status_code == 404


def test_a_refused_stream_is_the_worker_s_json_error(stack: Fleet) -> None:
    """The router answers a worker's 4xx to a stream with a body that is not JSON."""
    body = {"model": stack.model, "prompt": "a long echo " * 8, "max_tokens": 400}
    r = _complete(stack, stack.keys["tenant-a"], {**body, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "336 tokens per request" in err["message"], err


def _events(r: httpx.Response, on_first: Any) -> list[str]:
    """Every `data:` line of a stream; `on_first` runs once the first chunk with text is in."""
    out: list[str] = []
    fired = False
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        out.append(line[len("data: ") :])
        if not fired and '"text"' in line:
            fired = True
            on_first()
    return out


def test_a_stream_cut_by_a_killed_decode_worker_ends_with_an_error_and_done(
    sgl_checkpoint: Path, tmp_path: Path
) -> None:
    with fleet(sgl_checkpoint, tmp_path) as f:
        decode = next(w.name for w in f.stack.workers if w.role == "decode")
        proc = f.stack.supervisor.procs[decode]
        body = {"model": f.model, "prompt": "a long echo " * 8, "max_tokens": 200}
        body |= {"temperature": 0, "ignore_eos": True, "stream": True}
        killed_at: list[float] = []

        def kill() -> None:
            proc.send_signal(signal.SIGKILL)
            killed_at.append(time.monotonic())

        headers = _bearer(f.keys["tenant-a"])
        with httpx.stream(
            "POST", f"{f.url}/v1/completions", headers=headers, json=body, timeout=120
        ) as r:
            assert r.status_code == 200, r.read()
            events = _events(r, kill)
        assert killed_at, f"the stream never carried text: {events}"
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["error"]["code"] == "stream_cut", last
        assert "incomplete" in last["error"]["message"]
        chunks = [json.loads(e) for e in events[:-2]]
        got = sum(len(c["choices"][0]["text"]) for c in chunks if c.get("choices"))
        assert all("error" not in c for c in chunks) and got > 0, events[:3]
