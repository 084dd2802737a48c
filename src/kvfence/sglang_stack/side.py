"""What both halves of a pair share: one engine thread, a command queue, the bootstrap channel.

The HTTP server's threads only queue commands (submit, reject, abort); one
engine thread turns the role (kvfence/roles) with this side as its coordinator
(`iterate`), so the engine, the KV transport and every ZeroMQ socket are used
from that thread only. Events reach each request's sink from that thread
(engine/backend.py's contract).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import zmq

from kvfence.engine.backend import BackendStats, GenerateWork, PoolInfo, Sink
from kvfence.engine.config import default_of
from kvfence.engine.counters import Counters
from kvfence.engine.messages import ErrorInfo, Message
from kvfence.roles.decode import DecodeRole
from kvfence.roles.prefill import PrefillRole
from kvfence.serve.channel import Inbox, Outbox, Waker
from kvfence.serve.specs import SglangWorkerSpec
from kvfence.sglang_stack.cores import CoreShare
from kvfence.sglang_stack.fields import RoomBinding

log = logging.getLogger(__name__)
IDLE_POLL_MS = 10
# A room whose other half never shows up, or goes silent, fails by then (the default of
# `kvfence serve --pair-timeout`): how long decode keeps pages reserved for a prefill that
# went quiet, and how long a client waits to hear so.
PAIR_TIMEOUT_S = default_of(SglangWorkerSpec, "pair_timeout")
# How often prefill says it still holds a paired room (`Queued`), as a share of the pair
# timeout: well inside it, so a late message or two never expires a room that is only
# waiting its turn.
KEEPALIVES_PER_TIMEOUT = 6
# The keep-alive vouches for the engine, not only for the room: a turn of prefill's engine
# loop that has not ended in this long is a hung engine (a long prompt's step on a loaded
# host takes a minute or two), so the word stops and decode fails the rooms PAIR_TIMEOUT_S
# later instead of waiting for ever.
STEP_BOUND_S = 300.0


@dataclass(frozen=True, slots=True)
class Submit:
    work: GenerateWork
    sink: Sink


@dataclass(frozen=True, slots=True)
class Reject:
    binding: RoomBinding
    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class Cancel:
    room: str
    reason: str


Command = Submit | Reject | Cancel


class PairSide(ABC):
    """Base of `PrefillSide` and `DecodeSide`: lifecycle, commands, outboxes, pool facts."""

    role = ""

    def __init__(
        self, driver: PrefillRole | DecodeRole, inbox_addr: str, accepts: list[type]
    ) -> None:
        self.driver = driver  # the role: its engine, pool and KV half (kvfence/roles)
        self.pool = driver.pool
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.inbox = Inbox(self.ctx, inbox_addr, accepts)
        self.waker = Waker()  # set by other threads (a command, a landed transfer): no idle wait
        self.inbox.wake_on(self.waker)
        self._outboxes: dict[str, Outbox] = {}
        self._commands: deque[Command] = deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.integrity = ""
        self._fault: str | None = None  # set once the engine loop raised (health says why)
        self.core_share: CoreShare | None = None  # co-located in a stack: turns on the cores

    # ---- the Backend contract (any thread) ---------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"kvfence-{self.role}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)
        for box in self._outboxes.values():
            box.close()
        self.inbox.close()
        self.close()
        if self.core_share is not None:
            self.core_share.close()
        self.waker.close()
        self.ctx.term()

    def submit(self, work: GenerateWork, sink: Sink) -> None:
        self._queue(Submit(work, sink))

    def reject(self, binding: RoomBinding, error: ErrorInfo) -> None:
        self._queue(Reject(binding, error))

    def abort(self, room: str, reason: str) -> None:
        self._queue(Cancel(room, reason))

    def health(self) -> str | None:
        """None while the engine can serve; else why not (its loop failed, or its thread died)."""
        if self._fault is not None:
            return self._fault
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping.is_set():
            return f"the {self.role} engine thread is not running"
        return None

    def stats(self) -> BackendStats:
        info = PoolInfo.of(self.role, self.pool, self.evictable_pages())
        return BackendStats(self.counters(), (info,))

    def evictable_pages(self) -> int:
        """Pages only a prefix cache holds (PoolInfo.pages_cached); a role without one: 0."""
        return self.driver.evictable_pages()

    # ---- the engine thread ---------------------------------------------------------------

    def _queue(self, cmd: Command) -> None:
        with self._lock:
            self._commands.append(cmd)
        self.waker.set()

    def commands(self) -> list[Command]:
        with self._lock:
            out = list(self._commands)
            self._commands.clear()
        return out

    def cores(self, busy: bool) -> AbstractContextManager[None]:
        """Around the turn's step (engine thread): where a stack shares the host's cores
        between its workers, its turn on them (cores.py); otherwise the fixed setting stands."""
        share = self.core_share
        return nullcontext() if share is None else share.turn(busy)

    def poll(self, busy: bool) -> list[Message]:
        return self.inbox.poll(0 if busy else IDLE_POLL_MS)

    def send(self, addr: str, msg: Message) -> None:
        box = self._outboxes.get(addr)
        if box is None:
            box = self._outboxes[addr] = Outbox(self.ctx, addr)
        box.send(msg)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.iterate()
            except Exception as e:
                log.exception("%s engine loop failed", self.role)
                # A request that makes a step raise fails alone inside the engine; this is
                # the engine's own fault, so /health turns false until a restart.
                self._fault = f"the {self.role} engine failed ({type(e).__name__})"
                self.fail_all("the engine failed")
                time.sleep(0.1)

    def check_quiet(self) -> None:
        """The ledger check at a quiet point (I1/I5/I7 bookkeeping), for /server_info."""
        self.integrity = self.driver.check_ledger()

    def counters(self) -> Counters:
        return self.driver.counters()

    def close(self) -> None:
        """Close the role's transport half."""
        self.driver.close()

    # ---- per role ------------------------------------------------------------------------

    @abstractmethod
    def iterate(self) -> None:
        """One turn of the role's loop (engine thread): the role, driven by this side."""

    @abstractmethod
    def fail_all(self, why: str) -> None:
        """The engine loop raised: end every open request with an error (I6)."""
