"""The grant handshake for backends that write decode's memory (shared memory, Mooncake, NIXL).

The transfer engine moves bytes between registered buffers and knows nothing
of pages, rooms or tenants: a write to any address inside decode's registered
pool succeeds. So kvfence keeps every fence above it, on a control socket:

  sender -> B(manifest)   may I write this room's pages?
  decode -> G | D(why)    granted only for an expected room whose reserved
                          handles are exactly the manifest's destination pages
  sender's engine writes the granted pages (descriptors from `copy_runs`),
                          in chunks of `chunk_bytes` in canonical order
  sender -> P(room, upto) after each chunk but the last: its engine confirmed
                          the room's first `upto` payload bytes are written
  end of transfer         the engine's completion reaches decode with the
                          checksum the sender computed over what it sent:
                          an E frame (Mooncake) or the WRITE's notification (NIXL)

Decode checksums its OWN pages (I3: what landed, never what the sender says):
on each P it reads the newly written bytes into the room's running checksum,
while the engine writes the next chunk, and at the end it reads the rest.
`Landed` carries that checksum, so reconciliation is the manifest comparison
and the read it used to do after the end overlaps the transfer instead
(bench/transfer.py). Every landed byte is still read once, by decode, after
its sender's engine confirmed it written; a region written again after its P
would go unseen, as with any in-place writer after a check (the checksum
guards against accidents, not a forger; the grant bounds where it can write).

A sender whose control socket closes between the grant and the end is dead:
its rooms are confirmed ended (I7) and only then may their released pages be reused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvfence.engine.messages import MessageError, TransferManifest, decode_message, encode_message
from kvfence.engine.reconcile import StreamChecksum, byte_views
from kvfence.kv.pool import KVPool
from kvfence.transfer import framing
from kvfence.transfer.base import InPlaceSender, TransferRefused, TransportClosed
from kvfence.transfer.layout import ChecksumCursor, Outgoing, PoolShape, receive_layout
from kvfence.transfer.listener import ListeningReceiver, tune

log = logging.getLogger(__name__)
CHUNK_BYTES = 16 << 20  # the engines write this much per chunk; 0 = the whole room at once


@dataclasses.dataclass(slots=True)
class _Grant:
    manifest: TransferManifest
    engine: str  # the granted sender's engine identity ("" where it has none)
    landed: ChecksumCursor  # decode's own checksum of the room's pages, as far as written
    total: int
    done: int = 0

    def advance(self, upto: int) -> None:
        upto = min(upto, self.total)
        if upto > self.done:
            self.landed.advance(upto - self.done)
            self.done = upto


def chunked(
    runs: list[tuple[int, int, int, int]], chunk: int
) -> list[tuple[list[tuple[int, int, int, int]], int]]:
    """Copy runs cut into chunks of about `chunk` bytes, in order: (runs, bytes up to its end)."""
    total = sum(n for *_, n in runs)
    if chunk <= 0 or total <= chunk:
        return [(runs, total)] if runs else []
    out: list[tuple[list[tuple[int, int, int, int]], int]] = []
    group: list[tuple[int, int, int, int]] = []
    room, upto = chunk, 0
    for kind, s, d, n in runs:
        while n > 0:
            take = min(n, room)
            group.append((kind, s, d, take))
            s, d, n, room, upto = s + take, d + take, n - take, room - take, upto + take
            if room == 0:
                out.append((group, upto))
                group, room = [], chunk
    if group:
        out.append((group, upto))
    return out


def storage_addresses(pool: KVPool) -> tuple[tuple[int, int], tuple[int, int]]:
    """(address, bytes) of the pool's K and V storage, checked contiguous CPU memory."""
    views = byte_views(pool)  # raises for storage an engine cannot address
    return (
        (pool.k.data_ptr(), len(views[0])),
        (pool.v.data_ptr(), len(views[1])),
    )


def source_checksum(out: Outgoing) -> str:
    """The checksum of what the manifest promises: the canonical source runs, in order."""
    views = byte_views(out.src_pool)
    h = StreamChecksum()
    for kind, off, n in out.canonical:
        h.update(views[kind][off : off + n])
    return h.hexdigest()


def end_body(room: str, checksum: str) -> bytes:
    return json.dumps({"room": room, "checksum": checksum}).encode()


def parse_end(body: bytes) -> tuple[str, str]:
    """An end-of-transfer message: the room and the checksum of what the sender wrote."""
    try:
        obj = json.loads(body)
        room, checksum = obj["room"], obj["checksum"]
    except (ValueError, KeyError, TypeError) as e:
        raise TransportClosed(f"malformed end-of-transfer message: {e}") from None
    if not isinstance(room, str) or not isinstance(checksum, str):
        raise TransportClosed("malformed end-of-transfer message: room and checksum are strings")
    return room, checksum


class GrantingReceiver(ListeningReceiver):
    """Decode's half: grants rooms on the control socket; the engine writes the pages."""

    def __init__(self, pool: KVPool, host: str = "127.0.0.1", port: int = 0) -> None:
        self._granted: dict[str, _Grant] = {}
        self.chunks_checked = 0  # P frames whose bytes were read before the end (bench, tests)
        self._granted_lock = threading.Lock()
        super().__init__(pool, host, port)

    @abstractmethod
    def engine_hello(self) -> dict[str, Any]:
        """What a sender's engine needs to address decode's registered pool."""

    def hello(self) -> dict[str, Any]:
        return {**super().hello(), **self.engine_hello()}

    def peer_frame(self, kind: bytes, body: bytes, peer: dict[str, str]) -> bool:
        """A backend's own control frame (e.g. the sender's engine identity); False if unknown."""
        return False

    def serve(self, conn: socket.socket, granted: set[str]) -> None:
        peer: dict[str, str] = {}
        try:
            while True:
                try:
                    kind, body, payload_len = framing.recv_frame(conn)
                except TransportClosed:
                    return
                if payload_len:
                    raise TransportClosed("a control frame carries no payload")
                if kind == framing.BEGIN:
                    self._begin(conn, body, granted, peer.get("engine", ""))
                elif kind == framing.PROGRESS:
                    room, upto = parse_progress(body)
                    if room not in granted:
                        raise TransportClosed(f"progress of room {room!r} never granted here")
                    self.progress(room, upto)
                elif kind == framing.END:
                    room, checksum = parse_end(body)
                    if room not in granted:
                        raise TransportClosed(f"end of room {room!r} that was never granted here")
                    # False where the engine's own notification already ended it (NIXL).
                    self.finish(room, checksum, peer.get("engine", ""))
                    granted.discard(room)
                elif not self.peer_frame(kind, body, peer):
                    raise TransportClosed(f"unexpected control frame {kind!r}")
        finally:
            with self._granted_lock:  # the caller confirms these rooms ended (I7)
                for room in granted:
                    self._granted.pop(room, None)

    def _begin(self, conn: socket.socket, body: bytes, granted: set[str], engine: str) -> None:
        try:
            msg = decode_message(body)
        except MessageError as e:
            framing.send_frame(conn, framing.DENY, f"malformed manifest: {e}".encode())
            return
        if not isinstance(msg, TransferManifest):
            framing.send_frame(conn, framing.DENY, b"expected a TransferManifest")
            return
        why = self.book.grant(msg)
        if why is None:
            try:
                runs = receive_layout(self.pool, msg)
            except ValueError as e:
                why = f"the manifest does not fit its pages: {e}"
        if why is not None:
            framing.send_frame(conn, framing.DENY, why.encode())
            return
        cursor = ChecksumCursor(runs, byte_views(self.pool))
        with self._granted_lock:
            self._granted[msg.room] = _Grant(msg, engine, cursor, sum(n for *_, n in runs))
        granted.add(msg.room)
        framing.send_frame(conn, framing.GRANT, b"")

    def finish(self, room: str, checksum: str, engine: str = "") -> bool:
        """The completion for a granted room; False unless that room was granted to `engine`.

        Only the sender the room was granted to can end it: an end from anyone
        else would open the pages for reuse while the real writer still writes (I7).
        """
        with self._granted_lock:
            entry = self._granted.get(room)
            if entry is None or entry.engine != engine:
                return False
            del self._granted[room]
            # The bytes since the last P (all of them where none came), read here (I3).
            measured = entry.landed.finish()
        self.book.landed(dataclasses.replace(entry.manifest, checksum=checksum), measured)
        return True

    def progress(self, room: str, upto: int) -> None:
        """The sender's engine wrote the room's first `upto` bytes: checksum them now (I3)."""
        with self._granted_lock:
            entry = self._granted.get(room)
            if entry is not None:  # else ended already (NIXL)
                entry.advance(upto)
                self.chunks_checked += 1


def parse_progress(body: bytes) -> tuple[str, int]:
    try:
        obj = json.loads(body)
        room, upto = obj["room"], obj["upto"]
    except (ValueError, KeyError, TypeError) as e:
        raise TransportClosed(f"malformed progress message: {e}") from None
    if not isinstance(room, str) or not isinstance(upto, int) or upto < 0:
        raise TransportClosed("malformed progress message: room is a string, upto a count")
    return room, upto


class GrantClient(InPlaceSender):
    """Prefill's half of the handshake: the hello, then a grant asked for every room.

    A subclass completes a granted transfer its own way and ends it with `send_end`."""

    def __init__(self, address: str, scheme: str) -> None:
        host, port = framing.parse_address(address, scheme)
        self._sock = socket.create_connection((host, port))
        tune(self._sock)
        kind, body, _ = framing.recv_frame(self._sock)
        if kind != framing.HELLO:
            raise TransportClosed(f"expected a hello from {address}, got {kind!r}")
        self.hello = json.loads(body)
        self._shape = PoolShape.from_json(self.hello)

    @property
    def dest_shape(self) -> PoolShape:
        return self._shape

    def begin(self, out: Outgoing) -> None:
        framing.send_frame(self._sock, framing.BEGIN, encode_message(out.manifest))
        kind, body, _ = framing.recv_frame(self._sock)
        if kind == framing.DENY:
            raise TransferRefused(body.decode(errors="replace"))
        if kind != framing.GRANT:
            raise TransportClosed(f"expected a grant, got {kind!r}")

    def send_end(self, end: bytes) -> None:
        framing.send_frame(self._sock, framing.END, end)

    def send_progress(self, room: str, upto: int) -> None:
        body = json.dumps({"room": room, "upto": upto}).encode()
        framing.send_frame(self._sock, framing.PROGRESS, body)

    def close(self) -> None:
        self._sock.close()


class GrantedSender(GrantClient):
    """Prefill's half for a transfer engine: asks for the grant, then has its engine write
    the granted pages chunk by chunk (a P frame after each but the last) and signal the end.

    Where `checksum_beside_writes` is set (NIXL), the checksum of the source runs (what
    the end carries) is computed on a thread of its own while the engine writes the first
    chunks: xxh3 releases the GIL, so on two cores the read and the copy overlap instead
    of adding up. The end body, and so the last chunk's notification, waits for it;
    `complete` never returns while that thread still reads the source pages, which
    prefill frees after it. Mooncake computes it first: its TCP writes set the pace, so
    the overlap saves it little, and the serving stack measured no gain from it.
    """

    checksum_beside_writes = False

    def __init__(self, address: str, scheme: str, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(address, scheme)
        self.chunk_bytes = chunk_bytes
        self._summer = ThreadPoolExecutor(1, thread_name_prefix="kvfence-source-checksum")

    def complete(self, out: Outgoing) -> None:
        room = out.manifest.room
        if self.checksum_beside_writes and 0 < self.chunk_bytes < out.payload_bytes:
            pending = self._summer.submit(source_checksum, out)
        else:  # first: one write leaves nothing to overlap it with
            pending = Future()
            pending.set_result(source_checksum(out))

        def end() -> bytes:
            out.manifest = dataclasses.replace(out.manifest, checksum=pending.result())
            return end_body(room, out.manifest.checksum)

        try:
            failure = self.write(out, end)
        finally:
            pending.result()  # the source pages are read no more once this returns
        if failure is not None:
            # Some bytes may have landed: decode must see the room end and fail it, never
            # wait; a checksum no payload has makes its reconciliation refuse (I3).
            framing.send_frame(self._sock, framing.END, end_body(room, f"failed: {failure}"))
            raise TransportClosed(f"transfer engine write failed: {failure}")

    def close(self) -> None:
        self._summer.shutdown()
        super().close()

    @abstractmethod
    def write(self, out: Outgoing, end: Callable[[], bytes]) -> str | None:
        """Have the engine write the copy runs and signal the end with `end()` (which waits
        for the source checksum); None, or why it failed."""
