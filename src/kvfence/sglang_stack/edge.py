"""The tenants' address of the sglang-router stack: tenant routes only, authenticated here.

sglang-router 0.3.2 serves its control plane on the listener it serves inference on:
`/workers` (list, add, update, remove), `/get_loads`, `/flush_cache`, `/v1/tokenizers`,
`/parse/*`, `/wasm` (probed live; with `--control-plane-api-keys` set they need an admin
key, and without it they are open to anyone who can reach the port). Worker URLs carry the
router credential (gate.py), so listing them hands it out, and a registered worker receives
tenants' keys and prompts. So the stack binds the router on a private loopback port and puts
this edge on the public address. Invariants:

- Only the routes in `Edge.routes` answer here; any other path is a 404 and a known path with
  another method a 405 naming the allowed ones in `Allow`. Nothing reaches the router's
  control plane from here, whatever its own options.
- The tenant key is checked here (401) before anything is forwarded: the router answers a
  worker's 401 with a 500.
- A generation body goes through kvfence's strict parser here, on the client's own JSON,
  before the router re-serialises it (edge_body.py); the bytes forwarded are the client's,
  changed only where the router's types would read them differently.
- The router's own refusals (its 422s, its error shapes, a refused stream) reach the client
  as kvfence's error envelope, naming the field where the router's message does.
- Answers stream through as they arrive (no buffering). An event stream always ends with
  `data: [DONE]`: one the router ends without it (a worker died mid-stream: the router just
  closes) gets an error event first, as kvfence's own routers send.
- No answer carries the router credential: a body that contains it is withheld and replaced
  by an error.
- Each tenant's admission limits (limits.py) hold here for the whole stack, before anything is
  read: at its `max_concurrent` requests in flight, or with its refusal bucket empty, a
  tenant's next request is a 429 with `Retry-After` before its body is read. A refused request
  costs the router and both workers their HTTP handling and the prefill worker its
  tokenizing even when the worker refuses it at once, so without this a flood of requests the
  workers refuse slows every other tenant's requests through the same processes. The bucket
  draws on every refusal that cost work, here (a body too large or too slow) or behind the
  router (over the context or the pool, or over a worker's limits). The prompt-token bound
  needs tokens: the workers keep it.

The routes the router does not serve (`/tokenize`, `/detokenize`, `/openapi.json`,
`/v1/models`, `/server_info`, `/metrics`) are a kvfence worker's own, answered by the first
decode worker at its own URL, which authenticates them as a single server does.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvfence.serve.body import read_body
from kvfence.serve.errors import INTERNAL_ERROR, ApiError
from kvfence.serve.fields import load_json
from kvfence.serve.limits import (
    COSTLY_REFUSALS,
    LIMIT_CODE,
    OVER_LIMIT,
    REFUSED_TOO_OFTEN,
    AdmissionLimits,
    Slot,
    default_limits,
)
from kvfence.serve.responses import DONE, sse
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.version import version_response
from kvfence.sglang_stack.edge_body import Route, check, for_router
from kvfence.sglang_stack.router_errors import conform, refusal, unreadable

DONE_BYTES = DONE.strip().encode()  # b"data: [DONE]"
_RETRY_AFTER = re.compile(r"retry after (\d+) s")
REFUSAL_BYTES = 65536  # read of a refused stream before its end, at most
# Response headers that describe the router's connection, not the answer.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
)
STREAM_CUT = ApiError(
    502,
    "the stream was cut before it finished (a worker behind the router stopped); the output "
    "above is incomplete",
    type="server_error",
    code="stream_cut",
)
WITHHELD = ApiError(
    502,
    "the router's answer named an internal address and was withheld",
    type="server_error",
    code="upstream_withheld",
)


@dataclass(frozen=True, slots=True)
class EdgeSpec:
    """Where the edge forwards, and the bounds it reads bodies within."""

    router: str  # the router's private URL (loopback)
    workers: tuple[str, ...]  # every worker's own URL; the first decode worker's is `side`
    side: str  # the worker that answers the routes the router does not serve
    secret: str  # the router credential: no answer may carry it
    model: str  # the served model's name: the `model` of a body that names none
    body_limit: int  # bytes (413 above), as a worker's own limit
    pool_tokens: int  # every prefill worker's pool, in tokens: the default limits' base
    longest: int  # the longest request a worker admits (prompt + max_tokens), in tokens
    body_timeout_s: float = 60.0

    @property
    def max_total_num_tokens(self) -> int:  # `limits.PoolFacts`
        return self.pool_tokens

    @property
    def edge_limit(self) -> int:  # `limits.PoolFacts`
        return self.longest


Handler = Callable[[Request], Awaitable[ASGIApp]]


@dataclass(frozen=True, slots=True)
class EdgeRoute:
    methods: tuple[str, ...]
    handler: Handler


class Edge:
    """Pure ASGI: dispatch on the exact path, nothing else reaches the router."""

    def __init__(self, spec: EdgeSpec, tenants: TenantRegistry) -> None:
        self.spec = spec
        self.tenants = tenants
        self.secret = spec.secret.encode()
        self.limits = AdmissionLimits(tenants.limits(), default_limits(spec))
        self._client: httpx.AsyncClient | None = None
        self.routes: dict[str, EdgeRoute] = {
            "/v1/completions": EdgeRoute(("POST",), self._generation("completion")),
            "/v1/chat/completions": EdgeRoute(("POST",), self._generation("chat")),
            "/generate": EdgeRoute(("POST",), self._generation("generate")),
            "/health": EdgeRoute(("GET",), self._health),
            "/version": EdgeRoute(("GET",), version_response),  # its own; no key, as a worker's
            **{
                path: EdgeRoute((method,), self._side)
                for path, method in (
                    ("/v1/models", "GET"),
                    ("/tokenize", "POST"),
                    ("/detokenize", "POST"),
                    ("/openapi.json", "GET"),
                    ("/server_info", "GET"),
                    ("/get_server_info", "GET"),
                    ("/metrics", "GET"),
                )
            },
        }

    @property
    def client(self) -> httpx.AsyncClient:
        # Made on first use: an AsyncClient belongs to the event loop it first runs on.
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(30.0, read=None),  # a generation may think for long
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                trust_env=False,
            )
        return self._client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no websockets, and lifespan is off
        request = Request(scope, receive)
        route = self.routes.get(scope["path"])
        try:
            if route is None:
                raise ApiError(404, f"no route {scope['path']}", code="not_found")
            if scope["method"] not in route.methods:
                allow = ", ".join(route.methods)
                raise ApiError(
                    405,
                    f"{scope['method']} is not allowed on {scope['path']} (allowed: {allow})",
                    code="method_not_allowed",
                    headers={"Allow": allow},
                )
            response = await route.handler(request)
        except ApiError as e:
            response = _error(e)
        except Exception:
            response = _error(INTERNAL_ERROR)
        await response(scope, receive, send)

    # ---- routes ----------------------------------------------------------------------

    def _generation(self, kind: Route) -> Handler:
        async def handle(request: Request) -> ASGIApp:
            tenant, headers = self._tenant(request)
            slot = self.limits.acquire(tenant, 0)  # 429 before the body is read
            try:
                response = await generate(request, tenant, headers)
            except ApiError as e:
                slot.release()
                self._charge(tenant, e.code)
                raise
            except BaseException:
                slot.release()
                raise
            return Counted(response, slot)

        async def generate(request: Request, tenant: str, auth: dict[str, str]) -> Response:
            headers = {**auth, "content-type": "application/json"}
            body = await read_body(request, self.spec.body_limit, self.spec.body_timeout_s)
            obj = load_json(body)
            check(kind, obj)
            body = for_router(kind, obj, self.spec.model) or body
            upstream = self.client.build_request(
                "POST", self.spec.router + request.url.path, headers=headers, content=body
            )
            return await self._forward(upstream, tuple(obj), tenant)

        return handle

    async def _side(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        body = b""
        if request.method == "POST":
            body = await read_body(request, self.spec.body_limit, self.spec.body_timeout_s)
            headers["content-type"] = "application/json"
        upstream = self.client.build_request(
            request.method, self.spec.side + request.url.path, headers=headers, content=body
        )
        return await self._forward(upstream)

    async def _health(self, _request: Request) -> Response:
        """200 only while the router and every worker answer their own /health with 200."""
        urls = [f"{self.spec.router}/health", *(f"{w}/health" for w in self.spec.workers)]

        async def ok(url: str) -> bool:
            try:
                return (await self.client.get(url, timeout=10)).status_code == 200
            except httpx.HTTPError:
                return False

        if all(await asyncio.gather(*(ok(u) for u in urls))):
            return Response(status_code=200)
        raise ApiError(503, "a part of the stack is down or not ready", type="server_error")

    # ---- forwarding --------------------------------------------------------------------

    def _tenant(self, request: Request) -> tuple[str, dict[str, str]]:
        """The tenant, and the header that names it to forward (the workers authenticate it
        again)."""
        authorization = request.headers.get("authorization")
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            raise ApiError(
                401,
                "missing or invalid API key; send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )
        return tenant, {"authorization": authorization} if authorization is not None else {}

    def _charge(self, tenant: str, code: str | None) -> None:
        """A refusal that cost the stack work draws on the tenant's refusal bucket: one of
        the costly kinds, or a worker's limit refusal (it crossed the router and both workers
        before it was refused)."""
        if code in COSTLY_REFUSALS or code == LIMIT_CODE:
            self.limits.charge(tenant)

    async def _forward(
        self, upstream: httpx.Request, fields: Sequence[str] = (), tenant: str | None = None
    ) -> Response:
        """The router's answer; `fields` (the body's) are what a rebuilt error may name;
        `tenant`'s refusals that cost work are charged to it."""
        try:
            answer = await self.client.send(upstream, stream=True)
        except httpx.HTTPError:
            raise ApiError(
                502, "the router did not answer", type="server_error", code="upstream_unreachable"
            ) from None
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        stream = answer.headers.get("content-type", "").startswith("text/event-stream")
        if stream and answer.status_code < 400:
            return StreamingResponse(
                self._events(answer), status_code=answer.status_code, headers=headers
            )
        try:
            content = await (_first_event(answer) if stream else answer.aread())
        except httpx.HTTPError:
            raise ApiError(
                502, "the router's answer was cut", type="server_error", code="upstream_cut"
            ) from None
        finally:
            await answer.aclose()
        if self.secret in content:
            return _error(WITHHELD)
        status = answer.status_code
        if status == 422 and not stream:  # the router's own reader refused the body (text)
            return _error(unreadable(content))
        if stream or status >= 400:
            # a refusal: the client gets it as JSON, whatever it asked to stream
            envelope = refusal(content) if stream else conform(status, content, fields)
            envelope = envelope or json.loads(content)
            response = _refused(envelope, status)  # may restore the code of a limit's refusal
            if tenant is not None:
                self._charge(tenant, _code(envelope))
            return response
        if content.startswith(b"{") and not headers.get("content-type", "").endswith("json"):
            # It sends a completion with logprobs as application/octet-stream (seen live).
            headers["content-type"] = "application/json"
        return Response(content, status_code=status, headers=headers)

    async def _events(self, answer: httpx.Response) -> AsyncIterator[bytes]:
        """The router's events as they come; an end without `[DONE]` gets an error, then it."""
        tail = b""  # the last bytes seen: the marker may straddle two reads
        try:
            async for chunk in answer.aiter_raw():
                if self.secret in tail + chunk:
                    break  # withheld: the stream ends with the error below
                yield chunk
                tail = (tail + chunk)[-64:]
                if DONE_BYTES in tail:
                    return
        except httpx.HTTPError:
            pass  # the router's connection broke: said below
        finally:
            with anyio.CancelScope(shield=True):  # also when the client left (cancelled)
                await answer.aclose()
        yield sse(STREAM_CUT.body()).encode()
        yield DONE.encode()


class Counted:
    """An answer that gives its tenant's in-flight slot back once it was sent, or the client
    left: a stream holds its slot until its last event."""

    def __init__(self, response: Response, slot: Slot) -> None:
        self.response = response
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.slot.release()


def _code(envelope: Mapping[str, Any]) -> str | None:
    err = envelope.get("error")
    return cast(str | None, err.get("code")) if isinstance(err, dict) else None


async def _first_event(answer: httpx.Response) -> bytes:
    """A refused stream's one event: the router may hold the connection open after it."""
    content = b""
    async for chunk in answer.aiter_raw():
        content += chunk
        if b"\n\n" in content or len(content) > REFUSAL_BYTES:
            break
    return content


def _refused(envelope: dict[str, Any], status: int) -> Response:
    """A worker's refusal as the client must see it.

    A tenant over its admission limit is a 429 with `Retry-After` at the worker, which
    sglang-router 0.3.2 hands on as a 500 (it keeps no worker's 429): restored here from the
    refusal's own code and wait, so a client backs off instead of seeing a server error.
    """
    err = envelope.get("error")
    message = str(err.get("message", "")) if isinstance(err, dict) else ""
    if isinstance(err, dict) and (
        err.get("code") == LIMIT_CODE or message.startswith((OVER_LIMIT, REFUSED_TOO_OFTEN))
    ):
        wait = _RETRY_AFTER.search(message)
        headers = {"Retry-After": wait.group(1) if wait else "1"}
        err.update(type="rate_limit_error", code=LIMIT_CODE)
        return JSONResponse(envelope, status_code=429, headers=headers)
    return JSONResponse(envelope, status_code=status)


def _error(e: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    return JSONResponse(e.body(), status_code=e.status, headers={**headers, **e.headers})
