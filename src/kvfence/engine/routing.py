"""The router role: bootstrap -> ready -> prefill work -> deliver exactly once.

Shared by the two backends: the in-process pipeline (serve/pipeline.py)
and the disaggregated one (hub/backend.py). A room opens with the
decode `Bootstrap` (a room in use is refused, never merged: I9); when decode
has reserved the pages, `ready` turns the work into `PrefillWork` for those
pages, once; every event goes to the room's sink, and the room closes with
the first final one (I6: a request ends exactly once, and an abort is never
reported as success unless the lab's `abort-as-success` switch says so).

Not thread-safe and network-free: the caller serialises (the pipeline's
engine thread, the PD backend's lock) and calls the sink outside any lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvfence.engine.backend import GenerateWork, Sink
from kvfence.engine.messages import (
    Bootstrap,
    BootstrapReady,
    ErrorInfo,
    Failure,
    PrefillWork,
    TokenChunk,
)
from kvfence.faults import Fault, FaultSet

Event = TokenChunk | Failure


class Stage(StrEnum):
    """Where an open request is; each stage has its own deadline in PD mode."""

    BOOTSTRAP = "bootstrap"  # decode reserving pages (may queue while its pool is full)
    TRANSFER = "transfer"  # prefill computing, then the KV transfer
    DECODE = "decode"  # tokens streaming


@dataclass(slots=True)
class Room:
    work: GenerateWork
    sink: Sink
    stage: Stage = Stage.BOOTSTRAP
    deadline: float = 0.0  # PD: when the current stage times out (monotonic seconds)
    decode: str = ""  # PD: the workers serving it; empty in one process
    prefill: str = ""


def is_final(event: Event) -> bool:
    return isinstance(event, Failure) or event.finish_reason is not None


@dataclass(slots=True)
class Rooms:
    """Open requests by room, and the counters only the router role knows."""

    faults: FaultSet = field(default_factory=FaultSet)
    open: dict[str, Room] = field(default_factory=dict)
    aborted: int = 0
    prompt_tokens: int = 0

    def admit(self, room: Room) -> Bootstrap | Failure:
        """Open the room; its bootstrap for decode, or a 409 when the room is in use (I9)."""
        work = room.work
        if work.room in self.open:
            return Failure(
                work.room, ErrorInfo(409, "conflict", f"room {work.room} is in use (I9)")
            )
        self.open[work.room] = room
        self.prompt_tokens += len(work.prompt_ids)
        return work.bootstrap()

    def ready(self, ready: BootstrapReady, decode_addr: str = "") -> PrefillWork | None:
        """Decode reserved the pages: prefill's work, once; None if the room ended meanwhile."""
        room = self.open.get(ready.room)
        if room is None or room.stage is not Stage.BOOTSTRAP:
            return None
        room.stage = Stage.TRANSFER
        return room.work.prefill_work(ready.pages, decode_addr)

    def target(self, event: Event) -> Room | None:
        """The room this event goes to, closed now if the event ends it; None if already ended."""
        if is_final(event):
            return self.open.pop(event.room, None)
        room = self.open.get(event.room)
        if room is not None:
            room.stage = Stage.DECODE
        return room

    def abort(self, room: str, reason: str) -> Event | None:
        """The event that ends an aborted open room (I6), or None when it is not open."""
        if room not in self.open:
            return None
        self.aborted += 1
        if Fault.ABORT_AS_SUCCESS in self.faults:
            # SGLang #33507: the abort reported as a normal end, HTTP 200.
            return TokenChunk(room, (), finish_reason="length")
        return Failure(room, ErrorInfo(499, "aborted", f"request aborted: {reason}"))
