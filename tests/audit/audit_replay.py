"""A real loopback HTTP server that replays canned engine responses (for adapter tests).

Adapters are tested over real HTTP (httpx against a stdlib threading server),
not with mocks: the bytes they parse are the bytes an engine would send.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


@dataclass
class Route:
    status: int
    body: str
    content_type: str = "application/json"


@dataclass
class ReplayServer:
    """Serves `routes[(method, path)]`; anything else is a 404 JSON error. Records requests."""

    routes: dict[tuple[str, str], Route] = field(default_factory=dict)
    # (method, path) -> function of the parsed JSON body, for answers that depend on it
    handlers: dict[tuple[str, str], Callable[[Any], Route]] = field(default_factory=dict)
    seen: list[tuple[str, str, Any]] = field(default_factory=list)
    url: str = ""

    def json(self, path: str, obj: Any, status: int = 200, method: str = "GET") -> None:
        self.routes[(method, path)] = Route(status, json.dumps(obj))

    def file(self, path: str, name: str, method: str = "GET") -> None:
        ctype = "text/plain; version=0.0.4" if name.endswith(".txt") else "application/json"
        self.routes[(method, path)] = Route(200, fixture_text(name), ctype)


def _handler(server: ReplayServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            """Silence the default stderr access log."""

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            server.seen.append((method, self.path, body))
            handler = server.handlers.get((method, self.path))
            route = (handler(body) if handler else server.routes.get((method, self.path))) or Route(
                404, json.dumps({"error": {"message": f"no route {self.path}"}})
            )
            data = route.body.encode()
            self.send_response(route.status)
            self.send_header("Content-Type", route.content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler


def serve(state: ReplayServer) -> tuple[ThreadingHTTPServer, threading.Thread]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return httpd, t
