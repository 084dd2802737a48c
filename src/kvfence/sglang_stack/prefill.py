"""Prefill's half of the pair: the bootstrap port, pairing by room, KV out over a transport.

Both workers get the router's request for a room at once. Decode reserves
pages for exactly the prompt and registers them here (`RoomRegistration`);
this side's own request for the room comes through its HTTP edge. A room is
prefilled only when both halves are here and agree: same tenant (the room is
bound to the tenant both workers authenticated, I9) and same prompt length
(I3 starts before a byte moves). Prefill writes only into the pages decode
granted (the transport's grant, transfer/granted.py).

Refusals travel at once, with the original error, both ways: this edge's
refusal (`reject`) and the engine's (an over-pool prompt, I2: REJECTED is
terminal) go to decode's reply inbox as the `Failure` plus the
`TransferDone(ok=False)` that lets decode release its reservation (I7);
decode's refusal arrives here as a `Failure` and ends this side's request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvfence.engine.backend import GenerateWork, Sink
from kvfence.engine.messages import (
    Abort,
    ErrorInfo,
    Failure,
    Message,
    Queued,
    RoomRegistration,
    TokenChunk,
    TransferDone,
)
from kvfence.engine.prefill import OutboundTransfer, PrefillEngine
from kvfence.faults import Fault
from kvfence.roles.control import PrefillInput
from kvfence.roles.prefill import PrefillRole
from kvfence.sglang_stack.keepalive import KeepAlive
from kvfence.sglang_stack.side import (
    KEEPALIVES_PER_TIMEOUT,
    PAIR_TIMEOUT_S,
    STEP_BOUND_S,
    Cancel,
    PairSide,
    Reject,
    Submit,
)
from kvfence.transfer.base import KVTransport
from kvfence.transfer.lab_holds import LabHold
from kvfence.transfer.senders import Senders


@dataclass(slots=True)
class _Pair:
    deadline: float
    registration: RoomRegistration | None = None
    work: GenerateWork | None = None
    sink: Sink | None = None
    failure: Failure | None = None  # one half refused before the pair was whole


class PrefillSide(PairSide):
    """`Backend` for a prefill worker behind SGLang's router."""

    role = "prefill"

    def __init__(
        self,
        engine: PrefillEngine,
        transport: KVTransport,
        bootstrap_addr: str,
        hold: LabHold | None = None,  # the lab's `hold=FOLDER` switch (lab_holds.py)
        pair_timeout_s: float = PAIR_TIMEOUT_S,
        step_bound_s: float = STEP_BOUND_S,
    ) -> None:
        driver = PrefillRole(engine, Senders(transport, hold))
        super().__init__(driver, bootstrap_addr, [RoomRegistration, Failure])
        self.driver: PrefillRole = driver
        self.pair_timeout_s = pair_timeout_s
        self.pairs: dict[str, _Pair] = {}  # rooms waiting for their other half
        self.live: dict[str, tuple[Sink, RoomRegistration]] = {}  # paired rooms in the engine
        self.answered: set[str] = set()  # live rooms whose HTTP side has had its one end (I6)
        self.room_mismatches = 0
        self.pairs_by_room_alone = Fault.DECODE_TRUSTS_BOOTSTRAP in engine.faults  # lab only
        # Says `Queued` for `live` rooms while the engine's turns keep ending.
        keepalive_s = pair_timeout_s / KEEPALIVES_PER_TIMEOUT
        self.keepalive = KeepAlive(self.ctx, keepalive_s, step_bound_s)
        self._inputs: list[PrefillInput] = []  # for the role, this turn

    def start(self) -> None:
        super().start()
        self.keepalive.start()

    def close(self) -> None:
        self.keepalive.stop()  # its sockets close before the context ends
        super().close()

    def iterate(self) -> None:
        self.driver.turn(self)

    # ---- the role's control plane (roles/control.py), on the engine thread --------------

    def receive(self, busy: bool) -> list[PrefillInput]:
        """Decode's notes, then this edge's commands; rooms paired now go to the role."""
        self.keepalive.turning()
        for msg in self.poll(busy or bool(self.live)):
            self._from_decode(msg)
        for cmd in self.commands():
            self._command(cmd)
        self._expire(time.monotonic())
        inputs, self._inputs = self._inputs, []
        return inputs

    def refused(self, failure: Failure) -> None:
        self._end(failure.room, failure)  # the engine's refusal: decode gets it too

    def note(self, note: Abort | TransferDone) -> None:
        self._tell_decode(note.room, note)

    def transfer_failed(self, failure: Failure) -> None:
        self._end(failure.room, failure)
        self._tell_decode(failure.room, TransferDone(failure.room, ok=False))  # nothing lands

    def transferred(self, transfer: OutboundTransfer) -> None:
        self._finished(transfer)

    def turn_done(self, progressed: bool) -> None:
        if not (self.driver.has_work or self.live or self.pairs):
            self.check_quiet()

    # ---- the two halves meet -----------------------------------------------------------

    def _pair(self, room: str) -> _Pair:
        pair = self.pairs.get(room)
        if pair is None:
            pair = self.pairs[room] = _Pair(time.monotonic() + self.pair_timeout_s)
        return pair

    def _from_decode(self, msg: Message) -> None:
        if isinstance(msg, RoomRegistration):
            if msg.room in self.live:
                return  # I9: a second registration for a live room is refused, never merged
            pair = self._pair(msg.room)
            pair.registration = msg
            self._settle(msg.room, pair)
        elif isinstance(msg, Failure):  # decode refused or gave up the room: end this half too
            if msg.room in self.live:
                self._answer(msg.room, msg)
                self._abort(msg.room, msg.error.message)  # decode hears TransferDone(False)
                return
            pair = self._pair(msg.room)
            pair.failure = msg
            self._settle(msg.room, pair)

    def _command(self, cmd: Submit | Reject | Cancel) -> None:
        if isinstance(cmd, Submit):
            pair = self._pair(cmd.work.room)
            pair.work, pair.sink = cmd.work, cmd.sink
            self._settle(cmd.work.room, pair)
        elif isinstance(cmd, Reject):
            failure = Failure(cmd.binding.room, cmd.error)
            pair = self._pair(cmd.binding.room)
            pair.failure = pair.failure or failure
            self._settle(cmd.binding.room, pair)
        elif cmd.room in self.live:
            self._abort(cmd.room, cmd.reason)  # decode hears TransferDone(ok=False)
        elif cmd.room in self.pairs:
            reason = f"request aborted: {cmd.reason}"
            self._pair(cmd.room).failure = Failure(cmd.room, ErrorInfo(499, "aborted", reason))
            self._settle(cmd.room, self.pairs[cmd.room])

    def _settle(self, room: str, pair: _Pair) -> None:
        """Start the room once both halves agree; end both halves once either refused."""
        reg, work = pair.registration, pair.work
        if pair.failure is not None:
            if reg is not None:
                self._notify(reg, pair.failure)
            if pair.sink is not None:
                pair.sink(pair.failure)
            if reg is not None or pair.sink is not None:
                del self.pairs[room]  # kept until the other half has heard, or it expires
            return
        if reg is None or work is None or pair.sink is None:
            return
        del self.pairs[room]
        # I9: the room's owner is the tenant both workers authenticated. The lab's
        # `decode-trusts-bootstrap` pairs by room number alone (SGLang's PD workers do), so
        # a request that names another tenant's room is decoded over that tenant's KV.
        owner_differs = reg.tenant != work.tenant and not self.pairs_by_room_alone
        if owner_differs or reg.num_prompt_tokens != len(work.prompt_ids):
            self.room_mismatches += 1
            why = (
                f"room {room} was registered by decode for another tenant or prompt length "
                "(I9: a room is bound to the tenant both workers authenticated)"
            )
            failure = Failure(room, ErrorInfo(409, "conflict", why, code="room_mismatch"))
            self._notify(reg, failure)
            pair.sink(failure)
            return
        self.live[room] = (pair.sink, reg)
        self.keepalive.hold(room, reg.reply_addr)  # decode's wait restarts, even mid-step
        self._inputs.append(work.prefill_work(reg.pages, reg.kv_address))  # KV to reg's address
        self.send(reg.reply_addr, Queued(room))  # decode now waits on this side's word

    def _abort(self, room: str, reason: str) -> None:
        self._inputs.append(Abort(room, reason))

    def _expire(self, now: float) -> None:
        for room, pair in list(self.pairs.items()):
            if now < pair.deadline:
                continue
            del self.pairs[room]
            why = (
                f"the other worker of the pair did not take room {room} within "
                f"{self.pair_timeout_s:g} s"
            )
            failure = Failure(room, ErrorInfo(504, "timeout", why, code="pair_timeout"))
            if pair.registration is not None:
                self._notify(pair.registration, failure)
            if pair.sink is not None:
                pair.sink(failure)

    # ---- out ---------------------------------------------------------------------------

    def _notify(self, reg: RoomRegistration, failure: Failure) -> None:
        """Decode ends the room with the original error and may release its pages (I7)."""
        self.send(reg.reply_addr, failure)
        self.send(reg.reply_addr, TransferDone(reg.room, ok=False))

    def _tell_decode(self, room: str, note: Abort | TransferDone) -> None:
        entry = self.live.get(room)
        if entry is not None:
            self.send(entry[1].reply_addr, note)
        if isinstance(note, TransferDone):
            self._close(room)

    def _answer(self, room: str, event: TokenChunk | Failure) -> None:
        """This side's HTTP request ends exactly once (I6)."""
        entry = self.live.get(room)
        if entry is not None and room not in self.answered:
            self.answered.add(room)
            entry[0](event)

    def _close(self, room: str) -> None:
        self.live.pop(room, None)
        self.keepalive.release(room)
        self.answered.discard(room)

    def _end(self, room: str, failure: Failure) -> None:
        entry = self.live.get(room)
        if entry is not None:
            self._answer(room, failure)
            self.send(entry[1].reply_addr, failure)

    def _finished(self, t: OutboundTransfer) -> None:
        """Prefill's own answer to the router: the first token (the router returns decode's)."""
        self._answer(t.room, TokenChunk(t.room, (t.first_token,), finish_reason="length"))
        self._close(t.room)

    # ---- the engine failed ----------------------------------------------------------------

    def fail_all(self, why: str) -> None:
        for room in list(self.live):
            self.driver.forget(room)  # a transfer the failed engine still makes goes nowhere
            self._end(room, Failure(room, ErrorInfo(500, "server_error", why)))
            self._tell_decode(room, TransferDone(room, ok=False))
