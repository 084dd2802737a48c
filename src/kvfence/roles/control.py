"""The control-plane seam between a role and the coordinator that drives it.

Each turn of a role reads as the data flow: the coordinator hands it what
arrived (`receive`: typed messages, already checked and paired), the role
steps its engine, then hands back what the step produced, one method per
kind of output. The coordinator decides where each output goes (the hub's
router, a paired worker's reply inbox, an HTTP request's sink) and when a
status or a ledger check is due (`turn_done`).

Every method is called from the role's one engine thread, the thread that
also uses the coordinator's sockets (a ZeroMQ socket belongs to one thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from kvfence.engine.messages import (
    Abort,
    Bootstrap,
    BootstrapReady,
    Failure,
    PrefillWork,
    TokenChunk,
    TransferDone,
)
from kvfence.engine.prefill import OutboundTransfer

PrefillInput = PrefillWork | Abort
# TransferDone in: prefill says it will never send a room's KV (only ok=False is acted on).
DecodeInput = Bootstrap | Abort | TransferDone


class PrefillControl(Protocol):
    def receive(self, busy: bool) -> Sequence[PrefillInput]:
        """What arrived since the last turn, in order; waits for the idle poll when not busy.
        A `PrefillWork`'s `decode_addr` is where its KV goes."""

    def cores(self, busy: bool) -> AbstractContextManager[None]:
        """Around the turn's step (taken or not): the cores it runs on, and when."""

    def refused(self, failure: Failure) -> None:
        """The engine refused or failed a room (I2: over the pool is terminal)."""

    def note(self, note: Abort | TransferDone) -> None:
        """For the decode that holds the room (TransferDone: after its KV send, I7)."""

    def transfer_failed(self, failure: Failure) -> None:
        """The room's KV could not be sent (a 502 naming why); nothing of it will land."""

    def transferred(self, transfer: OutboundTransfer) -> None:
        """The room's KV is at decode; prefill's pages are already released (I7)."""

    def turn_done(self, progressed: bool) -> None:
        """End of the turn: status pacing, the ledger check at a quiet point."""


class DecodeControl(Protocol):
    def receive(self, busy: bool) -> Sequence[DecodeInput]:
        """What arrived since the last turn, in order; waits for the idle poll (or the
        receiver's waker) when not busy."""

    def cores(self, busy: bool) -> AbstractContextManager[None]:
        """Around the turn's step (taken or not): the cores it runs on, and when."""

    def ready(self, ready: BootstrapReady) -> None:
        """Pages are reserved for a room: prefill may now write into exactly them."""

    def refused(self, failure: Failure) -> None:
        """A bootstrap was refused (a room in use, I9; a prompt over the pool, I2)."""

    def event(self, event: TokenChunk | Failure) -> None:
        """Tokens for a room, its end, or its failure (a transfer that never landed, I6)."""

    def turn_done(self, progressed: bool) -> None:
        """End of the turn: status pacing, expiry, the ledger check at a quiet point."""
