"""The control seam in one process: the roles' inboxes, the router role's rooms, the sinks.

The single process (serve/pipeline.py) turns both roles on one thread; what one
role's turn hands out waits here for the other's: decode's reservation becomes
prefill's work (engine/routing.py: once, only while the room is open), prefill's
notes (an abort, a transfer that will never come) go to decode's inbox, and
tokens and failures go to the room's sink, each request ending exactly once (I6).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from kvfence.engine.messages import Abort, BootstrapReady, Failure, TokenChunk, TransferDone
from kvfence.engine.prefill import OutboundTransfer
from kvfence.engine.routing import Rooms, is_final
from kvfence.kv.pool import KVPool
from kvfence.roles.control import DecodeInput, PrefillInput
from kvfence.transfer.link import TransportLink

log = logging.getLogger(__name__)


class LinkOut:
    """Prefill's KV half over the in-process link: one decode, whatever address a room names."""

    def __init__(self, link: TransportLink) -> None:
        self.link = link

    def send(self, addr: str, transfer: OutboundTransfer, pool: KVPool) -> str | None:
        if self.link.send(transfer, pool):
            return None
        return "KV transfer to decode failed (refused, or the transport closed)"

    def close(self) -> None:
        return  # the link lives as long as the pipeline


@dataclass(slots=True)
class LocalExchange:
    """The router role's state in one process, and the two roles' inboxes between turns."""

    rooms: Rooms
    to_prefill: list[PrefillInput] = field(default_factory=list)
    to_decode: list[DecodeInput] = field(default_factory=list)
    progressed: bool = False  # a turn produced output since the iteration began

    def deliver(self, event: TokenChunk | Failure) -> None:
        room = self.rooms.target(event)
        if room is None:
            return  # already ended (I6: exactly once)
        try:
            room.sink(event)
        except Exception:
            log.exception("sink for room %s failed; aborting the request", event.room)
            if not is_final(event):
                self.rooms.open.pop(event.room, None)
                self.abort_in_roles(event.room, "sink failed")

    def abort_in_roles(self, room: str, reason: str) -> None:
        self.to_decode.append(Abort(room, reason))
        self.to_prefill.append(Abort(room, reason))

    def ready(self, ready: BootstrapReady) -> None:
        work = self.rooms.ready(ready)
        if work is not None:
            self.to_prefill.append(work)  # decode holds the pages: prefill may write them


class LocalPrefillControl:
    """The prefill role's side of the seam: refusals to the sinks, notes to decode's inbox."""

    def __init__(self, exchange: LocalExchange) -> None:
        self.x = exchange

    def receive(self, busy: bool) -> Sequence[PrefillInput]:
        taken, self.x.to_prefill = self.x.to_prefill, []
        return taken

    def cores(self, busy: bool) -> AbstractContextManager[None]:
        return nullcontext()  # one thread runs both roles: nothing to share

    def refused(self, failure: Failure) -> None:
        self.x.deliver(failure)

    def note(self, note: Abort | TransferDone) -> None:
        self.x.to_decode.append(note)

    def transfer_failed(self, failure: Failure) -> None:
        self.x.deliver(failure)

    def transferred(self, transfer: OutboundTransfer) -> None:
        return  # decode learns of it from its receiver (I3)

    def turn_done(self, progressed: bool) -> None:
        self.x.progressed |= progressed


class LocalDecodeControl:
    """The decode role's side: reservations become prefill work, tokens go to the sinks."""

    def __init__(self, exchange: LocalExchange) -> None:
        self.x = exchange

    def receive(self, busy: bool) -> Sequence[DecodeInput]:
        taken, self.x.to_decode = self.x.to_decode, []
        return taken

    def cores(self, busy: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def ready(self, ready: BootstrapReady) -> None:
        self.x.ready(ready)

    def refused(self, failure: Failure) -> None:
        self.x.deliver(failure)

    def event(self, event: TokenChunk | Failure) -> None:
        self.x.deliver(event)

    def turn_done(self, progressed: bool) -> None:
        self.x.progressed |= progressed
