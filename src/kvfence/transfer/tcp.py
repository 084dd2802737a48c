"""TCP transport: the payload is streamed straight into decode's reserved pages.

Per transfer the sender writes one frame: the encoded `TransferManifest`, then
the raw K/V bytes in canonical order (`engine.reconcile.payload_segments`).
The receiver, not the sender, decides where bytes go: only into the pages the
room reserved, and only when the frame's payload length is exactly what the
manifest's token count implies; otherwise the bytes are drained and the
transfer is refused. Bytes are read with `recv_into` on views of the pool's
own memory (no intermediate copy of the payload) and checksummed as they
land, so `Landed.checksum` is what is really in the pages.
"""

from __future__ import annotations

import json
import logging
import socket

from kvfence.engine.messages import MessageError, TransferManifest, decode_message, encode_message
from kvfence.engine.reconcile import StreamChecksum, byte_views, payload_bytes
from kvfence.kv.pool import KVPool
from kvfence.transfer import framing
from kvfence.transfer.base import KVSender, KVTransport, TransportClosed
from kvfence.transfer.layout import Outgoing, PoolShape, receive_layout
from kvfence.transfer.listener import ListeningReceiver, tune

log = logging.getLogger(__name__)

HASH_CHUNK = 1 << 20  # checksum each MiB right after it lands, while it is still in cache


class TcpReceiver(ListeningReceiver):
    scheme = "tcp"

    def __init__(self, pool: KVPool, host: str = "127.0.0.1", port: int = 0) -> None:
        self._views = byte_views(pool)
        super().__init__(pool, host, port)

    def serve(self, conn: socket.socket, granted: set[str]) -> None:
        while True:
            try:
                kind, body, payload_len = framing.recv_frame(conn)
            except TransportClosed:
                return  # the sender closed between frames: nothing in flight
            manifest = self._manifest(kind, body)
            if manifest is None:
                framing.drain(conn, payload_len)
                continue
            expected = payload_bytes(self.pool, manifest.num_tokens)
            if payload_len != expected:
                framing.drain(conn, payload_len)
                self.book.refuse(
                    manifest,
                    f"payload is {payload_len} bytes, {manifest.num_tokens} tokens need {expected}",
                )
                continue
            if self.book.grant(manifest) is not None:
                framing.drain(conn, payload_len)
                continue
            granted.add(manifest.room)
            checksum = self._receive(conn, manifest)
            self.book.landed(manifest, checksum)
            granted.discard(manifest.room)

    def _manifest(self, kind: bytes, body: bytes) -> TransferManifest | None:
        if kind != framing.DATA:
            log.warning("refused a %r frame: only transfer frames are accepted", kind)
            return None
        try:
            msg = decode_message(body)
        except MessageError as e:
            log.warning("refused a malformed transfer manifest: %s", e)
            return None
        if not isinstance(msg, TransferManifest):
            log.warning("refused a %s where a TransferManifest was expected", type(msg).__name__)
            return None
        return msg

    def _receive(self, conn: socket.socket, manifest: TransferManifest) -> str:
        h = StreamChecksum()
        for kind, off, n in receive_layout(self.pool, manifest):
            view = self._views[kind]
            for start in range(off, off + n, HASH_CHUNK):
                chunk = view[start : min(start + HASH_CHUNK, off + n)]
                framing.recv_into_exactly(conn, chunk)
                h.update(chunk)
        return h.hexdigest()


class TcpSender(KVSender):
    def __init__(self, address: str) -> None:
        host, port = framing.parse_address(address, "tcp")
        self._sock = socket.create_connection((host, port))
        tune(self._sock)
        kind, body, _ = framing.recv_frame(self._sock)
        if kind != framing.HELLO:
            raise TransportClosed(f"expected a hello from {address}, got {kind!r}")
        self._shape = PoolShape.from_json(json.loads(body))

    @property
    def dest_shape(self) -> PoolShape:
        return self._shape

    def transmit(self, out: Outgoing) -> None:
        views = byte_views(out.src_pool)
        body = encode_message(out.manifest)
        framing.send_frame(self._sock, framing.DATA, body, out.payload_bytes)
        for kind, off, n in out.src_runs():
            self._sock.sendall(views[kind][off : off + n])

    def close(self) -> None:
        self._sock.close()


class TcpTransport(KVTransport):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port

    def receiver(self, pool: KVPool) -> TcpReceiver:
        return TcpReceiver(pool, self.host, self.port)

    def sender(self, address: str) -> TcpSender:
        return TcpSender(address)
