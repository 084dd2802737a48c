"""Prefill's senders: one per decode KV address, opened on first use, dropped when broken."""

from __future__ import annotations

from kvfence.engine.prefill import OutboundTransfer
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import (
    InPlaceSender,
    KVSender,
    KVTransport,
    TransferRefused,
    TransportClosed,
)
from kvfence.transfer.lab_holds import LabHold


class Senders:
    def __init__(self, transport: KVTransport, hold: LabHold | None = None) -> None:
        self.transport = transport
        self.hold = hold
        self._open: dict[str, KVSender] = {}

    def send(self, addr: str, transfer: OutboundTransfer, pool: KVPool) -> str | None:
        """Send `transfer` to decode at `addr`: None when sent, else why it was not.

        A refusal (decode said no: room unknown, shape mismatch) keeps the connection;
        any other failure closes it, so the next transfer opens a fresh one.
        """
        try:
            sender = self._open.get(addr)
            if sender is None:
                sender = self._open[addr] = self.transport.sender(addr)
            self._transmit(sender, transfer, pool)
            return None
        except (TransferRefused, TransportClosed, OSError, ValueError) as e:
            broken = self._open.pop(addr, None)
            if broken is not None and not isinstance(e, TransferRefused):
                broken.close()
            return f"KV transfer to decode failed: {e}"

    def _transmit(self, sender: KVSender, transfer: OutboundTransfer, pool: KVPool) -> None:
        if self.hold is None or not isinstance(sender, InPlaceSender):
            sender.send(transfer, pool)
            return
        out = sender.prepare(transfer, pool)
        sender.begin(out)  # granted: from here the transfer is in flight (I7)
        held = self.hold.wait(transfer.room)
        try:
            sender.complete(out)
        except Exception as e:
            if held:
                self.hold.sent(transfer.room, f"failed: {e}")
            raise
        if held:
            self.hold.sent(transfer.room, "ok")

    def close(self) -> None:
        for sender in self._open.values():
            sender.close()
        self._open.clear()
