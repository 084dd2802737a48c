"""The HTTP/1.1 connection before a request reaches the app: header size and header time.

uvicorn's h11 protocol, with two bounds on what a client can hold before any
route runs. Headers larger than `header_bytes` are a 431; headers not whole
within `header_timeout_s` of the connection's first byte (or of its start) are
a 408, so a client trickling a request line a byte at a time (slowloris) holds
a connection for a bounded time, not forever (uvicorn's keep-alive timer stops
at the first byte of a request). A request line h11 cannot parse is a 400.
Each answer is the API's JSON error envelope, sent with `Connection: close`.

After such an answer the connection is closed gracefully ("lingering close"):
the write side is shut first and what the client still sends is read and
dropped for a short while. Closing a socket with unread data makes the kernel
reset the connection, and a client still sending its 1 MB header would then
see a reset instead of the 431.

Once a request's headers are whole its body has its own limits (`body.py`); a
request answered before its body was read (a 413, say) is closed the same
way, not read to its end to keep the connection.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

# How long, and how much, a refused client may still send before the connection is dropped.
LINGER_S = 2.0
LINGER_BYTES = 4 * 1024 * 1024
_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds on a request's head: its size in bytes and the time it may take to arrive."""

    header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.header_bytes < 1024:
            raise ValueError(f"header_bytes must be >= 1024, got {self.header_bytes}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")


DEFAULT_HTTP_LIMITS = HttpLimits()


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer carrying the API's error envelope; the connection closes after it."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with bounds on the request head (`limits`)."""

    limits: ClassVar[HttpLimits] = DEFAULT_HTTP_LIMITS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None
        self.lingering = False
        self.dropped = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is bounded too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.dropped += len(data)
            if self.dropped > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        if self.lingering or self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            self._arm()  # part of a request head: its time runs from its first byte
        else:
            self._disarm()  # the head is whole; the body's limits are the app's

    def eof_received(self) -> None:
        if self.lingering:
            self.transport.close()  # the client has sent everything: nothing to reset

    def send_400_response(self, msg: str) -> None:
        # h11 refused the head: it outgrew its limit (431) or does not parse (400).
        buffered = len(self.conn.trailing_data[0])
        if buffered > self.limits.header_bytes:
            self._refuse(
                431,
                f"request headers exceed {self.limits.header_bytes} bytes; send smaller headers",
                "headers_too_large",
            )
        else:
            self._refuse(400, "malformed HTTP/1.1 request head", "malformed_request")

    def _arm(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if busy or self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request is being served (its body has its own deadline)
        self._refuse(
            408,
            f"request headers not received within {self.limits.header_timeout_s:g} s",
            "header_timeout",
        )

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before its body was read (413, 408, 401, ...): reading the rest only to
            # keep the connection open would make the server take in what it just refused.
            self.server_state.total_requests += 1
            self._linger()
            return
        super().on_response_complete()

    def _refuse(self, status: int, message: str, code: str) -> None:
        self.transport.write(error_response(status, message, code))
        self._linger()

    def _linger(self) -> None:
        """Shut the write side, drop what the client still sends, close within `LINGER_S`."""
        self._disarm()
        self._unset_keepalive_if_required()
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


class CloseUnreadBody:
    """ASGI middleware: an answer sent before the request's body was read says `Connection:
    close`.

    `EdgeProtocol` closes such a connection once the answer is out (it will not read what it
    refused). The answer must say so in its head: a client that was not told keeps the
    connection in its pool, sends its next request on it, and loses that request to the close
    ("server disconnected without sending a response"), which is what a refused tenant's
    next, valid request met (a 429 answered before the body, then a keep-alive reuse).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        read_whole = False

        async def tracked_receive() -> Message:
            nonlocal read_whole
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                read_whole = True
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not read_whole:
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracked_receive, closing_send)


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding" and b"chunked" in value.lower():
            return True
    return False


def protocol_class(limits: HttpLimits) -> type[H11Protocol]:
    """`EdgeProtocol` bounded by `limits` (pass as `uvicorn.Config(http=...)`)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})
