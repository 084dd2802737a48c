"""Shared-memory transport: prefill writes decode's pages itself, as an RDMA write does.

Decode's K/V storage is a file in /dev/shm mapped with `torch.from_file`
(`ShmTransport.create_pool`). A sender connects to decode's control socket,
learns the file and pool shape from the hello, and maps it. The handshake is the
grant handshake of `granted.py` (`GrantingReceiver`, `GrantClient`). Per transfer:

  sender -> B(manifest)   may I write this room's pages?
  decode -> G | D(why)    granted only for an expected room whose reserved
                          handles are exactly the manifest's destination pages
  sender writes the pages directly into the mapping, in canonical order
  sender -> P(room, upto) after each `chunk_bytes` but the last: the first `upto`
                          payload bytes are written
  sender -> E(room, sum)  done: nothing more will land; the checksum of what it
                          wrote, computed while copying

Decode checksums its OWN pages (I3), as the engines' receivers do (`granted.py`): on
each P it reads the newly written bytes while the sender copies the next chunk (the
two roles on two cores), and on E the rest. Reconciliation is then the manifest
comparison, not a second pass over the payload after the end. A sender that dies
between G and E is detected by the closed socket and its rooms are confirmed ended (I7).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from typing import Any

import torch

from kvfence.engine.reconcile import byte_views
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import KVTransport
from kvfence.transfer.granted import GrantClient, GrantingReceiver, end_body
from kvfence.transfer.layout import Outgoing, copy_runs_into

log = logging.getLogger(__name__)
# A P frame per 4 MiB: decode's read of a chunk (xxh3, well above the copy's rate) is done
# before the next one is copied, and what is left to read after E is at most this much.
SHM_CHUNK_BYTES = 4 << 20


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


class ShmReceiver(GrantingReceiver):
    """Decode's half: the grant handshake of `granted.py`; the hello names the shared file."""

    scheme = "shm"

    def __init__(self, pool: KVPool, path: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.path = path
        super().__init__(pool, host, port)

    def engine_hello(self) -> dict[str, Any]:
        return {"path": self.path}

    def close(self) -> None:
        super().close()
        try:
            os.unlink(self.path)  # the mapping stays valid for whoever still holds it
        except FileNotFoundError:
            log.debug("shared KV file %s already removed", self.path)


class ShmSender(GrantClient):
    """Prefill's half: maps decode's file from the hello and, once granted, copies the pages
    into it itself, checksumming each piece as it copies (one pass over the payload) and
    telling decode after each `chunk_bytes` how far it got."""

    def __init__(self, address: str, chunk_bytes: int = SHM_CHUNK_BYTES) -> None:
        super().__init__(address, "shm")
        self.chunk_bytes = chunk_bytes
        shape = self.dest_shape
        k, v = map_storage(self.hello["path"], shape.geometry, shape.num_pages, create=False)
        self._storage = (k, v)  # keeps the mapping alive as long as the sender
        # Decode's K and V bytes as mapped here: where this sender writes.
        self.dest = byte_views(KVPool(shape.geometry, shape.num_pages, storage=(k, v)))

    def complete(self, out: Outgoing) -> None:
        room = out.manifest.room

        def progress(upto: int) -> None:
            self.send_progress(room, upto)

        src = byte_views(out.src_pool)
        checksum = copy_runs_into(out, self.dest, src, progress, self.chunk_bytes)
        out.manifest = dataclasses.replace(out.manifest, checksum=checksum)
        self.send_end(end_body(out.manifest.room, checksum))


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        directory: str = "/dev/shm",
        chunk_bytes: int = SHM_CHUNK_BYTES,
    ) -> None:
        self.host = host
        self.port = port
        self.directory = directory
        self.chunk_bytes = chunk_bytes  # 0: no P frames, decode reads every byte after the end
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
        return ShmSender(address, self.chunk_bytes)
