"""A request's head is bounded: oversized headers are a 431, slow ones a 408.

Raw sockets against a live loopback server: a 1 MB Authorization header gets a
431 whose message names the limit (read whole by the client, not a connection
reset), and 40 connections trickling their request line a byte at a time are
each answered 408 and closed within the header deadline while another tenant
is served. A head that is slow but arrives within the deadline is served.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hardening_helpers import Live, live_server

from kvfence.serve.http_edge import HttpLimits

HEAD_TIMEOUT_S = 2.0  # the server's header deadline, shortened for the test
LIMITS = HttpLimits(header_bytes=64 * 1024, header_timeout_s=HEAD_TIMEOUT_S)
IO_TIMEOUT_S = 30.0
# How late past the deadline a close may come on this busy machine (loop and scheduler lag).
LATE_S = 5.0


@pytest.fixture(scope="module")
def server(hardening_checkpoint: Path) -> Iterator[Live]:
    with live_server(hardening_checkpoint, http_limits=LIMITS) as live:
        yield live


def _connect(server: Live) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT_S)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes; a reset is a failure of the server's close."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _error(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert isinstance(error, dict) and error["message"], body
    return int(head.split()[1]), error


def _served(server: Live) -> None:
    r = httpx.post(
        server.url + "/v1/completions",
        headers=server.auth("b"),
        json={"prompt": "still serving", "max_tokens": 4, "temperature": 0},
        timeout=IO_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text


def test_a_1_mb_authorization_header_is_a_431_not_a_reset(server: Live) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {'k' * (1 << 20)}\r\nContent-Length: 2\r\n\r\n{{}}"
    ).encode()
    with _connect(server) as sock:
        sock.sendall(head)  # the server reads (and drops) the rest after answering
        status, error = _error(_read_all(sock))
    assert status == 431 and error["code"] == "headers_too_large", error
    assert str(LIMITS.header_bytes) in str(error["message"]), error
    _served(server)


def test_trickled_heads_are_408_within_the_deadline_and_others_are_served(server: Live) -> None:
    """Slowloris: 40 connections send their request line a byte every 0.2 s, forever."""
    line = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    socks = [_connect(server) for _ in range(40)]
    answers: dict[int, tuple[float, bytes]] = {}
    start = time.monotonic()

    def trickle(i: int, sock: socket.socket) -> None:
        try:
            for byte in line:
                sock.sendall(bytes([byte]))
                time.sleep(0.2)
        except OSError:
            pass  # the server closed it: the answer is read below

    def read(i: int, sock: socket.socket) -> None:
        answers[i] = (time.monotonic() - start, _read_all(sock))

    threads = [threading.Thread(target=f, args=(i, s), daemon=True)
               for i, s in enumerate(socks) for f in (trickle, read)]  # fmt: skip
    for t in threads:
        t.start()
    _served(server)  # while 40 connections trickle
    deadline = time.monotonic() + HEAD_TIMEOUT_S + LATE_S
    while len(answers) < len(socks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for s in socks:
        s.close()
    assert len(answers) == len(socks), f"{len(socks) - len(answers)} connections still held"
    for took, answer in answers.values():
        status, error = _error(answer)
        assert status == 408 and error["code"] == "header_timeout", error
        assert f"{HEAD_TIMEOUT_S:g} s" in str(error["message"])
        assert took <= HEAD_TIMEOUT_S + LATE_S
    _served(server)


def test_a_connection_that_sends_nothing_is_closed_within_the_deadline(server: Live) -> None:
    with _connect(server) as sock:
        start = time.monotonic()
        status, error = _error(_read_all(sock))
        took = time.monotonic() - start
    assert status == 408 and error["code"] == "header_timeout", error
    assert HEAD_TIMEOUT_S * 0.9 <= took <= HEAD_TIMEOUT_S + LATE_S, took


def test_a_slow_head_within_the_deadline_is_served(server: Live) -> None:
    """No false alarm: the deadline is on the whole head, and this one arrives in time."""
    body = json.dumps({"prompt": "slow but fine", "max_tokens": 3, "temperature": 0}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key()}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    parts = [head[i : i + 40] for i in range(0, len(head), 40)]
    with _connect(server) as sock:
        for part in parts:  # the head over about half the deadline
            sock.sendall(part)
            time.sleep(HEAD_TIMEOUT_S / 2 / len(parts))
        sock.sendall(body)
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_an_answer_before_the_body_is_read_says_the_connection_closes(server: Live) -> None:
    """A request refused before its body is read (here a 401) says `Connection: close`.

    The server closes such a connection once the answer is out, not reading what it refused;
    a pooled client that was not told would send its next request on it and lose that request
    ("server disconnected without sending a response"). Served requests keep the connection.
    """
    body = {"prompt": "pooled", "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=IO_TIMEOUT_S) as client:
        for _ in range(3):
            refused = client.post(server.url + "/v1/completions", json=body)
            assert refused.status_code == 401, refused.text
            assert refused.headers.get("connection") == "close", refused.headers
            served = client.post(server.url + "/v1/completions", json=body, headers=server.auth())
            assert served.status_code == 200, served.text
            assert served.headers.get("connection") != "close", served.headers
