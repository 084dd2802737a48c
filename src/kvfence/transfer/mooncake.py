"""Mooncake transfer engine backend: prefill's engine writes decode's registered pool.

Decode's K/V storage is registered with a Mooncake `TransferEngine`
(P2P handshake, no metadata server; protocol "tcp" here, "rdma" where the
hardware has it). The hello tells senders the engine's session
(`host:rpc_port`) and the base addresses of K and V; a granted transfer is one
`batch_transfer_sync_write` of the copy runs (each run one request), which
returns only once the target engine has acknowledged the writes, one call per
chunk (granted.py's P frames let decode checksum a chunk while the next is
written). Then the sender sends the E frame with the checksum of what it sent.

Mooncake checks only that a write falls inside some registered buffer: a
write to another page of the pool succeeds. Which pages a sender may write
is decided by the grant (`granted.py`), whether they may be reused by the
pool's inbound windows (I7), and whether what landed is the request's KV by
decode's reconciliation (I3) — all above the engine.

Needs the `pd` extra (`mooncake-transfer-engine-non-cuda`) and the system
library libibverbs (Debian `libibverbs1`), even for TCP.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from kvfence.kv.pool import KVPool
from kvfence.transfer.base import KVTransport
from kvfence.transfer.granted import (
    CHUNK_BYTES,
    GrantedSender,
    GrantingReceiver,
    chunked,
    storage_addresses,
)
from kvfence.transfer.layout import Outgoing

log = logging.getLogger(__name__)


class MooncakeEngine:
    """One Mooncake `TransferEngine` and the buffers registered with it."""

    def __init__(self, host: str, protocol: str) -> None:
        from mooncake.engine import TransferEngine  # the `pd` extra

        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, {protocol!r}) = {rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._pools: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def register(self, pool: KVPool) -> tuple[tuple[int, int], tuple[int, int]]:
        """Register the pool's K and V storage while the pool lives; their (address, bytes).

        The engine refuses overlapping regions, and a freed pool's memory is
        soon someone else's: registrations end with the pool that owns them.
        """
        with self._lock:
            regions = self._pools.get(id(pool))
            if regions is not None:
                return regions
            regions = storage_addresses(pool)
            for addr, nbytes in regions:
                rc = self._engine.register_memory(addr, nbytes)
                if rc != 0:
                    raise RuntimeError(f"Mooncake register_memory({addr:#x}, {nbytes}) = {rc}")
            self._pools[id(pool)] = regions
        weakref.finalize(pool, self._unregister, id(pool)).atexit = False
        return regions

    def _unregister(self, key: int) -> None:
        with self._lock:
            for addr, _ in self._pools.pop(key, ()):
                self._engine.unregister_memory(addr)

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        """One synchronous batch write; 0, or Mooncake's negative error code."""
        return int(self._engine.batch_transfer_sync_write(session, src, dst, lengths))


class MooncakeReceiver(GrantingReceiver):
    scheme = "mooncake"

    def __init__(self, pool: KVPool, engine: MooncakeEngine, host: str, port: int) -> None:
        (self._k_addr, _), (self._v_addr, _) = engine.register(pool)
        self._session = engine.session
        super().__init__(pool, host, port)

    def engine_hello(self) -> dict[str, Any]:
        return {"session": self._session, "k_addr": self._k_addr, "v_addr": self._v_addr}


class MooncakeSender(GrantedSender):
    def __init__(self, address: str, engine: MooncakeEngine, chunk_bytes: int) -> None:
        super().__init__(address, "mooncake", chunk_bytes)
        self._engine = engine
        self._session = str(self.hello["session"])
        self._dst_base = (int(self.hello["k_addr"]), int(self.hello["v_addr"]))

    def write(self, out: Outgoing, end: Callable[[], bytes]) -> str | None:
        src_base = tuple(addr for addr, _ in self._engine.register(out.src_pool))
        chunks = chunked(out.copy_runs(), self.chunk_bytes)
        for i, (runs, upto) in enumerate(chunks):
            src = [src_base[k] + s for k, s, _, _ in runs]
            dst = [self._dst_base[k] + d for k, _, d, _ in runs]
            lengths = [n for _, _, _, n in runs]
            rc = self._engine.write(self._session, src, dst, lengths)
            if rc != 0:
                return f"Mooncake batch_transfer_sync_write returned {rc}"
            if i + 1 < len(chunks):  # acknowledged: decode checksums it while the next goes
                self.send_progress(out.manifest.room, upto)
        self.send_end(end())
        return None


class MooncakeTransport(KVTransport):
    name = "mooncake"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        protocol: str = "tcp",
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.host = host
        self.port = port
        self.protocol = protocol
        self.chunk_bytes = chunk_bytes  # 0: one write per room, decode checks after the end
        self._engine: MooncakeEngine | None = None  # one per transport, shared by its halves

    def engine(self) -> MooncakeEngine:
        if self._engine is None:
            self._engine = MooncakeEngine(self.host, self.protocol)
        return self._engine

    def receiver(self, pool: KVPool) -> MooncakeReceiver:
        return MooncakeReceiver(pool, self.engine(), self.host, self.port)

    def sender(self, address: str) -> MooncakeSender:
        return MooncakeSender(address, self.engine(), self.chunk_bytes)
