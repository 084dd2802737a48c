"""The KV transport contract: how prefill's KV reaches decode's reserved pages (I3, I7).

Two halves, one per role, made by a `KVTransport` (one per backend, see
`registry.py`):

* `KVSender` (prefill): `send(transfer, src_pool)` moves the first
  `transfer.num_tokens` positions of `transfer.src_pages` into the
  destination pages decode granted (`transfer.dest_pages`), and returns the
  `TransferManifest` it sent. The manifest's checksum is over what was sent
  (`engine.reconcile.payload_checksum` of the source pages).
* `KVReceiver` (decode), polled from decode's step loop, never blocking:
  `expect(reservation)` when the pages are handed out (from then on a
  transfer may land: the pool marks them inbound, I7); `poll()` returns
  `Landed` (the payload is in the pages, with the checksum of what landed)
  and `TransferDone` (nothing more will land for that room: finished,
  cancelled, refused, or the sender died); decode reconciles each `Landed`
  against its reservation (I3, `DecodeEngine.on_transfer`); `cancel(room)`
  gives up on a transfer. Pages are released by decode whenever it likes; the pool
  holds released-but-inbound pages in PENDING_RELEASE until `poll()` sees the
  room's `TransferDone` and ends the inbound window (I7).

Write permission: a sender writes into decode's pages only after the
receiver grants the room (the room is expected, not cancelled, and the
manifest's destination handles are exactly the reserved ones). A cancel
before the grant is confirmed at once; after the grant it is confirmed only
when the sender finishes or is known dead (its connection closed).

Where the pieces live: this module is the contract; `layout.py` lays a
transfer out in bytes and copies runs; `rooms.py` is the receiver's room book
(grants and the event queue); `link.py` runs a transport's two halves inside
one process for the engine's `LocalPipeline`.

Backends here: in-process (pool to pool copy, the embedded default of
`kvfence serve`), TCP (the payload streamed
straight into the reserved pages' memory; the receiver decides where bytes
go) and shared memory (decode's pool lives in /dev/shm; prefill writes the
pages itself, as RDMA does, after a grant over a control socket).

Plugging in GPU RDMA (NIXL, Mooncake transfer engine): such a backend is a
`KVTransport` whose `create_pool` registers decode's K/V tensors with the
engine (NIXL `register_memory`, Mooncake `register_memory`) and whose hello
carries the remote memory descriptors instead of a /dev/shm path.
`Outgoing.copy_runs()` already yields (kind, src offset, dst offset, length)
runs, merged where contiguous on both sides: they map one to one onto a
NIXL transfer descriptor list or Mooncake `batch_transfer_sync_write`
requests. The grant / progress / end handshake stays on the control socket
(`granted.py`: `B`/`G`, a `P` per chunk written, `E` carrying the checksum
the sender computed while posting the writes), and the receiver checksums its
own pages as each `P` and the `E` say they are written; a device-side checksum
kernel would do that read on GPU pools. Nothing above the transport changes.

Cost of the independent check: where the sender writes in place, decode must
read every landed byte once to checksum it (about one memcpy-read of the
payload), done chunk by chunk while the next chunk is written; over TCP the
receiver checksums each MiB as it lands. Either way reconciliation itself is
only the manifest comparison (bench/transfer.py).
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
from kvfence.serve.transfer.layout import Outgoing, PoolShape, prepare_outgoing
from kvfence.serve.transfer.rooms import Event, RoomBook


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
