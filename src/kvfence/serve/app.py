"""The FastAPI app: OpenAI-compatible routes, tokenize/detokenize, health, metrics, server_info.

`create_app` runs the capacity gate on the backend's live pools (I4) and raises
`CapacityGateError` when the server must not start. The caller owns the
backend's lifecycle (start before, stop after). Every route except /health
requires a tenant key unless the server runs in the explicit no-auth dev mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.engine.backend import Backend
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve import protocol
from kvfence.serve.admission import Admission
from kvfence.serve.body import read_body
from kvfence.serve.config import Capacity, ServeConfig, decide_capacity
from kvfence.serve.errors import INTERNAL_ERROR, ApiError
from kvfence.serve.fields import load_json
from kvfence.serve.info import server_info, tenant_view
from kvfence.serve.metrics import RouterCounters, make_registry, render
from kvfence.serve.openapi import build_openapi
from kvfence.serve.request_log import RequestLatency
from kvfence.serve.router import Router
from kvfence.serve.tenants import TenantRegistry

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
) -> FastAPI:
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
    router = router_type(backend, admission, config, counters, latency)
    app = FastAPI(title="kvfence", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.state.admission = admission
    app.state.capacity = capacity
    app.add_middleware(_StatusCounter, counters=counters)
    _add_error_handlers(app)
    app.include_router(_generate_routes(router, admission, config))
    app.include_router(_token_routes(admission, tokenizer, config))
    operator = _Operator(backend, admission, config, capacity, tenants, router)
    app.include_router(_operator_routes(operator, registry))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is an OpenAI-style envelope; nothing internal leaks in a 500."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        return JSONResponse(e.body(), status_code=e.status, headers={**headers, **e.headers})

    @app.exception_handler(Exception)
    async def internal(_request: Request, _e: Exception) -> Response:
        return JSONResponse(INTERNAL_ERROR.body(), status_code=500)

    @app.exception_handler(404)
    async def not_found(request: Request, _e: Exception) -> Response:
        err = ApiError(404, f"no route {request.url.path}", code="not_found")
        return JSONResponse(err.body(), status_code=404)

    @app.exception_handler(405)
    async def bad_method(request: Request, _e: Exception) -> Response:
        err = ApiError(405, f"{request.method} is not allowed on {request.url.path}")
        return JSONResponse(err.body(), status_code=405)


def _generate_routes(router: Router, admission: Admission, config: ServeConfig) -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.generate(request, "completion")

    @routes.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.generate(request, "chat")

    @routes.get("/v1/models")
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

    return routes


def _token_routes(admission: Admission, tokenizer: Tokenizer, config: ServeConfig) -> APIRouter:
    routes = APIRouter()

    @routes.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        admission.authenticate(request.headers.get("authorization"))
        obj = await json_body(request, admission)
        admission.check_model(model_of(obj))
        prompt, messages = protocol.parse_tokenize(obj)
        ids = (
            tokenizer.encode(prompt)
            if prompt is not None
            else admission.encode_chat(messages or ())
        )
        return {"count": len(ids), "max_model_len": config.context_length, "tokens": ids}

    @routes.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        admission.authenticate(request.headers.get("authorization"))
        obj = await json_body(request, admission)
        ids = protocol.parse_detokenize(obj)
        admission.check_model(model_of(obj))
        admission.check_ids(ids, "tokens")
        return {"prompt": tokenizer.decode(ids)}

    return routes


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


def _operator_routes(operator: _Operator, registry: CollectorRegistry) -> APIRouter:
    routes = APIRouter()
    admission = operator.admission

    @routes.get("/metrics")
    async def metrics(request: Request) -> Response:
        admission.authorize_operator(request.headers.get("authorization"), "/metrics")
        return Response(render(registry), media_type=PROMETHEUS_TYPE)

    async def info(request: Request) -> dict[str, Any]:
        return operator.info(request.headers.get("authorization"))

    schema = build_openapi(operator.config, operator.capacity)

    @routes.get("/openapi.json")
    async def openapi(request: Request) -> dict[str, Any]:
        admission.authenticate(request.headers.get("authorization"))
        return schema

    routes.add_api_route("/server_info", info, methods=["GET"])
    routes.add_api_route("/get_server_info", info, methods=["GET"])
    return routes


async def json_body(request: Request, admission: Admission) -> dict[str, Any]:
    """The body as a JSON object, within the admission's size limit (413 above it)."""
    return load_json(
        await read_body(request, admission.body_limit, admission.config.body_timeout_s)
    )


def model_of(obj: dict[str, Any]) -> str | None:
    return obj.get("model") if isinstance(obj.get("model"), str) else None
