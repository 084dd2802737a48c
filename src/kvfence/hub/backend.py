"""The router's `Backend` for disaggregated serving: prefill and decode workers over ZeroMQ.

The router is the hub of the PD protocol (engine/messages.py): it makes the
room (I9), sends the Bootstrap to a decode worker, and only when decode has
reserved the pages does it send the PrefillWork (with decode's KV address and
the reserved page handles) to a prefill worker. Tokens and failures come back
to the router's inbox and are delivered to the request's sink exactly once
(I6). Every wait has a deadline; a request that misses one fails with a
clean error and is aborted on both workers, whose deferred release (I7) keeps
its pages out of reuse until the transport confirms.

Workers report `WorkerStatus` at start and then periodically; the router's
capacity gate and /server_info read the pools from those live reports.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from kvfence.engine.backend import BackendStats, GenerateWork, PoolInfo, Sink
from kvfence.engine.counters import Counters
from kvfence.engine.messages import (
    Abort,
    Bootstrap,
    BootstrapReady,
    ErrorInfo,
    Failure,
    Message,
    TokenChunk,
    TransferDone,
    WorkerStatus,
)
from kvfence.engine.routing import Room, Rooms, Stage
from kvfence.faults import FaultSet
from kvfence.serve.channel import Inbox, Outbox

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds each stage may take before the request fails with a clean error."""

    bootstrap_s: float = 60.0  # decode reserving pages (may queue while the pool is full)
    transfer_s: float = 60.0  # prefill + KV transfer, from the reservation to the first token
    decode_s: float = 30.0  # between two tokens
    workers_ready_s: float = 180.0  # every worker's first status at start-up
    liveness_s: float = 5.0  # a worker silent this long is dead: its requests fail now

    def __post_init__(self) -> None:
        for name in ("bootstrap_s", "transfer_s", "decode_s", "workers_ready_s", "liveness_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Timeouts.{name} must be positive")


@dataclass(slots=True)
class _Worker:
    outbox: Outbox
    status: WorkerStatus | None = None
    seen: float = 0.0


class PDBackend:
    """`Backend` over worker processes. Thread-safe; one poller thread delivers events."""

    def __init__(
        self,
        inbox_addr: str,
        prefill: list[str],
        decode: list[str],
        *,
        faults: FaultSet | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError(
                "disaggregated serving needs at least one prefill and one decode worker"
            )
        self.faults = faults or FaultSet()
        self.timeouts = timeouts or Timeouts()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.inbox = Inbox(
            self._ctx,
            inbox_addr,
            [BootstrapReady, TokenChunk, Failure, Abort, TransferDone, WorkerStatus],
        )
        self._prefill = {a: _Worker(Outbox(self._ctx, a)) for a in prefill}
        self._decode = {a: _Worker(Outbox(self._ctx, a)) for a in decode}
        self._next_prefill = itertools.cycle(prefill)
        self._next_decode = itertools.cycle(decode)
        self._rooms = Rooms(self.faults)  # the router role, shared with the in-process pipeline
        # Guards rooms, counters and every outbox (zmq sockets are not thread-safe).
        self._lock = threading.Lock()
        self._timeouts = 0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("backend already started")
        self._thread = threading.Thread(target=self._loop, name="kvfence-pd-router", daemon=True)
        self._thread.start()

    def wait_for_workers(self, timeout: float | None = None) -> None:
        """Block until every worker has reported its live pool (the gate needs it, I4)."""
        end = time.monotonic() + (timeout or self.timeouts.workers_ready_s)
        while time.monotonic() < end:
            with self._lock:
                missing = [a for a, w in self._workers() if w.status is None]
            if not missing:
                return
            time.sleep(0.05)
        raise TimeoutError(
            f"workers did not report within {timeout or self.timeouts.workers_ready_s:.0f} s: {missing}"
        )

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            rooms = list(self._rooms.open)
        for room in rooms:
            self._finish(room, Failure(room, ErrorInfo(503, "server_error", "router stopping")))
        for _, w in self._workers():
            w.outbox.close()
        self.inbox.close()
        self._ctx.term()

    # ---- Backend ----------------------------------------------------------------------------

    def submit(self, work: GenerateWork, sink: Sink) -> None:
        with self._lock:
            decode = self._pick(self._decode, self._next_decode)
            prefill = self._pick(self._prefill, self._next_prefill)
            deadline = time.monotonic() + self.timeouts.bootstrap_s
            boot = self._rooms.admit(Room(work, sink, Stage.BOOTSTRAP, deadline, decode, prefill))
            if isinstance(boot, Bootstrap):
                self._decode[decode].outbox.send(boot)
        if isinstance(boot, Failure):
            sink(boot)  # I9: a collision is refused, never merged

    def abort(self, room: str, reason: str) -> None:
        with self._lock:
            ending = self._rooms.abort(room, reason)
        if ending is not None:
            self._finish(room, ending, reason=reason)

    def stats(self) -> BackendStats:
        with self._lock:
            statuses = [w.status for _, w in self._workers() if w.status is not None]
            total = Counters.total(s.counters for s in statuses)
            counters = dataclasses.replace(
                total,
                aborted=self._rooms.aborted,  # the router's count: each request once
                prompt_tokens=self._rooms.prompt_tokens,
                failed=total.failed + self._timeouts,
            )
            pools = tuple(
                PoolInfo(s.role, s.pool_tokens, s.page_size, s.pages_used, s.pages_free,
                         s.pages_pending, s.pages_cached)
                for s in statuses
            )  # fmt: skip
            return BackendStats(counters, pools)

    def health(self) -> str | None:
        """Unhealthy while the router's poller is down or a role has no live worker: a worker
        that reported and then fell silent (dead, or exited on an engine fault), or none yet."""
        thread = self._thread
        if thread is not None and not thread.is_alive():
            return "the router's poller thread is not running"
        now = time.monotonic()
        with self._lock:
            for role, table in (("prefill", self._prefill), ("decode", self._decode)):
                live = [
                    w
                    for w in table.values()
                    if w.status is not None and now - w.seen <= self.timeouts.liveness_s
                ]
                if not live:
                    return f"no live {role} worker (of {len(table)}): none has reported lately"
        return None

    def open_rooms(self) -> int:
        with self._lock:
            return len(self._rooms.open)

    def stages(self) -> dict[str, tuple[str, str]]:
        """Open rooms -> (stage, decode worker): for operators and tests."""
        with self._lock:
            return {r: (room.stage.value, room.decode) for r, room in self._rooms.open.items()}

    # ---- the poller -------------------------------------------------------------------------

    def _pick(self, table: dict[str, _Worker], order: Iterator[str]) -> str:
        """The next worker in turn that is not known dead (a dead one fails the request at once)."""
        now = time.monotonic()
        for _ in range(len(table)):
            addr = next(order)
            w = table[addr]
            if w.status is None or now - w.seen <= self.timeouts.liveness_s:
                return addr
        return addr

    def _workers(self) -> list[tuple[str, _Worker]]:
        return [*self._prefill.items(), *self._decode.items()]

    def _loop(self) -> None:
        while not self._stopping.is_set():
            for msg in self.inbox.poll(20):
                try:
                    self._on(msg)
                except Exception:
                    log.exception("router failed on %s", type(msg).__name__)
            self._expire()

    def _on(self, msg: Message) -> None:
        if isinstance(msg, WorkerStatus):
            with self._lock:
                table = self._prefill if msg.role == "prefill" else self._decode
                worker = table.get(msg.worker)
                if worker is None:
                    log.warning("status from unknown %s worker %s refused", msg.role, msg.worker)
                    return
                worker.status, worker.seen = msg, time.monotonic()
        elif isinstance(msg, BootstrapReady):
            self._on_ready(msg)
        elif isinstance(msg, TokenChunk):
            if msg.finish_reason is not None:
                self._finish(msg.room, msg, abort_workers=False)
            else:
                self._deliver(msg)
        elif isinstance(msg, Failure):
            self._finish(msg.room, msg, reason=msg.error.message)
        elif isinstance(msg, Abort | TransferDone):
            with self._lock:  # prefill's word for decode: forward to the decode holding the room
                room = self._rooms.open.get(msg.room)
                if room is not None:
                    self._decode[room.decode].outbox.send(msg)

    def _on_ready(self, ready: BootstrapReady) -> None:
        with self._lock:
            room = self._rooms.open.get(ready.room)
            if room is None:
                return  # ended meanwhile: decode got (or gets) the abort
            decode_status = self._decode[room.decode].status
            kv_addr = decode_status.kv_address if decode_status is not None else ""
            work = self._rooms.ready(ready, kv_addr)
            if work is not None:
                room.deadline = time.monotonic() + self.timeouts.transfer_s
                self._prefill[room.prefill].outbox.send(work)

    def _deliver(self, chunk: TokenChunk) -> None:
        with self._lock:
            room = self._rooms.target(chunk)
            if room is None:
                return
            room.deadline = time.monotonic() + self.timeouts.decode_s
        room.sink(chunk)

    def _finish(
        self,
        room_id: str,
        event: TokenChunk | Failure,
        *,
        reason: str = "",
        abort_workers: bool = True,
    ) -> None:
        """End the room exactly once (I6); on a failure, tell both workers to stop and release."""
        with self._lock:
            room = self._rooms.open.pop(room_id, None)
            if room is None:
                return
            if abort_workers:
                why = reason or "request ended"
                self._decode[room.decode].outbox.send(Abort(room_id, why))
                self._prefill[room.prefill].outbox.send(Abort(room_id, why))
        try:
            room.sink(event)
        except Exception:
            log.exception("sink for room %s failed", room_id)

    def dead_workers(self) -> list[str]:
        """Workers that reported once and then fell silent for longer than `liveness_s`."""
        now = time.monotonic()
        with self._lock:
            return [
                a
                for a, w in self._workers()
                if w.status is not None and now - w.seen > self.timeouts.liveness_s
            ]

    def worker_status(self, addr: str) -> WorkerStatus | None:
        with self._lock:
            w = self._prefill.get(addr) or self._decode.get(addr)
            return w.status if w is not None else None

    def integrity(self) -> dict[str, str]:
        """Each worker's last ledger integrity report ("ok", "" while busy, or the failure)."""
        with self._lock:
            return {a: w.status.integrity for a, w in self._workers() if w.status is not None}

    def _expire(self) -> None:
        dead = set(self.dead_workers())
        if dead:
            with self._lock:
                orphans = [
                    r
                    for r, room in self._rooms.open.items()
                    if room.decode in dead or room.prefill in dead
                ]
            for room_id in orphans:
                self._finish(
                    room_id,
                    Failure(
                        room_id,
                        ErrorInfo(
                            503,
                            "worker_unavailable",
                            "a worker serving this request stopped responding",
                        ),
                    ),
                    reason="worker lost",
                )
        now = time.monotonic()
        with self._lock:
            late = [(r, room.stage) for r, room in self._rooms.open.items() if now > room.deadline]
            self._timeouts += len(late)
        for room_id, stage in late:
            limit = getattr(self.timeouts, f"{stage}_s")
            self._finish(
                room_id,
                Failure(
                    room_id,
                    ErrorInfo(504, "timeout", f"request timed out in {stage} after {limit:g} s"),
                ),
                reason=f"{stage} timeout",
            )
