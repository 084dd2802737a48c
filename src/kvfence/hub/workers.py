"""The hub's coordinator: a role driven over ZeroMQ, kvfence's own router its only peer.

Each worker binds one control inbox and reports to the router; the router is
the hub for every control message (prefill never talks to decode except
through the KV transport), so it always knows which decode holds a room.
The role (kvfence/roles) steps the engine; this module only carries messages.

Prefill: PrefillWork / Abort in; Failure, Abort, TransferDone (for decode,
via the router) and WorkerStatus out; KV out through a `KVSender` per decode.
Decode: Bootstrap / Abort / TransferDone in; BootstrapReady, TokenChunk,
Failure, WorkerStatus out; KV in through its `KVReceiver` (I3 reconciled,
I7 inbound windows).

A malformed or unexpected control message is refused by the inbox and never
reaches the engine; an engine error fails the requests in flight with an
error (I6) instead of killing the worker silently.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import zmq

from kvfence.engine.decode import DecodeEngine
from kvfence.engine.messages import (
    Abort,
    Bootstrap,
    BootstrapReady,
    ErrorInfo,
    Failure,
    Message,
    PrefillWork,
    TokenChunk,
    TransferDone,
    WorkerStatus,
)
from kvfence.engine.prefill import OutboundTransfer, PrefillEngine
from kvfence.kv.pool import KVPool
from kvfence.roles.control import DecodeInput, PrefillInput
from kvfence.roles.decode import DecodeRole
from kvfence.roles.prefill import PrefillRole
from kvfence.serve.channel import Inbox, Outbox, Waker
from kvfence.serve.specs import RoleSetUp, WorkerSpec
from kvfence.transfer.registry import get_transport
from kvfence.transfer.senders import Senders

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.5
IDLE_POLL_MS = 20


class _Stop:
    """Set by SIGTERM/SIGINT so the loop ends cleanly and closes its sockets and segments."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, signum: int, frame: object) -> None:
        self.requested = True


class _HubControl:
    """A worker's control plane: its inbox, the router's outbox, the stop signal, status pacing."""

    def __init__(self, spec: WorkerSpec, accepts: list[type]) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.inbox = Inbox(self.ctx, spec.inbox, accepts)
        self.waker = Waker()  # set by other threads (decode's KV receiver) to end an idle wait
        self.inbox.wake_on(self.waker)
        self.router = Outbox(self.ctx, spec.router_addr)
        self.stop = _Stop()
        self._last_status = 0.0

    def poll(self, busy: bool) -> list[Message]:
        return self.inbox.poll(0 if busy else IDLE_POLL_MS)

    def send(self, msg: Message) -> None:
        self.router.send(msg)

    def cores(self, busy: bool) -> AbstractContextManager[None]:
        """A hub worker keeps its fixed thread setting."""
        return nullcontext()

    def status_due(self, progressed: bool) -> bool:
        """A status after every step that produced output, and at least every interval."""
        now = time.monotonic()
        if progressed or now - self._last_status >= STATUS_INTERVAL_S:
            self._last_status = now
            return True
        return False

    def status(self, role: str, kv_address: str, driver: PrefillRole | DecodeRole) -> WorkerStatus:
        pool, busy = driver.pool, driver.busy
        return WorkerStatus(
            role=role,
            worker=self.inbox.addr,
            kv_address=kv_address,
            pool_tokens=pool.capacity_tokens,
            page_size=pool.page_size,
            pages_used=pool.num_used,
            pages_free=pool.num_free,
            pages_pending=pool.num_pending,
            pages_cached=driver.evictable_pages(),
            integrity="" if busy else driver.check_ledger(),  # only at a quiet point
            refused_messages=self.inbox.refused.count,
            counters=driver.counters(),
        )

    def close(self) -> None:
        self.inbox.close()
        self.router.close()
        self.waker.close()
        self.ctx.term()


class PrefillWorker(_HubControl):
    """PrefillWork / Abort in; failures and notes for decode (via the router) and KV out."""

    role = "prefill"

    def __init__(self, spec: WorkerSpec) -> None:
        s = RoleSetUp.of(spec)
        pool = KVPool(s.geometry, s.config.prefill_pages, scrub=s.config.scrub, faults=s.faults)
        engine = PrefillEngine(s.loaded.model, pool, s.config, s.faults)
        self.driver = PrefillRole(engine, Senders(get_transport(spec.transport)))
        super().__init__(spec, [PrefillWork, Abort])

    def turn(self) -> None:
        self.driver.turn(self)

    def receive(self, busy: bool) -> Sequence[PrefillInput]:
        return [m for m in self.poll(busy) if isinstance(m, (PrefillWork, Abort))]

    def refused(self, failure: Failure) -> None:
        self.send(failure)

    def note(self, note: Abort | TransferDone) -> None:
        self.send(note)  # the router forwards it to the decode holding the room

    def transfer_failed(self, failure: Failure) -> None:
        self.send(failure)

    def transferred(self, transfer: OutboundTransfer) -> None:
        """Decode's tokens are the answer; the router needs nothing more from prefill."""

    def turn_done(self, progressed: bool) -> None:
        if self.status_due(progressed):
            self.send(self.status("prefill", "", self.driver))


class DecodeWorker(_HubControl):
    """Bootstrap / Abort / TransferDone in; KV in through its receiver; tokens out."""

    role = "decode"

    def __init__(self, spec: WorkerSpec) -> None:
        s = RoleSetUp.of(spec)
        transport = get_transport(spec.transport, host=spec.kv_host)
        pool = transport.create_pool(
            s.geometry, s.config.decode_pages, scrub=s.config.scrub, faults=s.faults
        )
        receiver = transport.receiver(pool)
        engine = DecodeEngine(s.loaded.model, pool, s.config, s.faults, inbound=receiver)
        self.driver = DecodeRole(engine, receiver)
        super().__init__(spec, [Bootstrap, Abort, TransferDone])
        self.driver.wake_on_landing(self.waker.set)

    def turn(self) -> None:
        self.driver.turn(self)

    def receive(self, busy: bool) -> Sequence[DecodeInput]:
        return [m for m in self.poll(busy) if isinstance(m, (Bootstrap, Abort, TransferDone))]

    def ready(self, ready: BootstrapReady) -> None:
        self.send(ready)

    def refused(self, failure: Failure) -> None:
        self.send(failure)

    def event(self, event: TokenChunk | Failure) -> None:
        self.send(event)

    def turn_done(self, progressed: bool) -> None:
        if self.status_due(progressed):
            self.send(self.status("decode", self.driver.receiver.address, self.driver))


def run_worker(spec: WorkerSpec) -> int:
    """Set up the role, then loop until SIGTERM; an engine error fails the rooms in flight (I6)."""
    worker = PrefillWorker(spec) if spec.role == "prefill" else DecodeWorker(spec)
    try:
        while not worker.stop.requested:
            worker.turn()
    except Exception as e:
        log.exception("%s worker failed", worker.role)
        why = f"{worker.role} worker error: {type(e).__name__}: {e}"
        for room in worker.driver.open_rooms():
            worker.send(Failure(room, ErrorInfo(500, "server_error", why)))
        return 1
    finally:
        worker.driver.close()
        worker.close()
    return 0
