"""The KV transport contract: how prefill's KV reaches decode's reserved pages (I3, I7).

A `KVTransport` (one per backend) makes decode's pool where the backend needs
it, and the two halves:

* `KVSender` (prefill): `send(transfer, src_pool)` moves the first
  `transfer.num_tokens` positions of `transfer.src_pages` into the pages decode
  granted (`transfer.dest_pages`) and returns the `TransferManifest` it sent,
  its checksum over what was sent.
* `KVReceiver` (decode), polled from decode's loop, never blocking:
  `expect(reservation)` when the pages are handed out (from then on a transfer
  may land: they are inbound, I7); `poll()` returns `Landed` (the payload is in
  the pages, with the checksum of what is there, which decode reconciles
  against its reservation, I3) and `TransferDone` (nothing more will land for
  the room); `cancel(room)` gives up. Released pages still inbound stay
  PENDING_RELEASE until `poll()` has seen the room's `TransferDone` (I7).

A sender writes decode's pages only after the receiver grants the room: the
room is expected, not cancelled, and the manifest's destination handles are
exactly the reserved ones. A cancel after the grant is confirmed only once the
sender finishes or is known dead (its connection closed).

The backends (`registry.py` names them): in-process (pool to pool copy, for
single-process serving), TCP (the receiver streams the payload into the
reserved pages) and three that write decode's memory themselves after a grant
on a control socket (`granted.py`): shared memory, Mooncake's transfer engine
and NIXL. `layout.py` lays a transfer out as copy runs, which each backend
moves its own way; `rooms.py` is the receiver's room book.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from kvfence.engine.messages import TransferDone, TransferManifest
from kvfence.engine.prefill import OutboundTransfer
from kvfence.engine.reconcile import Reservation
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool
from kvfence.transfer.layout import Outgoing, PoolShape, prepare_outgoing
from kvfence.transfer.rooms import Event, RoomBook


class TransferRefused(Exception):
    """The receiver would not let this transfer write (room unknown or cancelled, stale pages)."""


class TransportClosed(Exception):
    """The other side went away."""


class KVReceiver(ABC):
    """Decode's half. All methods are called from decode's thread and never block."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.book = RoomBook(pool.page_size)

    @property
    @abstractmethod
    def address(self) -> str:
        """Where senders connect (`KVTransport.sender(address)`)."""

    def expect(self, reservation: Reservation) -> None:
        """The reservation's pages are handed to prefill: a transfer may land from now on (I7)."""
        self.book.expect(reservation.room, reservation.refs)  # a duplicate room raises here (I9)
        try:
            self.pool.begin_inbound(reservation.handles)  # stale handles raise here
        except Exception:
            self.book.forget(reservation.room)
            raise

    def poll(self) -> list[Event]:
        """Everything that happened since the last poll; ends the inbound window of finished rooms."""
        events = []
        for event, indices in self.book.drain():
            if isinstance(event, TransferDone):
                self.pool.end_inbound(indices)  # I7: only now may released pages be reused
            events.append(event)
        return events

    def notify(self, callback: Callable[[], None]) -> None:
        """`callback` runs (on a transport thread) whenever an event is ready for `poll`."""
        self.book.on_event = callback

    def cancel(self, room: str) -> None:
        """Stop expecting `room`. Its `TransferDone(ok=False)` arrives via `poll` once safe."""
        self.book.cancel(room)

    def waiting(self) -> list[str]:
        """Rooms whose transfer has not ended yet."""
        return self.book.waiting()

    @abstractmethod
    def close(self) -> None:
        """Stop receiving. Rooms still in flight are not confirmed: their pages stay inbound."""


class KVSender(ABC):
    """Prefill's half, connected to one receiver."""

    # True where the sender checksums while it copies and sends the checksum last.
    checksum_while_copying: ClassVar[bool] = False

    @property
    @abstractmethod
    def dest_shape(self) -> PoolShape:
        """The receiver's pool shape (from its hello)."""

    def prepare(self, transfer: OutboundTransfer, src_pool: KVPool) -> Outgoing:
        """Lay out `transfer` against the receiver's pool (tests alter the result to fake faults)."""
        checksum_now = not self.checksum_while_copying
        return prepare_outgoing(transfer, src_pool, self.dest_shape, checksum_now=checksum_now)

    def send(self, transfer: OutboundTransfer, src_pool: KVPool) -> TransferManifest:
        """Move the payload into the granted pages and return the manifest sent with it.

        Raises `TransferRefused` where the receiver answers before the payload
        moves (in-place backends); over TCP a refusal is decode's to report.
        """
        out = self.prepare(transfer, src_pool)
        self.transmit(out)
        return out.manifest

    @abstractmethod
    def transmit(self, out: Outgoing) -> None:
        """Move a prepared transfer (tests may alter `out` first to inject wire faults)."""

    @abstractmethod
    def close(self) -> None: ...


class InPlaceSender(KVSender):
    """A sender that writes decode's memory itself (in-process, shared memory, RDMA).

    Split in two so the grant is explicit: `begin` asks the receiver for the
    room (raises `TransferRefused`), `complete` writes the pages and says so.
    Between the two the transfer is in flight and the pages must not be reused (I7).
    The manifest's checksum is filled in by `complete` (computed while copying)
    and reaches the receiver with the end of the transfer.
    """

    checksum_while_copying = True

    def transmit(self, out: Outgoing) -> None:
        self.begin(out)
        self.complete(out)

    @abstractmethod
    def begin(self, out: Outgoing) -> None: ...

    @abstractmethod
    def complete(self, out: Outgoing) -> None: ...


class KVTransport(ABC):
    """A backend: makes decode's pool (where it must live) and both halves."""

    name: ClassVar[str]

    def create_pool(self, geometry: KVGeometry, num_pages: int, **pool_options: Any) -> KVPool:
        """Decode's pool. Backends that write in place put its storage where senders reach it."""
        return KVPool(geometry, num_pages, **pool_options)

    @abstractmethod
    def receiver(self, pool: KVPool) -> KVReceiver:
        """Start receiving into `pool` (made by `create_pool`)."""

    @abstractmethod
    def sender(self, address: str) -> KVSender:
        """Connect to the receiver at `address`."""
