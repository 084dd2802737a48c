"""The room book: which rooms a receiver lets write, and the events decode polls (I3, I7).

Shared by a receiver's transport threads and decode's thread. Transport
threads only ask for a grant, write the page bytes they were granted and
queue events; only decode's thread touches the pool ledger (in
`KVReceiver.expect/poll`), so the ledger needs no lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvfence.engine.messages import PageRef, TransferDone, TransferManifest


@dataclass(frozen=True, slots=True)
class Landed:
    """The payload for `manifest.room` is in the pages.

    `checksum` is what the receiver measured while the bytes landed (TCP), or
    None when the sender wrote in place (in-process, shared memory, RDMA):
    then decode checksums its own pages (`DecodeEngine.on_transfer`). A receiver that refused to
    write puts ``refused: <why>`` here, which no manifest checksum equals.
    """

    manifest: TransferManifest
    checksum: str | None


Event = Landed | TransferDone


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
    # Called (from the transport's thread) after an event is queued: wakes decode's loop.
    on_event: Callable[[], None] | None = None

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
        self._notify()

    def landed(self, manifest: TransferManifest, checksum: str | None) -> None:
        """The granted payload is in place and nothing more will be written for it."""
        with self._lock:
            room = self._rooms.get(manifest.room)
            if room is None or not room.started:
                return
            if not room.cancelled:
                self._events.append((Landed(manifest, checksum), ()))
            self._end(manifest.room, ok=not room.cancelled)
        self._notify()

    def lost(self, rooms: Sequence[str]) -> None:
        """The sender of these (granted) rooms is dead: nothing more can land (I7)."""
        with self._lock:
            for r in rooms:
                if r in self._rooms and self._rooms[r].started:
                    self._end(r, ok=False)
        self._notify()

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

    def _notify(self) -> None:
        if self.on_event is not None:
            self.on_event()

    def drain(self) -> list[tuple[Event, tuple[int, ...]]]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def waiting(self) -> list[str]:
        with self._lock:
            return list(self._rooms)
