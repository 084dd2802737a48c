"""The inbound window (I7): while it is open, a transfer may land in a reservation's pages."""

from __future__ import annotations

from typing import Protocol

from kvfence.engine.reconcile import Reservation
from kvfence.kv.pool import KVPool


class InboundWindow(Protocol):
    """Opens and closes the window in which a transfer may land in reserved pages (I7).

    A transport's receiver (`transfer.KVReceiver`) is one; `PoolInbound`
    is the default for transports that tell decode directly (`inbound_closed`).
    """

    def expect(self, reservation: Reservation) -> None:
        """The pages are handed out: from now on a transfer may land (pool.begin_inbound)."""

    def cancel(self, room: str) -> None:
        """Decode gives up on `room`; the window closes once the transport confirms."""


class PoolInbound:
    """The window kept in the pool ledger alone; the transport closes it with `close`."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.open: dict[str, list[int]] = {}

    def expect(self, reservation: Reservation) -> None:
        self.pool.begin_inbound(reservation.handles)
        self.open[reservation.room] = [h.index for h in reservation.handles]

    def cancel(self, room: str) -> None:
        return  # the transport confirms with `close` (I7: never assumed)

    def close(self, room: str) -> None:
        indices = self.open.pop(room, None)
        if indices is not None:
            self.pool.end_inbound(indices)
