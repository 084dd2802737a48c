"""Length-prefixed frames on a stream socket, shared by the TCP and shared-memory backends.

A frame is a fixed header (kind byte, body length, payload length), the body
(JSON: a hello or an encoded `TransferManifest`) and, for data frames, the raw
payload, which the receiver reads straight into its destination memory.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from kvfence.transfer.base import TransportClosed

HEADER = struct.Struct("!cIQ")
MAX_BODY = 16 << 20  # a manifest for ~1M pages; anything larger is malformed

HELLO = b"H"  # receiver -> sender on connect: the pool shape (and where to map it)
DATA = b"T"  # TCP: manifest body + payload
BEGIN = b"B"  # shm: manifest body, asks for the grant
GRANT = b"G"  # shm: you may write
DENY = b"D"  # shm: you may not (body: why)
END = b"E"  # shm: the pages of this room are written (body: room)
PROGRESS = b"P"  # engines: the room's first `upto` payload bytes are written (body: room, upto)


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"not a {scheme} address: {address!r}")
    host, _, port = address[len(prefix) :].rpartition(":")
    return host, int(port)


def send_frame(sock: socket.socket, kind: bytes, body: bytes, payload_len: int = 0) -> None:
    sock.sendall(HEADER.pack(kind, len(body), payload_len) + body)


def send_json(sock: socket.socket, kind: bytes, obj: Any) -> None:
    send_frame(sock, kind, json.dumps(obj).encode())


def recv_into_exactly(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportClosed(f"connection closed after {got} of {n} bytes")
        got += k


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exactly(sock, memoryview(buf))
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes, int]:
    """(kind, body, payload length); the payload, if any, is still on the socket."""
    kind, body_len, payload_len = HEADER.unpack(recv_exactly(sock, HEADER.size))
    if body_len > MAX_BODY:
        raise TransportClosed(f"frame body of {body_len} bytes exceeds {MAX_BODY}")
    return kind, recv_exactly(sock, body_len), payload_len


def drain(sock: socket.socket, n: int) -> None:
    """Read and drop `n` payload bytes (a refused transfer never touches the pages)."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        chunk = min(n, len(scratch))
        recv_into_exactly(sock, scratch[:chunk])
        n -= chunk
