"""Shared-memory transport: prefill writes decode's pages itself, as an RDMA write does.

Decode's K/V storage is a file in /dev/shm mapped with `torch.from_file`
(`ShmTransport.create_pool`). A sender connects to decode's control socket,
learns the file and pool shape from the hello, and maps it. Per transfer:

  sender -> B(manifest)   may I write this room's pages?
  decode -> G | D(why)    granted only for an expected room whose reserved
                          handles are exactly the manifest's destination pages
  sender writes the pages directly into the mapping
  sender -> E(room, sum)  done: nothing more will land; the checksum of what it
                          wrote, computed while copying

Decode learns what landed only from E; it then checksums its own pages
(`Landed.checksum is None`). A sender that dies between G and E is detected
by the closed socket and its rooms are confirmed ended (I7).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import uuid
from typing import Any

import torch

from kvfence.engine.messages import MessageError, TransferManifest, decode_message, encode_message
from kvfence.engine.reconcile import byte_views
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool
from kvfence.serve.transfer import framing
from kvfence.serve.transfer.base import InPlaceSender, KVTransport, TransferRefused, TransportClosed
from kvfence.serve.transfer.granted import parse_end
from kvfence.serve.transfer.layout import Outgoing, PoolShape, copy_runs_into
from kvfence.serve.transfer.listener import ListeningReceiver, tune

log = logging.getLogger(__name__)


def map_storage(
    path: str, geometry: KVGeometry, num_pages: int, *, create: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V tensors over one shared file (K first, then V)."""
    shape = (
        geometry.num_layers,
        num_pages,
        geometry.page_size,
        geometry.num_kv_heads,
        geometry.head_dim,
    )
    nbytes = geometry.bytes_per_page // 2 * num_pages  # one of K or V
    if create:
        # 0600: the file holds tenants' KV; no other local user may map it.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 2 * nbytes)
        finally:
            os.close(fd)
    raw = torch.from_file(path, shared=True, size=2 * nbytes, dtype=torch.uint8)
    k = raw[:nbytes].view(geometry.torch_dtype).view(shape)
    v = raw[nbytes:].view(geometry.torch_dtype).view(shape)
    return k, v


class ShmReceiver(ListeningReceiver):
    scheme = "shm"

    def __init__(self, pool: KVPool, path: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.path = path
        super().__init__(pool, host, port)

    def hello(self) -> dict[str, Any]:
        return {**super().hello(), "path": self.path}

    def serve(self, conn: socket.socket, granted: set[str]) -> None:
        manifests: dict[str, TransferManifest] = {}
        while True:
            try:
                kind, body, payload_len = framing.recv_frame(conn)
            except TransportClosed:
                return
            if payload_len:
                raise TransportClosed("a shared-memory control frame carries no payload")
            if kind == framing.BEGIN:
                self._begin(conn, body, manifests, granted)
            elif kind == framing.END:
                room, checksum = parse_end(body)
                if room not in manifests:
                    raise TransportClosed(f"end of room {room!r} that was never granted here")
                manifest = dataclasses.replace(manifests.pop(room), checksum=checksum)
                self.book.landed(manifest, None)
                granted.discard(room)
            else:
                raise TransportClosed(f"unexpected control frame {kind!r}")

    def _begin(
        self,
        conn: socket.socket,
        body: bytes,
        manifests: dict[str, TransferManifest],
        granted: set[str],
    ) -> None:
        try:
            msg = decode_message(body)
        except MessageError as e:
            framing.send_frame(conn, framing.DENY, f"malformed manifest: {e}".encode())
            return
        if not isinstance(msg, TransferManifest):
            framing.send_frame(conn, framing.DENY, b"expected a TransferManifest")
            return
        why = self.book.grant(msg)
        if why is not None:
            framing.send_frame(conn, framing.DENY, why.encode())
            return
        manifests[msg.room] = msg
        granted.add(msg.room)
        framing.send_frame(conn, framing.GRANT, b"")

    def close(self) -> None:
        super().close()
        try:
            os.unlink(self.path)  # the mapping stays valid for whoever still holds it
        except FileNotFoundError:
            log.debug("shared KV file %s already removed", self.path)


class ShmSender(InPlaceSender):
    def __init__(self, address: str) -> None:
        host, port = framing.parse_address(address, "shm")
        self._sock = socket.create_connection((host, port))
        tune(self._sock)
        kind, body, _ = framing.recv_frame(self._sock)
        if kind != framing.HELLO:
            raise TransportClosed(f"expected a hello from {address}, got {kind!r}")
        hello = json.loads(body)
        self._shape = PoolShape.from_json(hello)
        k, v = map_storage(hello["path"], self._shape.geometry, self._shape.num_pages, create=False)
        self._storage = (k, v)  # keeps the mapping alive as long as the sender
        self._dest = byte_views(KVPool(self._shape.geometry, self._shape.num_pages, storage=(k, v)))

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

    def complete(self, out: Outgoing) -> None:
        checksum = copy_runs_into(out, self._dest, byte_views(out.src_pool))
        out.manifest = dataclasses.replace(out.manifest, checksum=checksum)
        framing.send_json(
            self._sock, framing.END, {"room": out.manifest.room, "checksum": checksum}
        )

    def close(self) -> None:
        self._sock.close()


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, directory: str = "/dev/shm") -> None:
        self.host = host
        self.port = port
        self.directory = directory
        self._paths: dict[int, str] = {}  # data pointer of a pool's K storage -> its file

    def create_pool(self, geometry: KVGeometry, num_pages: int, **pool_options: Any) -> KVPool:
        path = os.path.join(self.directory, f"kvfence-{os.getpid()}-{uuid.uuid4().hex}.kv")
        storage = map_storage(path, geometry, num_pages, create=True)
        pool = KVPool(geometry, num_pages, storage=storage, **pool_options)
        self._paths[pool.k.data_ptr()] = path
        return pool

    def receiver(self, pool: KVPool) -> ShmReceiver:
        path = self._paths.get(pool.k.data_ptr())
        if path is None:
            raise ValueError("a shared-memory receiver needs a pool made by this transport")
        return ShmReceiver(pool, path, self.host, self.port)

    def sender(self, address: str) -> ShmSender:
        return ShmSender(address)
