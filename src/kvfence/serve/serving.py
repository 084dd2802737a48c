"""The start-up sequence every serving process runs once it has built its backend.

    start -> (ready) -> capacity gate (I4) -> app -> bind -> announce -> serve -> stop

The backend is whatever runs the model behind the HTTP edge: the in-process pipeline
(`kvfence serve`), the hub's router over worker processes (`--role router`), or one half
of a pair behind sglang-router. Each entry point builds it and calls `run_server`; the
order and the refusals are therefore the same everywhere:

- nothing listens before the live pools pass the gate: a failing gate prints its message
  on stderr and the process ends with `EXIT_GATE`, unbound;
- the announcement comes once the socket is bound, so the URL it prints is the real one;
- the backend is stopped on every way out (the gate's included): its threads, sockets
  and shared segments go with the process, never after it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.types import ASGIApp

from kvfence.engine.backend import Backend
from kvfence.engine.sizing import CapacityGateError, GateReport
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.config import EXIT_GATE, Capacity, ServeConfig, decide_capacity
from kvfence.serve.router import Router
from kvfence.serve.startup import collector_paused
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import bind, serve_forever, url_of

# What the process prints once it listens, given the bound URL and the gate's decision.
Announce = Callable[[str, Capacity], None]
# The app as it listens: the built API, wrapped or extended (an SGLang worker adds the
# native route and the router's path gate in front).
Expose = Callable[[Starlette, Capacity], ASGIApp]
# One more line after a failing gate: how to size the pool so that it passes.
GateHint = Callable[[GateReport], str]


@dataclass(frozen=True, slots=True)
class Listen:
    """Where the API listens, and how much uvicorn logs."""

    host: str
    port: int
    log_level: str = "warning"


@dataclass(frozen=True, slots=True)
class Server:
    """What an entry point built: the backend, and what the HTTP edge needs over it."""

    backend: Backend
    tokenizer: Tokenizer
    config: ServeConfig
    tenants: TenantRegistry
    request_log: Path | None = None
    router_type: type[Router] = Router


def _expose_as_built(app: Starlette, capacity: Capacity) -> ASGIApp:
    return app


def _no_wait() -> None:
    """A backend whose pools are live once started (in this process)."""


def run_server(
    server: Server,
    listen: Listen,
    announce: Announce,
    *,
    ready: Callable[[], None] = _no_wait,
    expose: Expose = _expose_as_built,
    gate_hint: GateHint | None = None,
) -> int:
    """Serve until stopped (0), or `EXIT_GATE` when the live pools fail the gate (I4).

    `ready` blocks until the started backend can report its live pools (the hub's router
    waits for every worker's first status): the gate is decided on those, never on a
    configured size.
    """
    backend = server.backend
    backend.start()
    try:
        ready()
        with collector_paused():  # the web stack's objects live as long as the process
            capacity = _gate(server.config, backend, gate_hint)
            if capacity is None:
                return EXIT_GATE
            app = create_app(
                backend,
                server.tokenizer,
                server.config,
                server.tenants,
                capacity=capacity,
                request_log=server.request_log,
                router_type=server.router_type,
            )
            served = expose(app, capacity)
            sock = bind(listen.host, listen.port)
        try:
            announce(url_of(sock), capacity)
            serve_forever(served, sock, log_level=listen.log_level)
        finally:
            sock.close()
        return 0
    finally:
        backend.stop()


def _gate(config: ServeConfig, backend: Backend, hint: GateHint | None) -> Capacity | None:
    """The capacity decision on the live pools; None (and why, on stderr) if it fails (I4)."""
    try:
        return decide_capacity(config, backend.stats().pools)
    except CapacityGateError as e:
        print(str(e), file=sys.stderr)  # I4: this process takes no traffic
        if hint is not None:
            print(hint(e.report), file=sys.stderr)
        sys.stderr.flush()
        return None
