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
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvfence.engine.config import EngineConfig, default_of
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
from kvfence.faults import FaultSet
from kvfence.kv.pool import KVPool, PageHandle, ScrubPolicy
from kvfence.model.loader import LoadedModel, load_model
from kvfence.serve.build import PoolSizes
from kvfence.serve.channel import Inbox, Outbox
from kvfence.serve.transfer.base import KVSender, TransferRefused, TransportClosed
from kvfence.serve.transfer.inprocess import InProcessTransport
from kvfence.serve.transfer.registry import get_transport, transport_names

log = logging.getLogger(__name__)

# Every registered transport but the in-process one can join two processes.
CROSS_PROCESS = tuple(n for n in transport_names() if n != InProcessTransport.name)
STATUS_INTERVAL_S = 0.5
IDLE_POLL_MS = 20


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything one worker process needs; built from `kvfence serve --role …` options."""

    role: str  # "prefill" or "decode"
    model_dir: str
    model_kind: str
    inbox: str  # the control address this worker binds, e.g. tcp://10.0.0.2:7001
    router: str  # the router's control inbox
    pages: int | None = None  # this role's KV pool in pages, or
    kv_bytes: int | None = None  # a byte budget (whole pages, rounded down); default 64 MiB
    page_size: int = default_of(EngineConfig, "page_size")
    context_length: int | None = None
    scrub: str = ScrubPolicy.NONE.value
    prefix_cache: bool = True
    shared_prefix_namespace: str | None = None
    faults: tuple[str, ...] = ()
    transport: str = "tcp"
    kv_host: str = "127.0.0.1"  # decode: the interface its KV receiver listens on

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"a worker role is 'prefill' or 'decode', got {self.role!r}")
        if self.transport not in CROSS_PROCESS:
            raise ValueError(
                f"a cross-process transport is one of {', '.join(CROSS_PROCESS)}, "
                f"got {self.transport!r}"
            )


def role_pages(spec: WorkerSpec, loaded: LoadedModel) -> int:
    geometry = loaded.config.kv_geometry(page_size=spec.page_size)
    sizes = PoolSizes(**{f"{spec.role}_pages": spec.pages, f"{spec.role}_bytes": spec.kv_bytes})
    return sizes.pages(spec.role, geometry)


def engine_config(spec: WorkerSpec, loaded: LoadedModel) -> EngineConfig:
    """One EngineConfig for this role; the other role's pool size is irrelevant here (1 page)."""
    ctx = spec.context_length or loaded.config.max_position_embeddings
    pages = role_pages(spec, loaded)
    return EngineConfig(
        prefill_pages=pages if spec.role == "prefill" else 1,
        decode_pages=pages if spec.role == "decode" else 1,
        page_size=spec.page_size,
        context_length=ctx,
        scrub=ScrubPolicy(spec.scrub),
        prefix_cache=spec.prefix_cache,
        shared_prefix_namespace=spec.shared_prefix_namespace,
        eos_token_ids=loaded.tokenizer.eos_ids,
    )


class _Stop:
    """Set by SIGTERM/SIGINT so the loop ends cleanly and closes its sockets and segments."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, signum: int, frame: object) -> None:
        self.requested = True


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
        integrity=_integrity(pool, busy, outstanding),
        refused_messages=inbox.refused.count,
        counters=counters,
    )


def _fail_all(rooms: list[str], send: Callable[[Message], None], why: str) -> None:
    for room in rooms:
        send(Failure(room, ErrorInfo(500, "server_error", why)))


def run_prefill(spec: WorkerSpec) -> int:
    loaded = load_model(spec.model_dir, kind=spec.model_kind)
    faults = FaultSet.parse(spec.faults)
    config = engine_config(spec, loaded)
    geometry = loaded.config.kv_geometry(page_size=spec.page_size)
    pool = KVPool(geometry, config.prefill_pages, scrub=config.scrub, faults=faults)
    engine = PrefillEngine(loaded.model, pool, config, faults)
    transport = get_transport(spec.transport)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    inbox = Inbox(ctx, spec.inbox, [PrefillWork, Abort])
    router = Outbox(ctx, spec.router)
    senders: dict[str, KVSender] = {}
    dest_of: dict[str, str] = {}  # room -> decode KV address
    stop = _Stop()

    def status() -> WorkerStatus:
        cache = engine.cache
        counters = dataclasses.replace(
            engine.counters,
            prefix_cache_queried_tokens=cache.queried_tokens,
            prefix_cache_hit_tokens=cache.hit_tokens,
            transfer_failures=transfer_failures,
        )
        busy = engine.has_work or bool(dest_of)
        return _status("prefill", inbox, "", pool, busy, engine.outstanding_handles, counters)

    def send_kv(t: OutboundTransfer) -> bool:
        addr = dest_of.pop(t.room, "")
        try:
            sender = senders.get(addr)
            if sender is None:
                sender = senders[addr] = transport.sender(addr)
            sender.send(t, pool)
            return True
        except (TransferRefused, TransportClosed, OSError, ValueError) as e:
            broken = senders.pop(addr, None)
            if broken is not None and not isinstance(e, TransferRefused):
                broken.close()
            router.send(
                Failure(
                    t.room, ErrorInfo(502, "transfer_failed", f"KV transfer to decode failed: {e}")
                )
            )
            return False

    transfer_failures = 0
    last_status = 0.0
    try:
        while not stop.requested:
            for msg in inbox.poll(0 if engine.has_work else IDLE_POLL_MS):
                if isinstance(msg, PrefillWork):
                    dest_of[msg.room] = msg.decode_addr
                    engine.submit(msg)
                elif isinstance(msg, Abort):
                    dest_of.pop(msg.room, None)
                    engine.abort(msg.room, msg.reason)
            if engine.has_work:
                engine.step()
            out = engine.drain()
            for failure in out.to_router:
                router.send(failure)
            for note in out.to_decode:
                router.send(note)  # the router forwards to the decode holding the room
            for t in out.transfers:
                ok = send_kv(t)
                transfer_failures += not ok
                engine.transfer_done(t.room, ok=ok)  # I7: only now may prefill free its pages
            now = time.monotonic()
            if now - last_status >= STATUS_INTERVAL_S or out:
                router.send(status())
                last_status = now
    except Exception as e:
        log.exception("prefill worker failed")
        _fail_all(list(dest_of), router.send, f"prefill worker error: {type(e).__name__}: {e}")
        return 1
    finally:
        for s in senders.values():
            s.close()
        inbox.close()
        router.close()
        ctx.term()
    return 0


def run_decode(spec: WorkerSpec) -> int:
    loaded = load_model(spec.model_dir, kind=spec.model_kind)
    faults = FaultSet.parse(spec.faults)
    config = engine_config(spec, loaded)
    geometry = loaded.config.kv_geometry(page_size=spec.page_size)
    transport = get_transport(spec.transport, host=spec.kv_host)
    pool = transport.create_pool(geometry, config.decode_pages, scrub=config.scrub, faults=faults)
    receiver = transport.receiver(pool)
    engine = DecodeEngine(loaded.model, pool, config, faults, inbound=receiver)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    inbox = Inbox(ctx, spec.inbox, [Bootstrap, Abort, TransferDone])
    router = Outbox(ctx, spec.router)
    stop = _Stop()
    transfer_failures = 0

    def status() -> WorkerStatus:
        counters = dataclasses.replace(engine.counters, transfer_failures=transfer_failures)
        busy = engine.has_work or bool(engine.seqs)
        return _status(
            "decode", inbox, receiver.address, pool, busy, engine.outstanding_handles, counters
        )

    last_status = 0.0
    try:
        while not stop.requested:
            for msg in inbox.poll(0 if engine.has_work else IDLE_POLL_MS):
                if isinstance(msg, Bootstrap):
                    answer = engine.bootstrap(msg)
                    if answer is not None:
                        router.send(answer)
                elif isinstance(msg, Abort):
                    engine.abort(msg.room, msg.reason)
                elif isinstance(msg, TransferDone) and not msg.ok:
                    receiver.cancel(msg.room)  # prefill will never send: close the window (I7)
            for failure in apply_transfer_events(engine, receiver.poll()):
                transfer_failures += 1  # cancelled, refused or its sender died: nothing to decode
                router.send(failure)
            if engine.has_work:
                engine.step()
            out = engine.drain()
            for ready in out.ready:
                router.send(ready)
            for ev in out.events:
                router.send(ev)
            now = time.monotonic()
            if now - last_status >= STATUS_INTERVAL_S or out:
                router.send(status())
                last_status = now
    except Exception as e:
        log.exception("decode worker failed")
        _fail_all(list(engine.seqs), router.send, f"decode worker error: {type(e).__name__}: {e}")
        return 1
    finally:
        receiver.close()
        inbox.close()
        router.close()
        ctx.term()
    return 0


def run_worker(spec: WorkerSpec) -> int:
    return run_prefill(spec) if spec.role == "prefill" else run_decode(spec)
