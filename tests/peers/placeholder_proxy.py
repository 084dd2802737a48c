"""A fault in front of a live fleet: every prompt longer than `over` token ids reaches it as its
last `keep` ids, the incident's placeholder (a long prompt answered without its prefill).

The fleet nobody here wrote has no fault switch; this proxy gives the latency check a skip to
fail on, at the fleet's own noise. Everything else (paths, headers, status, the streamed
body, line by line) passes through unchanged.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = frozenset({"host", "content-length", "connection", "transfer-encoding"})


def _shortened(body: bytes, over: int, keep: int) -> bytes:
    """The request with a token-id prompt longer than `over` cut to its last `keep` ids."""
    try:
        request = json.loads(body)
    except ValueError:
        return body
    prompt = request.get("prompt") if isinstance(request, dict) else None
    if isinstance(prompt, list) and len(prompt) > over and all(isinstance(t, int) for t in prompt):
        request["prompt"] = prompt[-keep:]
        return json.dumps(request).encode()
    return body


@contextmanager
def placeholder_proxy(upstream: str, over: int = 1000, keep: int = 16) -> Iterator[str]:
    """Serve the proxy on a free loopback port while the block runs; yield its base URL."""
    target = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self, body: bytes | None) -> None:
            if body is not None and self.path.endswith("/completions"):
                body = _shortened(body, over, keep)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in _HOP:
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while line := answer.readline():  # server-sent events arrive line by line
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            finally:
                conn.close()

        def do_GET(self) -> None:
            self._forward(None)

        def do_POST(self) -> None:
            self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="placeholder-proxy", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
