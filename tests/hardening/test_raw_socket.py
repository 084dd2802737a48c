"""Hand-written raw-socket attacks the schema cannot express.

Each case talks HTTP/1.1 by hand to a live loopback server and then checks
that the server still serves another tenant, counted no 5xx, and holds no
page once quiet (ledger integrity checked).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import h11
import httpx
import pytest
from hardening_helpers import Live, live_server

from kvfence.serve.admission import BODY_FLOOR

IO_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 1.0  # the server's stalled-body deadline, shortened for the test


@pytest.fixture(scope="module")
def server(hardening_checkpoint: Path) -> Iterator[Live]:
    with live_server(hardening_checkpoint, body_timeout_s=BODY_TIMEOUT_S) as live:
        yield live


@pytest.fixture(autouse=True)
def _still_healthy(server: Live) -> Iterator[None]:
    """After every attack: another tenant is served, no 5xx was sent, no page is held."""
    before = _five_hundreds(server)
    yield
    r = httpx.post(
        server.url + "/v1/completions",
        headers=server.auth("b"),
        json={"prompt": "still serving", "max_tokens": 4, "temperature": 0},
        timeout=IO_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    assert _five_hundreds(server) == before, "the attack got a 5xx"
    assert server.settle() == {"prefill": 0, "decode": 0}


def _five_hundreds(server: Live) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.auth(), timeout=IO_TIMEOUT_S).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kvfence_http_responses_total") and 'status="5' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _connect(server: Live, rcvbuf: int | None = None) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(IO_TIMEOUT_S)
    sock.connect((host, int(port)))
    return sock


def _head(server: Live, path: str, extra: dict[str, str]) -> bytes:
    host = server.url.removeprefix("http://")
    headers = {"Host": host, **server.auth(), "Content-Type": "application/json", **extra}
    lines = [f"POST {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _request(server: Live, body: bytes, path: str = "/v1/completions") -> bytes:
    return _head(server, path, {"Content-Length": str(len(body))}) + body


def _responses(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """Read `count` responses off one connection, in order."""
    conn = h11.Connection(h11.CLIENT)

    def sent() -> None:  # h11 tracks the request side too; the real bytes went out already
        conn.send(
            h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")])
        )
        conn.send(h11.EndOfMessage())

    sent()
    out: list[tuple[int, bytes]] = []
    status, body = 0, b""
    while len(out) < count:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:  # the server closed without (finishing) an answer
            break
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status, body = event.status_code, b""
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            out.append((status, body))
            if len(out) < count:
                conn.start_next_cycle()
                sent()
        elif isinstance(event, h11.ConnectionClosed):
            break
    return out


def _send_one(server: Live, raw: bytes) -> tuple[int, dict[str, object]]:
    with _connect(server) as sock:
        sock.sendall(raw)
        [(status, body)] = _responses(sock, 1)
    return status, json.loads(body)


def test_invalid_utf8_is_a_400_naming_the_byte(server: Live) -> None:
    status, body = _send_one(server, _request(server, b'{"prompt": "caf\xc3\x28"}'))
    assert status == 400
    assert body["error"]["code"] == "invalid_utf8" and "byte 15" in body["error"]["message"]


@pytest.mark.parametrize("depth", [2_000, 200_000])
def test_deeply_nested_json_is_a_400(server: Live, depth: int) -> None:
    nested = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, body = _send_one(server, _request(server, nested))
    assert status == 400
    assert body["error"]["code"] in ("invalid_json", "invalid_value"), body


def test_body_over_the_limit_is_a_413_before_it_is_read(server: Live) -> None:
    limit = BODY_FLOOR + 32 * server.parts.config.context_length
    # Declared too large: refused from the header alone, nothing is read.
    with _connect(server) as sock:
        sock.sendall(_head(server, "/v1/completions", {"Content-Length": str(limit + 1)}))
        [(status, body)] = _responses(sock, 1)
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
    # Chunked, so no length is declared: refused once the limit is crossed.
    chunk = b"x" * (1 << 20)
    with _connect(server) as sock:
        sock.sendall(_head(server, "/v1/completions", {"Transfer-Encoding": "chunked"}))
        try:
            for _ in range(limit // len(chunk) + 2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        [(status, body)] = _responses(sock, 1)
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"


def test_stalled_body_gets_408_after_the_deadline(server: Live) -> None:
    """Slowloris: the headers promise 100 bytes, 10 arrive, then nothing."""
    with _connect(server) as sock:
        sock.sendall(_head(server, "/v1/completions", {"Content-Length": "100"}) + b'{"prompt":')
        start = time.monotonic()
        [(status, body)] = _responses(sock, 1)
        waited = time.monotonic() - start
    assert status == 408, body
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert waited < IO_TIMEOUT_S


@pytest.mark.parametrize("how", ["half-close", "close"])
def test_truncated_chunked_body_is_refused_not_a_5xx(server: Live, how: str) -> None:
    with _connect(server) as sock:
        sock.sendall(_head(server, "/v1/completions", {"Transfer-Encoding": "chunked"}))
        sock.sendall(b"40\r\n" + b'{"prompt": "cut off in the mi')  # a 64-byte chunk, 30 sent
        if how == "close":
            time.sleep(0.2)  # the app is reading the body when the client goes
            return  # closed by `with`: the app sees a disconnect mid-body (no 5xx counted)
        sock.shutdown(socket.SHUT_WR)  # the client is done sending: the body ends early
        answers = _responses(sock, 1)
    # uvicorn answers 400 or just closes; the app never sees a whole body, so nothing runs.
    assert all(400 <= status < 500 for status, _ in answers), answers


def test_pipelined_requests_are_answered_in_order(server: Live) -> None:
    prompts = ["first one", "second one", "third one"]
    raw = b"".join(
        _request(server, json.dumps({"prompt": p, "max_tokens": 3, "temperature": 0}).encode())
        for p in prompts
    )
    with _connect(server) as sock:
        sock.sendall(raw)  # all three in one write, before any answer
        answers = _responses(sock, len(prompts))
    assert [status for status, _ in answers] == [200, 200, 200]
    texts = [json.loads(body)["choices"][0]["text"] for _, body in answers]
    # The mirror model echoes each request's own prompt: order and content both checked.
    for prompt, text in zip(prompts, texts, strict=True):
        assert text and prompt.startswith(text), (prompts, texts)


def test_streaming_client_that_never_reads_holds_no_pages(server: Live) -> None:
    body = json.dumps(
        {"prompt": "never read " * 4, "max_tokens": 200, "stream": True, "ignore_eos": True}
    ).encode()
    with _connect(server, rcvbuf=2048) as sock:
        sock.sendall(_request(server, body))
        # The client reads nothing. The engine does not wait on it: others are served and,
        # once the generation is over, its pages are back although the socket is still open.
        r = httpx.post(
            server.url + "/v1/completions",
            headers=server.auth("b"),
            json={"prompt": "meanwhile", "max_tokens": 4, "temperature": 0},
            timeout=IO_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        end = time.monotonic() + IO_TIMEOUT_S
        while server.pages_in_use()["decode"] and time.monotonic() < end:
            time.sleep(0.05)
        assert server.pages_in_use()["decode"] == 0
