"""The router's door into a worker: a path prefix that carries the router credential.

sglang-router 0.3.2 forwards only `Authorization` (the tenant's key) and
`X-Request-Id` to workers, and its client-certificate option fails to start
on this build ("Failed to create HTTP client: builder error", seen live), so
the one credential it can present beside the tenant's key is its worker URL:
it keeps a URL's path prefix on every call. The operator registers each
worker with the router as `http://host:port/r/<router secret>`; requests under
that prefix are the router's (compared in constant time), and only they may
carry bootstrap fields (I9, `fields.py`). The tenant is still authenticated
from `Authorization` on every request (I10).

The router's metadata calls (`/server_info`, `/model_info` and their `/get_`
forms) carry no key; on the router's path they are answered here with the
facts the router needs (model path for its tokenizer, the PD role, the
bootstrap port, the live pool).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

VIA_ROUTER = "kvfence.via_router"  # the scope key the request path reads
PREFIX = "/r/"
ROUTER_FACTS_PATHS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info")


def router_url(base: str, secret: str) -> str:
    """The worker URL to give the router (`--prefill URL PORT`, `--decode URL`)."""
    return f"{base.rstrip('/')}{PREFIX}{secret}"


class RouterGate:
    """Pure ASGI: strip and check the router's prefix, mark the scope, answer its metadata calls."""

    def __init__(self, app: ASGIApp, secret: str, facts: Callable[[], dict[str, Any]]) -> None:
        if len(secret) < 16:
            raise ValueError("the router secret must be at least 16 characters")
        self.app = app
        self.secret = secret.encode()
        self.facts = facts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        via_router = path.startswith(PREFIX)
        if via_router:
            given, _, rest = path[len(PREFIX) :].partition("/")
            if not hmac.compare_digest(given.encode(), self.secret):
                await _json(send, 404, {"error": {"message": "not found", "code": "not_found"}})
                return
            path = "/" + rest
            no_key = not any(k == b"authorization" for k, _ in scope.get("headers", ()))
            if path in ROUTER_FACTS_PATHS and scope["method"] == "GET" and no_key:
                await _json(send, 200, self.facts())
                return
        inner = dict(scope, path=path, raw_path=path.encode())
        inner[VIA_ROUTER] = via_router
        await self.app(inner, receive, send)


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
