"""Prefill's senders: one per decode KV address, opened on first use, dropped when broken."""

from __future__ import annotations

from kvfence.engine.prefill import OutboundTransfer
from kvfence.kv.pool import KVPool
from kvfence.serve.transfer.base import KVSender, KVTransport, TransferRefused, TransportClosed


class Senders:
    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
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
            sender.send(transfer, pool)
            return None
        except (TransferRefused, TransportClosed, OSError, ValueError) as e:
            broken = self._open.pop(addr, None)
            if broken is not None and not isinstance(e, TransferRefused):
                broken.close()
            return f"KV transfer to decode failed: {e}"

    def close(self) -> None:
        for sender in self._open.values():
            sender.close()
        self._open.clear()
