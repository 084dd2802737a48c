"""The KV transport contract: how prefill's KV reaches decode's reserved pages (I3, I7).

Two halves, one per role, made by a `KVTransport` (one per backend, see
`registry.py`):

* `KVSender` (prefill): `send(room, src_pool, src_handles, num_tokens, dest,
  fields)` moves the first `num_tokens` positions of `src_handles` into the
  destination pages `dest` that decode granted, and returns the
  `TransferManifest` it sent. The manifest's checksum is over what was sent
  (`engine.reconcile.payload_checksum` of the source pages).
* `KVReceiver` (decode), polled from decode's step loop, never blocking:
  `expect(reservation)` when the pages are handed out (from then on a
  transfer may land: the pool marks them inbound, I7); `poll()` returns
  `Landed` (the payload is in the pages, with the checksum of what landed)
  and `TransferDone` (nothing more will land for that room: finished,
  cancelled, refused, or the sender died); `Landed.accept(reservation, pool)`
  runs `reconcile` (I3) and marks the pages written; `cancel(room)` gives up
  on a transfer. Pages are released by decode whenever it likes; the pool
  holds released-but-inbound pages in PENDING_RELEASE until `poll()` sees the
  room's `TransferDone` and ends the inbound window (I7).

Write permission: a sender writes into decode's pages only after the
receiver grants the room (the room is expected, not cancelled, and the
manifest's destination handles are exactly the reserved ones). A cancel
before the grant is confirmed at once; after the grant it is confirmed only
when the sender finishes or is known dead (its connection closed).

Backends here: in-process (pool to pool copy), TCP (the payload streamed
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
requests. The grant / end handshake stays on the control socket
(the shared-memory backend's `B`/`G`/`E` frames, `E` carrying the checksum
the sender computed while posting the writes), the receiver reports
`Landed(checksum=None)` and decode checksums its own pages before decoding;
a device-side checksum kernel would replace `payload_checksum` on GPU pools.
Nothing above the transport changes.

Cost of the independent check: where the sender writes in place, decode must
read every landed byte once to checksum it (about one memcpy-read of the
payload); over TCP the receiver checksums each MiB as it lands, so
reconciliation itself is only the manifest comparison (bench/transfer.py).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvfence.engine.messages import PageRef, TransferDone, TransferManifest
from kvfence.engine.reconcile import (
    Reservation,
    StreamChecksum,
    coalesce,
    payload_checksum,
    payload_segments,
    reconcile,
)
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool, PageHandle


class TransferRefused(Exception):
    """The receiver would not let this transfer write (room unknown or cancelled, stale pages)."""


class TransportClosed(Exception):
    """The other side went away."""


@dataclass(frozen=True, slots=True)
class ManifestFields:
    """Manifest fields the sender cannot derive from the pages."""

    tenant: str
    first_token: int
    first_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int = 0
    prefill_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What a sender must know about the receiver's pool to address its pages."""

    geometry: KVGeometry
    num_pages: int

    def to_json(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "num_layers": g.num_layers,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "page_size": g.page_size,
            "dtype": g.dtype,
            "num_pages": self.num_pages,
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> PoolShape:
        geometry = KVGeometry(
            num_layers=int(obj["num_layers"]),
            num_kv_heads=int(obj["num_kv_heads"]),
            head_dim=int(obj["head_dim"]),
            page_size=int(obj["page_size"]),
            dtype=str(obj["dtype"]),
        )
        return PoolShape(geometry, int(obj["num_pages"]))


@dataclass(frozen=True, slots=True)
class Landed:
    """The payload for `manifest.room` is in the pages.

    `checksum` is what the receiver measured while the bytes landed (TCP), or
    None when the sender wrote in place (in-process, shared memory, RDMA):
    then `accept` checksums decode's own pages. A receiver that refused to
    write puts ``refused: <why>`` here, which no manifest checksum equals.
    """

    manifest: TransferManifest
    checksum: str | None

    def accept(self, reservation: Reservation, pool: KVPool) -> None:
        """Reconcile against the reservation (I3); raises `TransferMismatch`; marks written on success."""
        checksum = self.checksum
        if checksum is None:
            checksum = payload_checksum(pool, reservation.handles, reservation.num_tokens)
        reconcile(self.manifest, reservation, pool, checksum)


Event = Landed | TransferDone


@dataclass(slots=True)
class Outgoing:
    """A prepared transfer: the manifest and, per canonical segment, where bytes come from and go.

    Arrays are parallel, one row per (kind, layer, page) in canonical order:
    kind (0 = K, 1 = V), src/dst byte offsets into the K or V storage,
    lengths and the page position in the table.
    """

    manifest: TransferManifest
    src_pool: KVPool
    kinds: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    positions: np.ndarray
    # The source runs as prepared (kind, offset, length): what the checksum covers,
    # whatever happens to the arrays above before transmission.
    canonical: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def payload_bytes(self) -> int:
        return int(self.lengths.sum())

    def src_runs(self) -> list[tuple[int, int, int]]:
        """(kind, src offset, length), merged where the source is contiguous: the stream order."""
        return [(k, s, n) for k, s, _, n in self._runs(check_dst=False)]

    def copy_runs(self) -> list[tuple[int, int, int, int]]:
        """(kind, src offset, dst offset, length), merged where both sides are contiguous."""
        return self._runs(check_dst=True)

    def _runs(self, *, check_dst: bool) -> list[tuple[int, int, int, int]]:
        k, s, d, n = self.kinds, self.src_offsets, self.dst_offsets, self.lengths
        if len(k) == 0:
            return []
        follows = (k[1:] == k[:-1]) & (s[1:] == s[:-1] + n[:-1])
        if check_dst:
            follows &= d[1:] == d[:-1] + n[:-1]
        starts = np.flatnonzero(np.concatenate([[True], ~follows]))
        ends = np.concatenate([starts[1:], [len(k)]])
        sums = np.concatenate([[0], np.cumsum(n)])
        return [
            (int(k[a]), int(s[a]), int(d[a]), int(sums[b] - sums[a]))
            for a, b in zip(starts, ends, strict=True)
        ]


def prepare_outgoing(
    room: str,
    src_pool: KVPool,
    src_handles: Sequence[PageHandle],
    num_tokens: int,
    dest: Sequence[PageRef],
    fields: ManifestFields,
    dest_shape: PoolShape,
    *,
    checksum_now: bool = True,
) -> Outgoing:
    """Lay out a transfer and write its manifest (the checksum is over the source pages).

    With `checksum_now=False` the manifest's checksum is left empty: the sender
    fills it while it copies (`copy_runs_into`), saving a pass over the payload.
    """
    if src_pool.geometry != dest_shape.geometry:
        raise ValueError(
            f"sender geometry {src_pool.geometry} != receiver geometry {dest_shape.geometry}"
        )
    if num_tokens < 1:
        raise ValueError(f"a transfer carries at least one token, got {num_tokens}")
    num_pages = src_pool.geometry.pages_for(num_tokens)
    if len(dest) < num_pages:
        raise ValueError(f"{num_tokens} tokens need {num_pages} destination pages, got {len(dest)}")
    src_idx = [h.index for h in src_handles]
    kinds, src_off, lengths, positions = payload_segments(src_pool, src_idx, num_tokens)
    dst_off = _dest_offsets(dest_shape, [r.index for r in dest[:num_pages]], positions, kinds)
    manifest = TransferManifest(
        room=room,
        tenant=fields.tenant,
        num_tokens=num_tokens,
        num_pages=num_pages,
        dest_pages=tuple(dest),
        checksum=payload_checksum(src_pool, src_handles, num_tokens) if checksum_now else "",
        first_token=fields.first_token,
        first_logprobs=fields.first_logprobs,
        cached_tokens=fields.cached_tokens,
        prefill_s=fields.prefill_s,
    )
    canonical = coalesce(kinds, src_off, lengths)
    return Outgoing(manifest, src_pool, kinds, src_off, dst_off, lengths, positions, canonical)


def _dest_offsets(
    shape: PoolShape, dest_idx: list[int], positions: np.ndarray, kinds: np.ndarray
) -> np.ndarray:
    g = shape.geometry
    if any(not 0 <= i < shape.num_pages for i in dest_idx):
        raise ValueError(f"destination pages {dest_idx} outside a pool of {shape.num_pages}")
    tb = g.num_kv_heads * g.head_dim * g.dtype_bytes
    per_kind = len(kinds) // 2
    layer = (np.arange(len(kinds)) % per_kind) // max(len(dest_idx), 1)
    pages = np.asarray(dest_idx, dtype=np.int64)[positions]
    return (layer * shape.num_pages + pages) * (g.page_size * tb)


# ---- receiver bookkeeping -------------------------------------------------------------------


@dataclass(slots=True)
class _Room:
    refs: tuple[PageRef, ...]
    indices: tuple[int, ...]
    started: bool = False
    cancelled: bool = False


@dataclass(slots=True)
class RoomBook:
    """Which rooms may be written, and the event queue; shared by receiver threads and decode.

    Only decode's thread touches the pool ledger (in `KVReceiver.expect/poll`);
    transport threads only write page bytes they were granted and queue events.
    """

    page_size: int
    _rooms: dict[str, _Room] = field(default_factory=dict)
    _events: deque[tuple[Event, tuple[int, ...]]] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def expect(self, room: str, refs: tuple[PageRef, ...]) -> None:
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room!r} is already expecting a transfer")
            self._rooms[room] = _Room(refs, tuple(r.index for r in refs))

    def forget(self, room: str) -> None:
        """Drop a room that never became writable (its pages were never marked inbound)."""
        with self._lock:
            self._rooms.pop(room, None)

    def grant(self, manifest: TransferManifest) -> str | None:
        """None if the sender may now write this room's pages, else why not (then the room ends)."""
        with self._lock:
            why = self._refusal(manifest)
            if why is None:
                self._rooms[manifest.room].started = True
                return None
        self.refuse(manifest, why)
        return why

    def _refusal(self, m: TransferManifest) -> str | None:
        room = self._rooms.get(m.room)
        if room is None:
            return f"room {m.room!r} is not expecting a transfer (unknown, cancelled or done)"
        if room.started:
            return f"room {m.room!r} already has a transfer (duplicate)"
        if m.dest_pages != room.refs:
            return "destination pages are not the reserved ones (stale or foreign handles)"
        if not 1 <= m.num_tokens <= len(room.refs) * self.page_size:
            return f"{m.num_tokens} tokens do not fit the {len(room.refs)} reserved pages"
        return None

    def refuse(self, manifest: TransferManifest, why: str) -> None:
        """Nothing was written; decode sees a `Landed` that fails reconciliation, then the room ends."""
        with self._lock:
            # Always reported: a duplicate for a room in flight fails that request loudly.
            self._events.append((Landed(manifest, f"refused: {why}"), ()))
            room = self._rooms.get(manifest.room)
            if room is not None and not room.started:
                self._end(manifest.room, ok=False)

    def landed(self, manifest: TransferManifest, checksum: str | None) -> None:
        """The granted payload is in place and nothing more will be written for it."""
        with self._lock:
            room = self._rooms.get(manifest.room)
            if room is None or not room.started:
                return
            if not room.cancelled:
                self._events.append((Landed(manifest, checksum), ()))
            self._end(manifest.room, ok=not room.cancelled)

    def lost(self, rooms: Sequence[str]) -> None:
        """The sender of these (granted) rooms is dead: nothing more can land (I7)."""
        with self._lock:
            for r in rooms:
                if r in self._rooms and self._rooms[r].started:
                    self._end(r, ok=False)

    def cancel(self, room: str) -> None:
        """Decode gives up. Before a grant the room ends now; after it, when the sender is done or dead."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return
            state.cancelled = True
            if not state.started:
                self._end(room, ok=False)

    def _end(self, room: str, *, ok: bool) -> None:
        state = self._rooms.pop(room)
        self._events.append((TransferDone(room=room, ok=ok), state.indices))

    def drain(self) -> list[tuple[Event, tuple[int, ...]]]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def waiting(self) -> list[str]:
        with self._lock:
            return list(self._rooms)


# ---- the two halves -------------------------------------------------------------------------


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

    def prepare(
        self,
        room: str,
        src_pool: KVPool,
        src_handles: Sequence[PageHandle],
        num_tokens: int,
        dest: Sequence[PageRef],
        fields: ManifestFields,
    ) -> Outgoing:
        return prepare_outgoing(
            room,
            src_pool,
            src_handles,
            num_tokens,
            dest,
            fields,
            self.dest_shape,
            checksum_now=not self.checksum_while_copying,
        )

    def send(
        self,
        room: str,
        src_pool: KVPool,
        src_handles: Sequence[PageHandle],
        num_tokens: int,
        dest: Sequence[PageRef],
        fields: ManifestFields,
    ) -> TransferManifest:
        """Move the payload into `dest` and return the manifest sent with it.

        Raises `TransferRefused` where the receiver answers before the payload
        moves (in-place backends); over TCP a refusal is decode's to report.
        """
        out = self.prepare(room, src_pool, src_handles, num_tokens, dest, fields)
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


COPY_CHUNK = 1 << 20  # copy then checksum a MiB at a time, while it is still in cache


def copy_runs_into(
    out: Outgoing, dst: tuple[memoryview, memoryview], src: tuple[memoryview, memoryview]
) -> str:
    """Write a prepared transfer straight into destination memory; return the source checksum.

    The checksum covers the canonical source runs (what the manifest promises),
    computed chunk by chunk right after each chunk is copied, so it costs no
    extra pass over memory when the copy follows the canonical order.
    """
    dst_np = (np.frombuffer(dst[0], np.uint8), np.frombuffer(dst[1], np.uint8))
    src_np = (np.frombuffer(src[0], np.uint8), np.frombuffer(src[1], np.uint8))
    cursor = _ChecksumCursor(out.canonical, src)
    for kind, s, d, n in out.copy_runs():
        for start in range(0, n, COPY_CHUNK):
            m = min(COPY_CHUNK, n - start)
            np.copyto(
                dst_np[kind][d + start : d + start + m], src_np[kind][s + start : s + start + m]
            )
            cursor.advance(m)
    return cursor.finish()


class _ChecksumCursor:
    """Checksums canonical source runs, a given number of bytes at a time."""

    def __init__(
        self, runs: list[tuple[int, int, int]], src: tuple[memoryview, memoryview]
    ) -> None:
        self._runs = deque(runs)
        self._src = src
        self._h = StreamChecksum()

    def advance(self, nbytes: int) -> None:
        while nbytes > 0 and self._runs:
            kind, off, n = self._runs[0]
            take = min(n, nbytes)
            self._h.update(self._src[kind][off : off + take])
            nbytes -= take
            if take == n:
                self._runs.popleft()
            else:
                self._runs[0] = (kind, off + take, n - take)

    def finish(self) -> str:
        self.advance(sum(n for _, _, n in self._runs))
        return self._h.hexdigest()


def receive_layout(pool: KVPool, manifest: TransferManifest) -> list[tuple[int, int, int]]:
    """Where a granted payload goes in decode's pool, in stream order (kind, offset, length)."""
    kinds, offsets, lengths, _ = payload_segments(
        pool, [r.index for r in manifest.dest_pages], manifest.num_tokens
    )
    return coalesce(kinds, offsets, lengths)
