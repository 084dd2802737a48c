"""The decode role: bootstraps in, what landed (I3), one step, tokens out.

The role owns the decode engine, its pool and the KV receiver. Its coordinator
hands it `Bootstrap`, `Abort` and prefill's `TransferDone(ok=False)`, and hears
back reservations, refusals and token events. What landed is reconciled
against the room's reservation before a token is decoded (I3); a room whose
transfer ended without landing fails (I6) and its window closes (I7).

Where a prefill role in the same process carries this engine (mixed batches),
decode's rows ride in that role's forward: this turn takes in and hands out, and
never steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvfence.engine.counters import Counters
from kvfence.engine.decode import DecodeEngine
from kvfence.engine.messages import (
    Abort,
    Bootstrap,
    BootstrapReady,
    ErrorInfo,
    Failure,
    TransferDone,
)
from kvfence.kv.pool import KVPool, PageHandle
from kvfence.roles.control import DecodeControl, DecodeInput
from kvfence.roles.prefill import ledger_check
from kvfence.transfer.base import KVReceiver
from kvfence.transfer.lab_holds import LabHold
from kvfence.transfer.rooms import Event

TRANSFER_INCOMPLETE = "KV transfer did not complete (sender gone or transfer refused)"


class DecodeRole:
    def __init__(
        self,
        engine: DecodeEngine,
        receiver: KVReceiver,
        hold: LabHold | None = None,  # the lab's `hold=FOLDER` switch: no step while held
        *,
        carried: bool = False,  # a prefill role in this process steps this engine's rows
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.hold = hold
        self.carried = carried
        self.transfer_failures = 0

    @property
    def pool(self) -> KVPool:
        return self.engine.pool

    def wake_on_landing(self, wake: Callable[[], None]) -> None:
        """A landed transfer ends the coordinator's idle wait: it is decoded at once."""
        self.receiver.notify(wake)

    def turn(self, control: DecodeControl) -> None:
        """receive -> what landed (I3) and its first tokens -> step -> ready and tokens,
        then the pacing."""
        engine = self.engine
        for msg in control.receive(engine.has_work):
            self.take(msg, control)
        for failure in self.landed(self.receiver.poll()):
            self.transfer_failures += 1  # cancelled, refused or its sender died
            control.event(failure)
        # What landed carries prefill's first token: it goes out now, not after a wait for
        # the cores (another worker's step) and this step.
        landed = self.hand_out(control)
        stepping = engine.has_work and not (self.carried or self._held())
        with control.cores(stepping):
            if stepping:
                engine.step()
        stepped = self.hand_out(control)
        control.turn_done(landed or stepped)

    def hand_out(self, control: DecodeControl) -> bool:
        """What the engine produced since the last hand-out; whether there was any."""
        out = self.engine.drain()
        for ready in out.ready:
            control.ready(ready)  # a queued reservation got its pages
        for event in out.events:
            control.event(event)
        return bool(out)

    def _held(self) -> bool:
        """The lab's hold: the step is skipped (after a poll's sleep) while it is set."""
        return self.hold is not None and self.hold.holds_step(bool(self.engine.running))

    def landed(self, events: list[Event]) -> list[Failure]:
        """What landed goes to decode, which reconciles it (I3); each row still waiting for
        its KV when its room ended (cancelled, refused, the sender died) fails (I6)."""
        failures = []
        for event in events:
            if not isinstance(event, TransferDone):
                self.engine.on_transfer(event.manifest, event.checksum)
            elif not event.ok and self.engine.awaiting_transfer(event.room):
                self.engine.abort(event.room, "KV transfer did not complete")
                failures.append(
                    Failure(event.room, ErrorInfo(502, "transfer_failed", TRANSFER_INCOMPLETE))
                )
        return failures

    def take(self, msg: DecodeInput, control: DecodeControl) -> None:
        if isinstance(msg, Bootstrap):
            answer = self.engine.bootstrap(msg)  # None: queued until pages free up
            if isinstance(answer, BootstrapReady):
                control.ready(answer)
            elif isinstance(answer, Failure):
                control.refused(answer)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.room, msg.reason)  # pages parked until prefill confirms (I7)
        elif isinstance(msg, TransferDone) and not msg.ok:
            self.receiver.cancel(msg.room)  # prefill will never send: close the window (I7)

    def abort(self, room: str, reason: str) -> None:
        self.engine.abort(room, reason)

    # ---- facts for the coordinator's status and health --------------------------------

    @property
    def busy(self) -> bool:
        """Work in the engine, or a room still reserved or decoding."""
        return self.engine.has_work or bool(self.engine.rooms())

    def open_rooms(self) -> list[str]:
        return self.engine.rooms()

    def counters(self) -> Counters:
        return dataclasses.replace(self.engine.counters, transfer_failures=self.transfer_failures)

    def evictable_pages(self) -> int:
        return 0  # decode keeps no prefix cache

    def outstanding(self) -> list[PageHandle]:
        return self.engine.outstanding_handles()

    def check_ledger(self) -> str:
        return ledger_check(self.pool, self.outstanding())

    def close(self) -> None:
        self.receiver.close()
