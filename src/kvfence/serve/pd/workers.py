"""Prefill and decode worker processes: the engines behind ZeroMQ control and a KV transport.

Each worker binds one control inbox and reports to the router; the router is
the hub for every control message (prefill never talks to decode except
through the KV transport), so it always knows which decode holds a room.

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

import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvfence.engine.config import EngineConfig
from kvfence.engine.counters import Counters
from kvfence.engine.decode import DecodeEngine
from kvfence.engine.kvlink import apply_transfer_events
from kvfence.engine.messages import (
    Abort,
    Bootstrap,
    ErrorInfo,
    Failure,
    Message,
    PrefillWork,
    TransferDone,
    WorkerStatus,
)
from kvfence.engine.prefill import OutboundTransfer, PrefillEngine
from kvfence.engine.prefill_order import PrefillOrder
from kvfence.faults import FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool, PageHandle, ScrubPolicy
from kvfence.model.loader import LoadedModel, load_model
from kvfence.serve.channel import Inbox, Outbox, Waker
from kvfence.serve.pd.spec import WorkerSpec
from kvfence.serve.pool_sizing import PoolSizes, available_memory_bytes
from kvfence.transfer.registry import get_transport
from kvfence.transfer.senders import Senders

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.5
IDLE_POLL_MS = 20


def role_pages(spec: WorkerSpec, loaded: LoadedModel) -> int:
    geometry = loaded.config.kv_geometry(page_size=spec.page_size)
    pages, kv_bytes, fraction = spec.kv_pages, spec.kv_bytes, spec.kv_memory_fraction
    if spec.role == "prefill":
        sizes = PoolSizes(pages, None, kv_bytes, None, fraction)
    else:
        sizes = PoolSizes(None, pages, None, kv_bytes, fraction)
    ctx = spec.context_length or loaded.config.max_position_embeddings
    role = sizes.plan(spec.role, geometry, ctx, available=available_memory_bytes())
    print(role.how, file=sys.stderr, flush=True)  # the start-up log says how it was sized
    return role.pages


def engine_config(spec: WorkerSpec, loaded: LoadedModel) -> EngineConfig:
    """One EngineConfig for this role; the other role's pool size is irrelevant here (1 page)."""
    ctx = spec.context_length or loaded.config.max_position_embeddings
    pages = role_pages(spec, loaded)
    return EngineConfig(
        prefill_pages=pages if spec.role == "prefill" else 1,
        decode_pages=pages if spec.role == "decode" else 1,
        page_size=spec.page_size,
        max_batch_tokens=spec.max_batch_tokens,
        prefill_order=PrefillOrder(spec.prefill_order),
        context_length=ctx,
        scrub=ScrubPolicy(spec.scrub),
        prefix_cache=spec.prefix_cache,
        shared_prefix_namespace=spec.shared_prefix_namespace,
        eos_token_ids=loaded.tokenizer.eos_ids,
    )


@dataclass(frozen=True, slots=True)
class RoleSetUp:
    """What either role builds from its spec before its pool: the model, the lab's switches,
    the engine config (this role's pool sized) and the page shape."""

    loaded: LoadedModel
    faults: FaultSet
    config: EngineConfig
    geometry: KVGeometry

    @classmethod
    def of(cls, spec: WorkerSpec) -> RoleSetUp:
        loaded = load_model(spec.model_dir, kind=spec.model_kind)
        geometry = loaded.config.kv_geometry(page_size=spec.page_size)
        return cls(loaded, FaultSet.parse(spec.faults), engine_config(spec, loaded), geometry)


class _Stop:
    """Set by SIGTERM/SIGINT so the loop ends cleanly and closes its sockets and segments."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, signum: int, frame: object) -> None:
        self.requested = True


class _Control:
    """A worker's control plane: its inbox, the router's outbox, the stop signal, status pacing."""

    def __init__(self, spec: WorkerSpec, accepts: list[type]) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.inbox = Inbox(self.ctx, spec.inbox, accepts)
        self.waker = Waker()  # set by other threads (decode's KV receiver) to end an idle wait
        self.inbox.wake_on(self.waker)
        self.router = Outbox(self.ctx, spec.router)
        self.stop = _Stop()
        self._last_status = 0.0

    def receive(self, busy: bool) -> list[Message]:
        return self.inbox.poll(0 if busy else IDLE_POLL_MS)

    def send(self, msg: Message) -> None:
        self.router.send(msg)

    def status_due(self, progressed: bool) -> bool:
        """A status after every step that produced output, and at least every interval."""
        now = time.monotonic()
        if progressed or now - self._last_status >= STATUS_INTERVAL_S:
            self._last_status = now
            return True
        return False

    def close(self) -> None:
        self.inbox.close()
        self.router.close()
        self.waker.close()
        self.ctx.term()


def _integrity(pool: KVPool, busy: bool, outstanding: Callable[[], list[PageHandle]]) -> str:
    """The ledger check at a quiet point (I1/I5/I7 bookkeeping); "" while busy."""
    if busy:
        return ""
    try:
        pool.check_integrity(outstanding())
    except AssertionError as e:
        return f"integrity check failed: {e}"
    return "ok"


def _status(
    role: str,
    inbox: Inbox,
    kv_address: str,
    pool: KVPool,
    busy: bool,
    outstanding: Callable[[], list[PageHandle]],
    counters: Counters,
    cached: int = 0,
) -> WorkerStatus:
    return WorkerStatus(
        role=role,
        worker=inbox.addr,
        kv_address=kv_address,
        pool_tokens=pool.capacity_tokens,
        page_size=pool.page_size,
        pages_used=pool.num_used,
        pages_free=pool.num_free,
        pages_pending=pool.num_pending,
        pages_cached=cached,
        integrity=_integrity(pool, busy, outstanding),
        refused_messages=inbox.refused.count,
        counters=counters,
    )


class PrefillWorker:
    """PrefillWork / Abort in; failures and notes for decode (via the router) and KV out."""

    role = "prefill"

    def __init__(self, spec: WorkerSpec) -> None:
        s = RoleSetUp.of(spec)
        self.pool = KVPool(
            s.geometry, s.config.prefill_pages, scrub=s.config.scrub, faults=s.faults
        )
        self.engine = PrefillEngine(s.loaded.model, self.pool, s.config, s.faults)
        self.transport = get_transport(spec.transport)
        self.control = _Control(spec, [PrefillWork, Abort])
        self.senders = Senders(self.transport)  # one per decode KV address
        self.dest_of: dict[str, str] = {}  # room -> decode KV address
        self.transfer_failures = 0

    def iterate(self) -> None:
        """The data flow: receive -> step -> failures and notes to the router -> KV out."""
        engine, control = self.engine, self.control
        for msg in control.receive(engine.has_work):
            self.receive(msg)
        if engine.has_work:
            engine.step()
        out = engine.drain()
        for note in (*out.to_router, *out.to_decode):
            control.send(note)  # the router forwards decode's notes to the decode holding the room
        for t in out.transfers:
            ok = self.send_kv(t)
            self.transfer_failures += not ok
            engine.transfer_done(t.room, ok=ok)  # I7: only now may prefill free its pages
        if control.status_due(bool(out)):
            control.send(self.status())

    def receive(self, msg: Message) -> None:
        if isinstance(msg, PrefillWork):
            self.dest_of[msg.room] = msg.decode_addr
            self.engine.submit(msg)
        elif isinstance(msg, Abort):
            self.dest_of.pop(msg.room, None)
            self.engine.abort(msg.room, msg.reason)

    def send_kv(self, t: OutboundTransfer) -> bool:
        why = self.senders.send(self.dest_of.pop(t.room, ""), t, self.pool)
        if why is None:
            return True
        self.control.send(Failure(t.room, ErrorInfo(502, "transfer_failed", why)))
        return False

    def status(self) -> WorkerStatus:
        cache = self.engine.cache
        counters = dataclasses.replace(
            self.engine.counters,
            prefix_cache_queried_tokens=cache.queried_tokens,
            prefix_cache_hit_tokens=cache.hit_tokens,
            transfer_failures=self.transfer_failures,
        )
        busy = self.engine.has_work or bool(self.dest_of)
        outstanding = self.engine.outstanding_handles
        inbox = self.control.inbox
        evictable = cache.num_evictable
        return _status("prefill", inbox, "", self.pool, busy, outstanding, counters, evictable)

    def open_rooms(self) -> list[str]:
        return list(self.dest_of)

    def close(self) -> None:
        self.senders.close()


class DecodeWorker:
    """Bootstrap / Abort / TransferDone in; KV in through its receiver; tokens out."""

    role = "decode"

    def __init__(self, spec: WorkerSpec) -> None:
        s = RoleSetUp.of(spec)
        transport = get_transport(spec.transport, host=spec.kv_host)
        self.pool = transport.create_pool(
            s.geometry, s.config.decode_pages, scrub=s.config.scrub, faults=s.faults
        )
        self.receiver = transport.receiver(self.pool)
        self.engine = DecodeEngine(
            s.loaded.model, self.pool, s.config, s.faults, inbound=self.receiver
        )
        self.control = _Control(spec, [Bootstrap, Abort, TransferDone])
        self.receiver.notify(self.control.waker.set)  # a landed transfer is decoded at once
        self.transfer_failures = 0

    def iterate(self) -> None:
        """The data flow: receive -> what landed (I3) -> step -> ready and tokens to the router."""
        engine, control = self.engine, self.control
        for msg in control.receive(engine.has_work):
            self.receive(msg)
        for failure in apply_transfer_events(engine, self.receiver.poll()):
            self.transfer_failures += 1  # cancelled, refused or its sender died: nothing to decode
            control.send(failure)
        if engine.has_work:
            engine.step()
        out = engine.drain()
        for event in (*out.ready, *out.events):
            control.send(event)
        if control.status_due(bool(out)):
            control.send(self.status())

    def receive(self, msg: Message) -> None:
        if isinstance(msg, Bootstrap):
            answer = self.engine.bootstrap(msg)
            if answer is not None:
                self.control.send(answer)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.room, msg.reason)
        elif isinstance(msg, TransferDone) and not msg.ok:
            self.receiver.cancel(msg.room)  # prefill will never send: close the window (I7)

    def status(self) -> WorkerStatus:
        counters = dataclasses.replace(
            self.engine.counters, transfer_failures=self.transfer_failures
        )
        busy = self.engine.has_work or bool(self.engine.rooms())
        outstanding = self.engine.outstanding_handles
        address = self.receiver.address
        return _status(
            "decode", self.control.inbox, address, self.pool, busy, outstanding, counters
        )

    def open_rooms(self) -> list[str]:
        return self.engine.rooms()

    def close(self) -> None:
        self.receiver.close()


def run_worker(spec: WorkerSpec) -> int:
    """Set up the role, then loop until SIGTERM; an engine error fails the rooms in flight (I6)."""
    worker = PrefillWorker(spec) if spec.role == "prefill" else DecodeWorker(spec)
    try:
        while not worker.control.stop.requested:
            worker.iterate()
    except Exception as e:
        log.exception("%s worker failed", worker.role)
        why = f"{worker.role} worker error: {type(e).__name__}: {e}"
        for room in worker.open_rooms():
            worker.control.send(Failure(room, ErrorInfo(500, "server_error", why)))
        return 1
    finally:
        worker.close()
        worker.control.close()
    return 0
