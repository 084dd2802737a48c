"""In-process transport: prefill and decode share a process; pages are copied pool to pool.

The embedded default (single-process serving). It keeps the whole contract:
the grant, the manifest, reconciliation and deferred release are the same as
across processes, so single-process mode exercises I3 and I7 too.
"""

from __future__ import annotations

import dataclasses

from kvfence.engine.reconcile import byte_views
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import InPlaceSender, KVReceiver, KVTransport, TransferRefused
from kvfence.transfer.layout import Outgoing, PoolShape, copy_runs_into


class InProcessReceiver(KVReceiver):
    def __init__(self, pool: KVPool, address: str) -> None:
        super().__init__(pool)
        self._address = address

    @property
    def address(self) -> str:
        return self._address

    def close(self) -> None:
        """Nothing to stop: senders call into this object directly."""


class InProcessSender(InPlaceSender):
    def __init__(self, receiver: InProcessReceiver) -> None:
        self._receiver = receiver

    @property
    def dest_shape(self) -> PoolShape:
        pool = self._receiver.pool
        return PoolShape(pool.geometry, pool.num_pages)

    def begin(self, out: Outgoing) -> None:
        why = self._receiver.book.grant(out.manifest)
        if why is not None:
            raise TransferRefused(why)

    def complete(self, out: Outgoing) -> None:
        checksum = copy_runs_into(out, byte_views(self._receiver.pool), byte_views(out.src_pool))
        out.manifest = dataclasses.replace(out.manifest, checksum=checksum)
        self._receiver.book.landed(out.manifest, None)

    def close(self) -> None:
        """Nothing to close."""


class InProcessTransport(KVTransport):
    name = "inprocess"

    def __init__(self) -> None:
        self._receivers: dict[str, InProcessReceiver] = {}

    def receiver(self, pool: KVPool) -> InProcessReceiver:
        address = f"inproc://{len(self._receivers) + 1}"
        receiver = InProcessReceiver(pool, address)
        self._receivers[address] = receiver
        return receiver

    def sender(self, address: str) -> InProcessSender:
        try:
            return InProcessSender(self._receivers[address])
        except KeyError:
            raise ValueError(f"no in-process receiver at {address!r}") from None
