"""The engine's side of the KV transport seam: what the in-process pipeline needs from a transport.

The engine defines this seam and never implements it. `transfer`
implements it over any `KVTransport` (`transfer.link.TransportLink`;
the embedded default is the in-process transport), so single-process
serving runs the same contract as TCP and shared memory: the receiver grants
the room before a byte is written, the manifest travels with the payload,
decode reconciles it against its reservation (I3), and released pages wait
in PENDING_RELEASE until the transport confirms the room is over (I7).
Layering: the engine imports no serve code (tests/arch/test_layering.py).

`apply_transfer_events` is decode's handling of what a receiver reports, the
same for the in-process pipeline and the decode worker process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvfence.engine.decode import DecodeEngine, InboundWindow
from kvfence.engine.messages import ErrorInfo, Failure, TransferDone, TransferManifest
from kvfence.engine.prefill import OutboundTransfer
from kvfence.kv.pool import KVPool

TRANSFER_INCOMPLETE = "KV transfer did not complete (sender gone or transfer refused)"


class Arrival(Protocol):
    """A payload that landed in decode's pages (`transfer.Landed`).

    `checksum` is what the receiver measured as the bytes landed, or None when
    the sender wrote in place: then decode checksums its own pages.
    """

    @property
    def manifest(self) -> TransferManifest: ...

    @property
    def checksum(self) -> str | None: ...


class KVLink(Protocol):
    """A transport's two halves, as one process that runs both roles sees them.

    `window`: decode's receiver; decode calls `expect` when it hands out a
    reservation and `cancel` when it gives up (InboundWindow, I7).
    `send`: prefill's half. Asks the receiver for a grant, writes the payload
    into the granted pages and sends the manifest; False when the transfer
    was refused or failed (the receiver reports the refusal through `poll`).
    `poll`: everything that landed or ended since the last call, in order;
    a room's `TransferDone` ends its inbound window, so only after it may
    its released pages be reused (I7).
    """

    @property
    def window(self) -> InboundWindow: ...

    def send(self, transfer: OutboundTransfer, src: KVPool) -> bool: ...

    def poll(self) -> Sequence[Arrival | TransferDone]: ...


KVLinkFactory = Callable[[KVPool], KVLink]  # decode's pool -> the link that writes into it


def apply_transfer_events(
    decode: DecodeEngine, events: Iterable[Arrival | TransferDone]
) -> list[Failure]:
    """Hand decode what landed (it reconciles, I3); fail rows whose transfer ended without landing.

    Returns the failures for the router: one per row that was still waiting
    for its KV when its room ended (cancelled, refused, or the sender died).
    """
    failures = []
    for event in events:
        if not isinstance(event, TransferDone):
            decode.on_transfer(event.manifest, event.checksum)
        elif not event.ok and decode.awaiting_transfer(event.room):
            decode.abort(event.room, "KV transfer did not complete")
            failures.append(
                Failure(event.room, ErrorInfo(502, "transfer_failed", TRANSFER_INCOMPLETE))
            )
    return failures
