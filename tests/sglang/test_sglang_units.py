"""The router's fields and the router's door, without a model or a process (fast)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvfence.serve.errors import ApiError
from kvfence.sglang_stack.fields import BOOTSTRAP_FIELDS, split_router_fields
from kvfence.sglang_stack.gate import VIA_ROUTER, RouterGate

SECRET = "0123456789abcdef0123456789abcdef"
ROUTED = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9000, "bootstrap_room": 2**63 - 1}
# What sglang-router 0.3.2 writes into a /v1/completions body (seen live).
ROUTER_COMPLETION = {
    "model": "m", "prompt": "hi", "max_tokens": 3, "stream": False, "echo": False,
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False, **ROUTED,
}  # fmt: skip


def _refused(obj: dict[str, Any], via_router: bool, kind: str = "completion") -> ApiError:
    with pytest.raises(ApiError) as e:
        split_router_fields(obj, kind, via_router)  # type: ignore[arg-type]
    assert e.value.status == 400
    return e.value


def test_the_routers_body_splits_into_kvfences_fields_and_the_room() -> None:
    rest, binding = split_router_fields(dict(ROUTER_COMPLETION), "completion", True)
    assert binding is not None
    assert (binding.room, binding.peer) == (str(2**63 - 1), "tcp://127.0.0.1:9000")
    assert set(rest) == {"model", "prompt", "max_tokens", "stream", "ignore_eos"}


@pytest.mark.parametrize("name", BOOTSTRAP_FIELDS)
def test_a_tenant_never_sets_a_bootstrap_field(name: str) -> None:
    e = _refused({"prompt": "hi", name: ROUTED[name]}, via_router=False)
    assert e.param == name and "I9" in e.message


def test_rid_is_refused_on_every_path() -> None:
    for via in (False, True):
        assert _refused({**ROUTED, "prompt": "hi", "rid": "r1"}, via).param == "rid"


def test_a_non_default_sglang_option_is_refused_not_ignored() -> None:
    e = _refused({**ROUTER_COMPLETION, "no_stop_trim": True}, via_router=True)
    assert e.param == "no_stop_trim" and "not supported" in e.message
    chat = {"messages": [], **ROUTED, "separate_reasoning": False}
    assert _refused(chat, True, "chat").param == "separate_reasoning"


@pytest.mark.parametrize(
    "field,value",
    [("bootstrap_room", -1), ("bootstrap_room", 2**63), ("bootstrap_room", True),
     ("bootstrap_port", 0), ("bootstrap_port", "9000"), ("bootstrap_host", "a b"),
     ("bootstrap_host", "")],
)  # fmt: skip
def test_the_routers_fields_are_validated(field: str, value: Any) -> None:
    assert _refused({**ROUTER_COMPLETION, field: value}, via_router=True).param == field


def _gated() -> TestClient:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"path": request.url.path, "via": request.scope[VIA_ROUTER]})

    app = Starlette(routes=[Route("/{p:path}", echo, methods=["GET", "POST"])])
    return TestClient(RouterGate(app, SECRET, lambda: {"engine": "kvfence", "facts": True}))


def test_the_router_is_admitted_by_its_path_credential_only() -> None:
    c = _gated()
    assert c.post(f"/r/{SECRET}/v1/completions").json() == {"path": "/v1/completions", "via": True}
    assert c.post("/v1/completions").json() == {"path": "/v1/completions", "via": False}
    assert c.post(f"/r/{SECRET[:-1]}x/v1/completions").status_code == 404
    assert c.post("/r/v1/completions").status_code == 404


def test_the_routers_metadata_calls_get_the_routers_facts() -> None:
    c = _gated()
    assert c.get(f"/r/{SECRET}/server_info").json() == {"engine": "kvfence", "facts": True}
    assert c.get(f"/r/{SECRET}/get_model_info").json()["facts"] is True
    keyed = c.get(f"/r/{SECRET}/server_info", headers={"Authorization": "Bearer k"})
    assert keyed.json() == {"path": "/server_info", "via": True}  # kvfence's own, with the key
    assert c.get("/server_info").json()["via"] is False
