"""Decode's half of the pair: reserve, register at prefill's bootstrap, reconcile, decode.

For each routed request decode reserves pages for exactly its own prompt
(generation-stamped), and registers the room at the prefill bootstrap the
router named (`RoomRegistration`: the tenant this worker authenticated, the
page handles, its KV receiver, its reply inbox). What lands is reconciled
against the reservation before a token is decoded (I3). Prefill's refusal
arrives on the reply inbox with the original error: the request ends with
it, and its pages are released once prefill confirms nothing will land
(`TransferDone(ok=False)`, I7) -- decode never waits for KV that will not
come, and never decodes over pages that were not written (the incident).
This worker's own refusal of a routed request goes to prefill the same way.
"""

from __future__ import annotations

import time

from kvfence.engine.decode import DecodeEngine
from kvfence.engine.messages import (
    Abort,
    BootstrapReady,
    ErrorInfo,
    Failure,
    Message,
    Queued,
    RoomRegistration,
    TokenChunk,
    TransferDone,
)
from kvfence.engine.routing import Room, Rooms, Stage
from kvfence.faults import FaultSet
from kvfence.roles.control import DecodeInput
from kvfence.roles.decode import DecodeRole
from kvfence.sglang_stack.side import PAIR_TIMEOUT_S, Cancel, PairSide, Reject, Submit
from kvfence.transfer.base import KVReceiver
from kvfence.transfer.lab_holds import LabHold


class DecodeSide(PairSide):
    """`Backend` for a decode worker behind SGLang's router."""

    role = "decode"

    def __init__(
        self,
        engine: DecodeEngine,
        receiver: KVReceiver,
        reply_addr: str,
        faults: FaultSet,
        hold: LabHold | None = None,
        pair_timeout_s: float = PAIR_TIMEOUT_S,
    ) -> None:
        driver = DecodeRole(engine, receiver, hold)
        super().__init__(driver, reply_addr, [Failure, Abort, Queued, TransferDone])
        self.driver: DecodeRole = driver
        self.pair_timeout_s = pair_timeout_s
        driver.wake_on_landing(self.waker.set)  # a landed transfer is reconciled at once
        self.rooms = Rooms(faults)  # one end per request (I6), shared with the other backends
        self._inputs: list[DecodeInput] = []  # for the role, this turn

    def iterate(self) -> None:
        self.driver.turn(self)

    # ---- the role's control plane (roles/control.py), on the engine thread --------------

    def receive(self, busy: bool) -> list[DecodeInput]:
        """Prefill's notes, then this edge's commands, in order, for the role."""
        for msg in self.poll(busy):
            self._from_prefill(msg)
        for cmd in self.commands():
            self._command(cmd)
        inputs, self._inputs = self._inputs, []
        return inputs

    def ready(self, ready: BootstrapReady) -> None:
        self._register(ready)

    def refused(self, failure: Failure) -> None:
        room = self.rooms.open.get(failure.room)
        self._deliver(failure)
        if room is not None:
            self.send(room.prefill, failure)  # prefill ends its half with the same error

    def event(self, event: TokenChunk | Failure) -> None:
        self._deliver(event)

    def turn_done(self, progressed: bool) -> None:
        self._expire(time.monotonic())
        if not (self.driver.busy or self.rooms.open):
            self.check_quiet()

    def _command(self, cmd: Submit | Reject | Cancel) -> None:
        if isinstance(cmd, Submit):
            boot = self.rooms.admit(Room(cmd.work, cmd.sink, decode="local", prefill=cmd.work.peer))
            if isinstance(boot, Failure):
                cmd.sink(boot)
                return
            self._inputs.append(boot)  # the role reserves its pages: `ready` or `refused`
        elif isinstance(cmd, Reject):
            self.send(cmd.binding.peer, Failure(cmd.binding.room, cmd.error))
        else:
            room = self.rooms.open.get(cmd.room)
            event = self.rooms.abort(cmd.room, cmd.reason)
            self._inputs.append(Abort(cmd.room, cmd.reason))  # pages parked until prefill (I7)
            if room is not None:
                self.send(room.prefill, Failure(cmd.room, _aborted(cmd.reason)))
            if event is not None:
                self._deliver(event)

    def _register(self, ready: BootstrapReady) -> None:
        room = self.rooms.open.get(ready.room)
        if room is None or self.rooms.ready(ready) is None:
            return
        work = room.work
        reg = RoomRegistration(
            room=work.room,
            tenant=work.tenant,
            num_prompt_tokens=len(work.prompt_ids),
            pages=ready.pages,
            kv_address=self.driver.receiver.address,
            reply_addr=self.inbox.addr,
        )
        self.send(work.peer, reg)
        room.deadline = time.monotonic() + self.pair_timeout_s

    def _expire(self, now: float) -> None:
        """A room whose prefill half never answered, or went silent, fails by its deadline
        (I6), pages parked (I7). Prefill's `Queued` restarts the wait while it holds the room."""
        for name, room in list(self.rooms.open.items()):
            if room.stage is Stage.TRANSFER and now >= room.deadline:
                why = (
                    f"prefill at {room.work.peer} did not send room {name}'s KV and said "
                    f"nothing of it for {self.pair_timeout_s:g} s (it stopped, or lost the room)"
                )
                self.driver.abort(name, why)
                self._deliver(Failure(name, ErrorInfo(504, "timeout", why, code="pair_timeout")))

    def _from_prefill(self, msg: Message) -> None:
        if isinstance(msg, Failure):  # prefill refused the room: its original error (I6)
            self._inputs.append(Abort(msg.room, msg.error.message))
            self._deliver(msg)
        elif isinstance(msg, Abort):
            self._inputs.append(msg)
        elif isinstance(msg, Queued):  # prefill holds the room: its wait starts again
            room = self.rooms.open.get(msg.room)
            if room is not None and room.stage is Stage.TRANSFER:
                room.deadline = time.monotonic() + self.pair_timeout_s
        elif isinstance(msg, TransferDone) and not msg.ok:
            self._inputs.append(msg)  # prefill will never send: the role closes the window (I7)

    def _deliver(self, event: TokenChunk | Failure) -> None:
        room = self.rooms.target(event)
        if room is not None:
            room.sink(event)

    # ---- the engine failed ----------------------------------------------------------------

    def fail_all(self, why: str) -> None:
        for room in list(self.rooms.open):
            self._deliver(Failure(room, ErrorInfo(500, "server_error", why)))


def _aborted(reason: str) -> ErrorInfo:
    return ErrorInfo(499, "aborted", f"request aborted: {reason}")
