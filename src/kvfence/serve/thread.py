"""Run an ASGI app under uvicorn on a socket bound up front (port 0 = any free port).

Binding before uvicorn starts means the port is known and held from the start
(no race between "find a free port" and "listen"). `ServerThread` runs the
server in a background thread for tests and embedded use; `serve_forever`
runs it in the foreground with uvicorn's own Ctrl-C handling. Both bound a
request's head (`http_edge.HttpLimits`: 431 for oversized headers, 408 for
headers that do not arrive in time).
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from starlette.types import ASGIApp

from kvfence.serve.http_edge import (
    DEFAULT_HTTP_LIMITS,
    CloseUnreadBody,
    HttpLimits,
    protocol_class,
)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # accepted sockets inherit it. Without it a response's body waits behind the ACK of its
    # headers (Nagle vs the client's delayed ACK): 40 ms on every non-streamed answer.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _server(app: ASGIApp, log_level: str, limits: HttpLimits) -> uvicorn.Server:
    config = uvicorn.Config(
        CloseUnreadBody(app),
        http=protocol_class(limits),
        h11_max_incomplete_event_size=limits.header_bytes,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


def serve_forever(
    app: ASGIApp,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    limits: HttpLimits = DEFAULT_HTTP_LIMITS,
) -> None:
    """Serve until Ctrl-C / SIGTERM (uvicorn finishes in-flight responses, then returns)."""
    try:
        _server(app, log_level, limits).run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn re-raises the captured SIGINT after its graceful shutdown; that is the
        # normal way to stop a foreground server, not an error.
        return


class ServerThread:
    """`with ServerThread(app) as srv: httpx.get(srv.url + "/health")`."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: HttpLimits = DEFAULT_HTTP_LIMITS,
    ) -> None:
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = _server(app, log_level, limits)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
