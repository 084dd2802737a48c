"""A KV transport's two halves in one process: the single process's link (serve/pipeline.py).

`kvfence serve` runs prefill and decode in one process; this is how their KV
still goes through the transport contract (grant, manifest, reconcile,
deferred release) instead of a shortcut. `inprocess_link` is the embedded
default; any `KVTransport` fits (`TransportLink.open(get_transport("tcp"), pool)`).
"""

from __future__ import annotations

from kvfence.engine.prefill import OutboundTransfer
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import (
    KVReceiver,
    KVSender,
    KVTransport,
    TransferRefused,
    TransportClosed,
)
from kvfence.transfer.inprocess import InProcessTransport
from kvfence.transfer.rooms import Event


class TransportLink:
    """Decode's receiver and a sender connected to it: the two roles' KV halves in one process."""

    def __init__(self, receiver: KVReceiver, sender: KVSender) -> None:
        self.receiver = receiver
        self.sender = sender

    @classmethod
    def open(cls, transport: KVTransport, pool: KVPool) -> TransportLink:
        """Receive into `pool` (decode's) and connect a sender to it."""
        receiver = transport.receiver(pool)
        return cls(receiver, transport.sender(receiver.address))

    @property
    def window(self) -> KVReceiver:
        return self.receiver

    def send(self, transfer: OutboundTransfer, src: KVPool) -> bool:
        try:
            self.sender.send(transfer, src)
        except (TransferRefused, TransportClosed, OSError):
            return False  # a refusal also reaches decode, through `poll` (I3)
        return True

    def poll(self) -> list[Event]:
        return self.receiver.poll()

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def inprocess_link(pool: KVPool) -> TransportLink:
    """The embedded default: the in-process transport into decode's `pool`."""
    return TransportLink.open(InProcessTransport(), pool)
