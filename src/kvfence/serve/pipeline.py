"""The in-process coordinator: the prefill and decode roles turned by one engine thread.

kvfence is always disaggregated in structure. Here the prefill engine and the
decode engine each own a `KVPool` in the same process, each is driven by its
role (kvfence/roles) exactly as a worker's is, and KV moves from one pool to the
other through a transport's two halves (`transfer/link.py`) under the same
contract as across processes: a grant before any write, a manifest that decode
reconciles (I3), and an inbound window that defers any release until the
transport confirms (I7).

The engine thread loops: route what callers submitted and aborted (the router
role, engine/routing.py: bootstrap at decode, then prefill work), then one turn
of the decode role (what landed, I3; reservations and tokens out) and one of the
prefill role (work in, the step, KV out). With mixed batches
(`EngineConfig.mixed_batches`) the prefill role carries the decode engine: one
forward runs decode's rows first and prefill's chunks in the rest of the token
budget, each engine's rows attending only in its own pool, both pools' page
tables verified before any read (I1). What one role hands the other waits in an
inbox until the other's turn (serve/local_control.py). The thread sleeps on a
condition when there is nothing to do. Every request ends exactly once at its
sink: its last `TokenChunk` (with `finish_reason`) or one `Failure` (I6).

A request that makes the step raise fails alone (engine/row_errors.py: the
engines run its rows again one by one). An exception no request explains is
the engine's own fault: every open request fails with a generic 500 (never
another request's error text), the pipeline is broken from then on (`health`
says why, each new request is a 503 at once) and the thread stays to answer,
so no request ever waits on an engine that will not run it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvfence.engine.backend import BackendStats, GenerateWork, PoolInfo, Sink
from kvfence.engine.collecting import CollectingSink, Result
from kvfence.engine.config import EngineConfig
from kvfence.engine.decode import DecodeEngine
from kvfence.engine.messages import Abort, ErrorInfo, Failure
from kvfence.engine.prefill import PrefillEngine
from kvfence.engine.routing import Room, Rooms
from kvfence.engine.row_errors import describe
from kvfence.engine.threads import enter_engine_thread
from kvfence.faults import FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool
from kvfence.model.base import CausalLM
from kvfence.roles.decode import DecodeRole
from kvfence.roles.prefill import PrefillRole
from kvfence.serve.local_control import (
    LinkOut,
    LocalDecodeControl,
    LocalExchange,
    LocalPrefillControl,
)
from kvfence.transfer.link import TransportLink

__all__ = ["CollectingSink", "LocalPipeline", "Result"]  # the sink lives in engine/collecting.py

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.01  # re-check after a turn that made no progress (e.g. waiting for pages)

KVLinkFactory = Callable[[KVPool], TransportLink]  # decode's pool -> the link that writes into it


@dataclass(slots=True)
class _Submit:
    work: GenerateWork
    sink: Sink


@dataclass(slots=True)
class _AbortCmd:
    room: str
    reason: str


class LocalPipeline:
    """The embedded default `Backend`: prefill + decode roles, each engine with its own pool.

    Example::

        from kvfence.engine.config import EngineConfig
        from kvfence.engine.messages import SamplingParams
        from kvfence.serve.pipeline import CollectingSink, LocalPipeline
        from kvfence.model.loader import load_model
        from kvfence.engine.backend import GenerateWork
        from kvfence.transfer.link import inprocess_link

        loaded = load_model(checkpoint_dir, kind="mirror")
        geometry = loaded.config.kv_geometry(page_size=16)
        config = EngineConfig(prefill_pages=256, decode_pages=512, page_size=16,
                              eos_token_ids=loaded.config.eos_token_ids)
        pipe = LocalPipeline(loaded.model, geometry, config, kv_link=inprocess_link)
        pipe.start()
        sink = CollectingSink()
        pipe.submit(GenerateWork("room-1", "tenant-a", (5, 6, 7), SamplingParams(max_tokens=3,
                    temperature=0.0), "tenant-a"), sink)
        result = sink.wait(timeout=30)   # result.token_ids == [5, 6, 7] on the mirror model
        pipe.stop()

    `submit` and `abort` are thread-safe and never block on the model; events
    reach the sink from the engine thread. `kv_link` makes the transport from
    decode's pool (`transfer.link.inprocess_link`, or any `KVTransport` through
    `TransportLink.open`). `torch_threads` (0: torch's setting) are the engine
    thread's intra-op threads; a server builds with one and gives the rest here
    (engine/threads.py says why).
    """

    def __init__(
        self,
        model: CausalLM,
        geometry: KVGeometry,
        config: EngineConfig,
        faults: FaultSet | None = None,
        *,
        kv_link: KVLinkFactory,
        device: str | torch.device = "cpu",
        torch_threads: int = 0,
    ) -> None:
        if geometry.page_size != config.page_size:
            raise ValueError(
                f"geometry page size {geometry.page_size} != config page size {config.page_size}"
            )
        self.config = config
        self.faults = faults or FaultSet()
        self.prefill_pool = KVPool(
            geometry, config.prefill_pages, scrub=config.scrub, faults=self.faults, device=device
        )
        self.decode_pool = KVPool(
            geometry, config.decode_pages, scrub=config.scrub, faults=self.faults, device=device
        )
        self.kv_link = kv_link(self.decode_pool)
        self.prefill = PrefillEngine(model, self.prefill_pool, config, self.faults)
        self.decode = DecodeEngine(
            model, self.decode_pool, config, self.faults, inbound=self.kv_link.window
        )
        mixed = config.mixed_batches
        self.kv_out = LinkOut(self.kv_link)
        self.decode_role = DecodeRole(self.decode, self.kv_link.receiver, carried=mixed)
        carries = self.decode if mixed else None
        self.prefill_role = PrefillRole(self.prefill, self.kv_out, carries=carries)
        self.rooms = Rooms(self.faults)  # requests not yet ended (I6: each ends once)
        self._x = LocalExchange(self.rooms)
        self._prefill_control = LocalPrefillControl(self._x)
        self._decode_control = LocalDecodeControl(self._x)
        self._cond = threading.Condition()
        self._inbox: list[_Submit | _AbortCmd] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle = True
        self._broken: str | None = None
        self._torch_threads = torch_threads  # the engine thread's (engine/threads.py)

    # ---- Backend ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("pipeline already started")
        self._thread = threading.Thread(target=self._loop, name="kvfence-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, work: GenerateWork, sink: Sink) -> None:
        why = self._dead_thread()
        if why is not None:  # nobody would ever run it: end it now (I6)
            sink(Failure(work.room, ErrorInfo(503, "server_error", why)))
            return
        self._post(_Submit(work, sink))

    def abort(self, room: str, reason: str) -> None:
        self._post(_AbortCmd(room, reason))

    def health(self) -> str | None:
        """None while the engine can serve; else why not (broken, stopped, or its thread died)."""
        return self._broken or self._dead_thread()

    def stats(self) -> BackendStats:
        roles = self.prefill_role.counters() + self.decode_role.counters()
        counters = dataclasses.replace(
            roles,
            aborted=self.rooms.aborted,  # the router role's count: each request once
            prompt_tokens=self.rooms.prompt_tokens,
        )
        prefill = PoolInfo.of("prefill", self.prefill_pool, self.prefill_role.evictable_pages())
        return BackendStats(counters, (prefill, PoolInfo.of("decode", self.decode_pool)))

    def _post(self, cmd: _Submit | _AbortCmd) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._idle = False
            self._cond.notify_all()

    def _dead_thread(self) -> str | None:
        if self._stopping:
            return "the engine is stopped"
        thread = self._thread
        if thread is not None and not thread.is_alive():
            return "the engine thread is not running"
        return None

    # ---- for tests and operators (call at a quiescent point) --------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the engine thread has nothing left to do; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._idle and not self._inbox, timeout)

    def check_integrity(self) -> None:
        """Both ledgers consistent and every handle the engines hold still current."""
        self.prefill_pool.check_integrity(self.prefill_role.outstanding())
        self.decode_pool.check_integrity(self.decode_role.outstanding())

    def clear_prefix_cache(self) -> int:
        """Evict every unreferenced cached page (stop the pipeline or wait_idle first)."""
        return self.prefill.cache.clear()

    def pump(self) -> bool:
        """One iteration in the caller's thread (only while not started); True if it did anything.

        For tests and step-by-step replays that need to stop the engine at an exact stage.
        """
        if self._thread is not None:
            raise RuntimeError("pump() drives a pipeline that was not started")
        with self._cond:
            inbox, self._inbox = self._inbox, []
        return self._iterate(inbox)

    def drive(self, max_iterations: int = 100_000) -> int:
        """`pump` until nothing is left to do; returns the iterations used."""
        for i in range(max_iterations):
            if not (self.pump() or self._has_work() or self._inbox):
                return i + 1
        raise RuntimeError(f"pipeline still busy after {max_iterations} iterations")

    # ---- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        enter_engine_thread(self._torch_threads)
        progressed = False
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or progressed or self._has_work()):
                    self._idle = True
                    self._cond.notify_all()
                    self._cond.wait()
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            try:
                progressed = self._iterate(inbox)
            except Exception as e:  # no request explains it: end every open one honestly (I6)
                log.exception("engine step failed")
                self._break(f"the engine failed ({type(e).__name__}); it needs a restart")
                progressed = False
                continue  # broken: the loop now only answers new requests with a 503
            if not progressed:
                with self._cond:
                    self._cond.wait(_IDLE_POLL_S)

    def _has_work(self) -> bool:
        """A turn would make progress. A KV send that just landed shows only at decode's next
        poll, so the loop also turns once more after any turn that progressed (`_loop`)."""
        if self._broken is not None:
            return False  # a broken engine never steps again
        x = self._x
        return bool(
            self.prefill_role.has_work or self.decode.has_work or x.to_prefill or x.to_decode
        )

    def _iterate(self, inbox: Iterable[_Submit | _AbortCmd]) -> bool:
        """route submits and aborts -> decode's turn -> prefill's turn (the step)."""
        progressed = False
        for cmd in inbox:
            progressed = True
            if isinstance(cmd, _Submit):
                self._route_submit(cmd.work, cmd.sink)
            elif self._broken is None:
                self._route_abort(cmd.room, cmd.reason)
        if self._broken is not None:
            return progressed
        before = self.prefill.counters.computed_tokens + self.decode.counters.generation_tokens
        self._x.progressed = False
        self.decode_role.turn(self._decode_control)
        self.prefill_role.turn(self._prefill_control)
        after = self.prefill.counters.computed_tokens + self.decode.counters.generation_tokens
        return progressed or self._x.progressed or after != before

    # ---- the router role (engine/routing.py) ------------------------------------------------

    def _route_submit(self, work: GenerateWork, sink: Sink) -> None:
        if self._broken is not None:
            sink(Failure(work.room, ErrorInfo(503, "server_error", self._broken)))
            return
        boot = self.rooms.admit(Room(work, sink))
        if isinstance(boot, Failure):
            sink(boot)  # the room is someone else's: never merged (I9)
            return
        self._x.to_decode.append(boot)

    def _route_abort(self, room: str, reason: str) -> None:
        ending = self.rooms.abort(room, reason)
        if ending is None:
            return
        self._x.abort_in_roles(room, reason)
        self._x.deliver(ending)

    def _break(self, why: str) -> None:
        """End every open request with `why` (the engine's fault, no request's text) and
        release what the engines still hold, as far as a failed engine allows."""
        self._broken = why
        rooms = list(self.rooms.open)
        for room in rooms:
            self._x.deliver(Failure(room, ErrorInfo(500, "server_error", why)))
        for room in rooms:
            try:
                self.prefill_role.take(Abort(room, why))
                self.decode_role.abort(room, why)
            except Exception as e:
                log.error("releasing room %s after the engine failed: %s", room, describe(e))
        with self._cond:
            self._idle = True
            self._cond.notify_all()
