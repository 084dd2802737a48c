"""The HTTP app: OpenAI-compatible routes, tokenize/detokenize, health, metrics, server_info,
version.

`create_app` runs the capacity gate on the backend's live pools (I4) and raises
`CapacityGateError` when the server must not start. The caller owns the
backend's lifecycle (start before, stop after). Every route except /health
and /version requires a tenant key unless the server runs in the explicit no-auth dev mode.

A Starlette app: every route reads its own request (body limits, strict fields,
kvfence's own OpenAPI document), so nothing here needs FastAPI's parameter
models, whose import (pydantic schemas built for its OpenAPI classes) was
about a tenth of a server's start-up (bench/serve_ready.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.engine.backend import Backend
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve import protocol
from kvfence.serve.admission import Admission
from kvfence.serve.body import read_body
from kvfence.serve.config import Capacity, ServeConfig, decide_capacity
from kvfence.serve.engine_metrics import LoadCollector, RequestTimes
from kvfence.serve.errors import INTERNAL_ERROR, ApiError
from kvfence.serve.fields import load_json
from kvfence.serve.info import server_info, tenant_view
from kvfence.serve.metrics import RouterCounters, make_registry, render
from kvfence.serve.openapi import build_openapi
from kvfence.serve.request_log import RequestLatency
from kvfence.serve.router import Router
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.version import version_response

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Endpoint = Callable[[Request], Awaitable[Response]]


def route(path: str, endpoint: Endpoint, method: str) -> Route:
    """A route answering `method` only: any other method is a 405 (Starlette would add HEAD
    to a GET route; the API never served HEAD)."""
    r = Route(path, endpoint, methods=[method])
    r.methods = {method}
    return r


def json_route(path: str, endpoint: Callable[[Request], Awaitable[Any]], method: str) -> Route:
    """A route whose endpoint returns a JSON-able value, answered as 200 JSON."""

    async def answer(request: Request) -> Response:
        return JSONResponse(await endpoint(request))

    return route(path, answer, method)


class _StatusCounter:
    """Pure ASGI middleware: count every response status (streaming responses included)."""

    def __init__(self, app: ASGIApp, counters: RouterCounters) -> None:
        self.app = app
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counters.statuses[str(message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    config: ServeConfig,
    tenants: TenantRegistry,
    *,
    capacity: Capacity | None = None,
    request_log: Path | None = None,
    router_type: type[Router] = Router,
) -> Starlette:
    """Build the server. Raises `CapacityGateError` if the pools cannot hold the context (I4)."""
    if capacity is None:
        capacity = decide_capacity(config, backend.stats().pools)
    counters = RouterCounters()
    admission = Admission(tokenizer, config, capacity, tenants)
    registry = make_registry(
        counters,
        backend.stats,
        max_total_num_tokens=capacity.max_total_num_tokens,
        context_length=config.context_length,
    )
    latency = RequestLatency(registry, config.context_length, request_log)
    times = RequestTimes(registry, config.model_name)
    router = router_type(backend, admission, config, counters, latency, times)
    load = partial(times.load, router.rooms)  # the router's live rooms, read at scrape time
    registry.register(LoadCollector(config.model_name, load, backend.stats))
    operator = _Operator(backend, admission, config, capacity, tenants, router)
    app = Starlette(
        routes=[
            *_generate_routes(router, admission, config),
            *_token_routes(admission, tokenizer, config),
            *_operator_routes(operator, registry),
        ]
    )
    app.state.router = router
    app.state.admission = admission
    app.state.capacity = capacity
    app.add_middleware(_StatusCounter, counters=counters)
    _add_error_handlers(app)
    return app


def _add_error_handlers(app: Starlette) -> None:
    """Every error is an OpenAI-style envelope; nothing internal leaks in a 500."""

    async def api_error(_request: Request, e: Exception) -> Response:
        assert isinstance(e, ApiError)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        return JSONResponse(e.body(), status_code=e.status, headers={**headers, **e.headers})

    async def internal(_request: Request, _e: Exception) -> Response:
        return JSONResponse(INTERNAL_ERROR.body(), status_code=500)

    async def not_found(request: Request, _e: Exception) -> Response:
        err = ApiError(404, f"no route {request.url.path}", code="not_found")
        return JSONResponse(err.body(), status_code=404)

    async def bad_method(request: Request, e: Exception) -> Response:
        # RFC 9110: a 405 lists the methods the route does serve (Starlette's routing puts
        # them on the exception; every route here answers exactly one).
        allow = getattr(e, "headers", None) or {}
        methods = allow.get("Allow", "")
        err = ApiError(
            405,
            f"{request.method} is not allowed on {request.url.path}; allowed: {methods}",
            code="method_not_allowed",
        )
        return JSONResponse(err.body(), status_code=405, headers={"Allow": methods})

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, internal)
    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, bad_method)


def _generate_routes(router: Router, admission: Admission, config: ServeConfig) -> list[Route]:
    async def health(_request: Request) -> Response:
        # Unauthenticated, so the reason is the backend's own words (no request's content).
        why = router.backend.health()
        if why is None:
            return Response(status_code=200)
        err = ApiError(503, f"the engine cannot serve: {why}", type="server_error",
                       code="engine_unavailable")  # fmt: skip
        return JSONResponse(err.body(), status_code=503)

    async def completions(request: Request) -> Response:
        return await router.generate(request, "completion")

    async def chat(request: Request) -> Response:
        return await router.generate(request, "chat")

    async def models(request: Request) -> dict[str, Any]:
        admission.authenticate(request.headers.get("authorization"))
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvfence",
                    "max_model_len": config.context_length,
                }
            ],
        }

    return [
        route("/health", health, "GET"),
        route("/version", version_response, "GET"),
        route("/v1/completions", completions, "POST"),
        route("/v1/chat/completions", chat, "POST"),
        json_route("/v1/models", models, "GET"),
    ]


def _token_routes(admission: Admission, tokenizer: Tokenizer, config: ServeConfig) -> list[Route]:
    async def tokenize(request: Request) -> dict[str, Any]:
        admission.authenticate(request.headers.get("authorization"))
        raw = await read_body(request, admission.body_limit, config.body_timeout_s)
        obj = load_json(raw)
        admission.check_model(model_of(obj))
        prompt, messages = protocol.parse_tokenize(obj)

        def encode() -> list[int]:
            if prompt is not None:
                return list(admission.encode_text(prompt, "prompt", whole=True))
            return admission.encode_chat(messages or (), whole=True)

        ids = await admission.pool.run(len(raw), encode)  # large ones off the loop
        return {"count": len(ids), "max_model_len": config.context_length, "tokens": ids}

    async def detokenize(request: Request) -> dict[str, Any]:
        admission.authenticate(request.headers.get("authorization"))
        obj = await json_body(request, admission)
        ids = protocol.parse_detokenize(obj)
        admission.check_model(model_of(obj))
        admission.check_ids(ids, "tokens")
        return {"prompt": tokenizer.decode(ids)}

    return [
        json_route("/tokenize", tokenize, "POST"),
        json_route("/detokenize", detokenize, "POST"),
    ]


@dataclass(frozen=True, slots=True)
class _Operator:
    """What /server_info reads: the operator sees every tenant, a tenant only itself."""

    backend: Backend
    admission: Admission
    config: ServeConfig
    capacity: Capacity
    tenants: TenantRegistry
    router: Router

    def info(self, authorization: str | None) -> dict[str, Any]:
        tenant = self.admission.viewer(authorization)
        stats = self.backend.stats()
        if tenant is None:  # the operator: every tenant's limits and usage (operator data)
            every = {"tenants": self.admission.limits.report_all()}
            return server_info(self.config, self.capacity, stats, self.tenants.auth, every)
        own = self.admission.limits.report(tenant)
        full = server_info(self.config, self.capacity, stats, self.tenants.auth, own)
        return tenant_view(full, tenant, sum(t == tenant for t in self.router.rooms.values()))


def _operator_routes(operator: _Operator, registry: CollectorRegistry) -> list[Route]:
    admission = operator.admission

    async def metrics(request: Request) -> Response:
        admission.authorize_operator(request.headers.get("authorization"), "/metrics")
        return Response(render(registry), media_type=PROMETHEUS_TYPE)

    async def info(request: Request) -> dict[str, Any]:
        return operator.info(request.headers.get("authorization"))

    schema = build_openapi(operator.config, operator.capacity)

    async def openapi(request: Request) -> dict[str, Any]:
        admission.authenticate(request.headers.get("authorization"))
        return schema

    return [
        route("/metrics", metrics, "GET"),
        json_route("/openapi.json", openapi, "GET"),
        json_route("/server_info", info, "GET"),
        json_route("/get_server_info", info, "GET"),
    ]


async def json_body(request: Request, admission: Admission) -> dict[str, Any]:
    """The body as a JSON object, within the admission's size limit (413 above it)."""
    return load_json(
        await read_body(request, admission.body_limit, admission.config.body_timeout_s)
    )


def model_of(obj: dict[str, Any]) -> str | None:
    return obj.get("model") if isinstance(obj.get("model"), str) else None
