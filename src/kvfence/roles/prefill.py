"""The prefill role: work in, one step, refusals and notes out, KV out to decode.

The role owns the prefill engine, its pool and its KV half (the senders, one per
decode KV address). Its coordinator hands it `PrefillWork` (with the decode KV
address the room's pages were granted at) and `Abort`, and hears back what the
step produced. A room's pages are released only after its KV send returned (I7):
`transfer_done` follows the send, never precedes it.

Where decode runs in the same process (the single process, mixed batches), the
role carries the decode engine: decode's rows ride in this role's forward, so the
weights are read once a step, and the decode role's own turn never steps.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from kvfence.engine.counters import Counters
from kvfence.engine.decode import DecodeEngine
from kvfence.engine.messages import Abort, ErrorInfo, Failure, PrefillWork
from kvfence.engine.mixed import mixed_step
from kvfence.engine.prefill import OutboundTransfer, PrefillEngine
from kvfence.kv.pool import KVPool, PageHandle
from kvfence.roles.control import PrefillControl, PrefillInput


class KVOut(Protocol):
    """Prefill's KV half (`transfer.senders.Senders`, or one process's in-process link)."""

    def send(self, addr: str, transfer: OutboundTransfer, pool: KVPool) -> str | None:
        """Send the room's KV to the decode at `addr`: None when sent, else why it was not."""

    def close(self) -> None: ...


class PrefillRole:
    def __init__(
        self, engine: PrefillEngine, senders: KVOut, carries: DecodeEngine | None = None
    ) -> None:
        self.engine = engine
        self.senders = senders
        self.carries = carries  # decode in this process: its rows ride in this role's forward
        self.dest_of: dict[str, str] = {}  # room -> decode KV address, until its KV is sent
        self.transfer_failures = 0

    @property
    def pool(self) -> KVPool:
        return self.engine.pool

    def turn(self, control: PrefillControl) -> None:
        """receive -> step -> refusals and notes -> KV out, then the coordinator's pacing."""
        engine = self.engine
        for msg in control.receive(self.has_work):
            self.take(msg)
        with control.cores(self.has_work):
            if self.carries is not None:
                mixed_step(engine, self.carries)  # decode's rows first, prefill's in the rest
            elif engine.has_work:
                engine.step()
        out = engine.drain()
        for failure in out.to_router:
            self.dest_of.pop(failure.room, None)  # rejected or failed: its KV is never sent
            control.refused(failure)
        for note in out.to_decode:
            control.note(note)
        for t in out.transfers:
            self._send_kv(t, control)
        control.turn_done(bool(out))

    def take(self, msg: PrefillInput) -> None:
        if isinstance(msg, PrefillWork):
            self.dest_of[msg.room] = msg.decode_addr
            self.engine.submit(msg)
        elif isinstance(msg, Abort):
            self.dest_of.pop(msg.room, None)
            self.engine.abort(msg.room, msg.reason)

    def forget(self, room: str) -> None:
        """The coordinator ended the room on its own (the engine failed): its KV goes nowhere."""
        self.dest_of.pop(room, None)

    def _send_kv(self, t: OutboundTransfer, control: PrefillControl) -> None:
        why = self.senders.send(self.dest_of.pop(t.room, ""), t, self.pool)
        if why is not None:
            self.transfer_failures += 1
            control.transfer_failed(Failure(t.room, ErrorInfo(502, "transfer_failed", why)))
        self.engine.transfer_done(t.room, ok=why is None)  # I7: only now may prefill free
        if why is None:
            control.transferred(t)

    # ---- facts for the coordinator's status and health --------------------------------

    @property
    def has_work(self) -> bool:
        """The step can make progress: prefill's work, or the carried decode engine's."""
        return self.engine.has_work or (self.carries is not None and self.carries.has_work)

    @property
    def busy(self) -> bool:
        """Work in the engine, or a room whose KV is still to be sent."""
        return self.engine.has_work or bool(self.dest_of)

    def open_rooms(self) -> list[str]:
        return list(self.dest_of)

    def counters(self) -> Counters:
        cache = self.engine.cache
        return dataclasses.replace(
            self.engine.counters,
            prefix_cache_queried_tokens=cache.queried_tokens,
            prefix_cache_hit_tokens=cache.hit_tokens,
            transfer_failures=self.transfer_failures,
        )

    def evictable_pages(self) -> int:
        return self.engine.cache.num_evictable  # a count kept as references change: no walk

    def outstanding(self) -> list[PageHandle]:
        return self.engine.outstanding_handles()

    def check_ledger(self) -> str:
        return ledger_check(self.pool, self.outstanding())

    def close(self) -> None:
        self.senders.close()


def ledger_check(pool: KVPool, outstanding: list[PageHandle]) -> str:
    """The ledger check at a quiet point (I1/I5/I7 bookkeeping): "ok" or what failed."""
    try:
        pool.check_integrity(outstanding)
    except AssertionError as e:
        return f"integrity check failed: {e}"
    return "ok"
