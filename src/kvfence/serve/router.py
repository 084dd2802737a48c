"""The request path: admission -> room -> backend -> collect (JSON) or stream (SSE).

Everything that can be refused is refused by `Admission` before
`backend.submit` (I4: the edge limit on prompt + max_tokens; bad input of any
kind), so a refused request allocates nothing. After submission a request ends exactly once
(I6): content with a finish reason, or the backend's original error as an
error status (or an SSE error event) — never a normal 200. Room ids are made
here with `secrets`, never taken from a client, and checked for collisions
(I9). Each request only ever sees events for its own room; the client gets
no room id, no handle to cancel and no view of other tenants' requests (I10).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvfence.engine.backend import Backend, GenerateWork
from kvfence.engine.messages import ErrorInfo, Failure, TokenChunk
from kvfence.faults import Fault
from kvfence.serve.admission import Admission, Prepared
from kvfence.serve.body import read_body
from kvfence.serve.config import ServeConfig
from kvfence.serve.engine_metrics import RequestTimes
from kvfence.serve.errors import INTERNAL_ERROR, ApiError
from kvfence.serve.limits import Slot
from kvfence.serve.metrics import Outcome, RouterCounters
from kvfence.serve.output import OutputAssembler
from kvfence.serve.protocol import Kind
from kvfence.serve.request_log import RequestLatency
from kvfence.serve.responses import DONE, Piece, Shape, TokenLogprob, sse, usage
from kvfence.serve.tokenizing import encodings

log = logging.getLogger(__name__)
ROOM_ATTEMPTS = 4
Event = TokenChunk | Failure


@dataclass(slots=True)
class Run:
    """One submitted request, as the router sees it."""

    room: str
    tenant: str
    prep: Prepared
    shape: Shape  # the response's id and envelope; the id is not the room (I9)
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # the client disconnected
    ended: bool = False  # the backend's side is over (terminal event seen, or aborted)
    counted: bool = False  # its outcome is in the metrics (exactly once)
    slot: Slot | None = None  # its share of the tenant's admission limits
    # Signal 3: timings of this request, for the histograms and its log line.
    submitted_s: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    last_token_s: float | None = None  # its latest token event (inter-token latency)
    prefill_s: float | None = None
    cached_tokens: int = 0
    generated: int = 0


class Router:
    """Rooms, submission, and the one end of every request (I6); admission is `Admission`."""

    def __init__(
        self,
        backend: Backend,
        admission: Admission,
        config: ServeConfig,
        counters: RouterCounters,
        latency: RequestLatency | None = None,
        times: RequestTimes | None = None,
    ) -> None:
        self.latency = latency
        self.times = times or RequestTimes(None, config.model_name)  # running/waiting, e2e, ITL
        self.backend = backend
        self.admission = admission
        self.config = config
        self.counters = counters
        self.rooms: dict[str, str] = {}  # live room -> tenant
        self._watchers: set[asyncio.Task[None]] = set()

    # ---- rooms (I9) ----------------------------------------------------------------------

    def new_room(self, tenant: str) -> str:
        for _ in range(ROOM_ATTEMPTS):
            room = secrets.token_hex(16)
            if room not in self.rooms:
                self.rooms[room] = tenant
                return room
            self.counters.room_collisions += 1
            log.error("room id collision detected; drawing a new one")
        raise ApiError(
            500, "could not draw a unique request id", type="server_error", code="room_collision"
        )

    def claim_room(self, room: str, tenant: str) -> str:
        """A room someone else made (SGLang's router), bound to this tenant; 409 if in use (I9)."""
        if room in self.rooms:
            self.counters.room_collisions += 1
            raise ApiError(409, f"room {room} is already in use (I9)", code="room_collision")
        self.rooms[room] = tenant
        return room

    # ---- submission ---------------------------------------------------------------------

    def submit(self, prep: Prepared, room: str | None = None, peer: str = "") -> Run:
        """Submit under a fresh room, or under `room` already claimed for this tenant."""
        shape = Shape(prep.req, self.config.model_name)
        room = room if room is not None else self.new_room(prep.tenant)
        run = Run(room=room, tenant=prep.tenant, prep=prep, shape=shape)
        loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:
            # Called from the engine's thread; hand the event to the loop.
            try:
                loop.call_soon_threadsafe(run.queue.put_nowait, event)
            except RuntimeError:
                log.warning("event for room %s after the server loop closed", run.room[:8])

        work = GenerateWork(
            room=run.room,
            tenant=prep.tenant,
            prompt_ids=prep.prompt_ids,
            sampling=prep.sampling,
            cache_namespace=prep.cache_namespace,
            peer=peer,
        )
        try:
            self.backend.submit(work, sink)
        except Exception:
            self.rooms.pop(run.room, None)
            raise
        return run

    async def next_event(self, run: Run) -> Event | None:
        """The next event for this run, or None once the client is gone."""
        if run.queue.empty() and run.gone.is_set():
            return None
        getter = asyncio.ensure_future(run.queue.get())
        gone = asyncio.ensure_future(run.gone.wait())
        try:
            await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not getter.done():
                getter.cancel()
        if not getter.done() or getter.cancelled():
            return None
        event = getter.result()
        if run.slot is not None:
            run.slot.prefilled()  # the first event ends the prompt's wait (idempotent)
        if event.room != run.room:
            # I9/I10: an event for another room must never reach this client.
            self.counters.isolation_violations += 1
            log.error("event for a foreign room reached request %s", run.room[:8])
            self.finish(run, "isolation check failed")
            return Failure(
                run.room,
                ErrorInfo(
                    500,
                    "server_error",
                    "internal isolation check failed: an event for another request arrived",
                    code="isolation_violation",
                ),
            )
        if isinstance(event, TokenChunk):
            self.times.chunk(run, event, self.rooms)
        return event

    def _admit_and_submit(self, kind: Kind, tenant: str, body: bytes, request: Request) -> Run:
        prep = self.admission.admit(kind, tenant, body)
        # Per-tenant limits (serve/limits.py): a 429 here has made no room, allocated nothing.
        slot = self.admission.limits.acquire(tenant, len(prep.prompt_ids))
        try:
            run = self.submit(prep)
        except BaseException:
            slot.release()
            raise
        run.slot = slot
        return run

    def finish(self, run: Run, reason: str | None) -> None:
        """Close our side of the run; abort the backend's side when it is not over (I7)."""
        if run.slot is not None:
            run.slot.release()
        if not run.ended:
            run.ended = True
            self.backend.abort(run.room, reason or "router finished the request")
        self.rooms.pop(run.room, None)
        self.times.ended(run, None)

    # ---- the endpoints -------------------------------------------------------------------

    async def generate(self, request: Request, kind: Kind) -> Response:
        """admit -> submit -> watch the client -> first event -> stream or collect."""
        run = await self._admit(request, kind)
        watcher = asyncio.create_task(self._watch_disconnect(request, run))
        self._watchers.add(watcher)  # the loop keeps only weak references to tasks
        watcher.add_done_callback(self._watchers.discard)
        try:
            first = await self.next_event(run)
        except BaseException:
            watcher.cancel()
            self.finish(run, "router error")
            raise
        if first is None:
            watcher.cancel()
            return self._client_gone(run)
        if isinstance(first, Failure) and Fault.ABORT_AS_SUCCESS not in self.config.faults:
            watcher.cancel()
            run.ended = True
            self.finish(run, None)
            raise self._failed(run, first)
        if run.prep.req.stream:
            return StreamingResponse(
                self._stream(run, first, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._respond(run, first, watcher)

    async def _admit(self, request: Request, kind: Kind) -> Run:
        """Authenticate, read the body within its limit, admit and submit; a refusal is counted."""
        tenant: str | None = None
        try:
            tenant = self.admission.authenticate(request.headers.get("authorization"))
            self.admission.limits.precheck(tenant)  # at its concurrency limit: 429, unread
            body = await read_body(request, self.admission.body_limit, self.config.body_timeout_s)
            # A large prompt is tokenized in the admission's bounded pool, off the loop; the
            # rest of admission (limits, room, submission) stays on it.
            ahead = await self.admission.encode_ahead(kind, body)
            with encodings(ahead):
                return self._admit_and_submit(kind, tenant, body, request)
        except ApiError as e:
            self.counters.rejected(e.code or e.type)
            self.admission.limits.refused(tenant, e)  # refusals draw on the tenant's bucket
            if self.latency is not None and tenant is not None:
                self.latency.record(tenant, 0, outcome="rejected")
            raise

    async def _respond(self, run: Run, first: Event, watcher: asyncio.Task[None]) -> Response:
        """The whole (non-stream) answer; the backend side is ended whatever happens."""
        try:
            return await self._collect(run, first)
        except ApiError:
            raise  # the backend's own error, already counted
        except Exception:
            log.exception("request %s failed in the router", run.room[:8])
            self._outcome(run, "failed")
            raise
        finally:
            watcher.cancel()
            self.finish(run, "router error")  # no-op unless the backend side is still running

    def _client_gone(self, run: Run) -> Response:
        self.finish(run, "client disconnected")
        self._outcome(run, "aborted")
        return Response(status_code=499)

    def _outcome(self, run: Run, outcome: Outcome, reason: str | None = None) -> None:
        if run.counted:
            return
        run.counted = True
        self.times.ended(run, outcome)
        if self.latency is not None:
            self.latency.record(
                run.tenant,
                len(run.prep.prompt_ids),
                cached_tokens=run.cached_tokens,
                completion_tokens=run.generated,
                prefill_s=run.prefill_s,
                ttft_s=run.ttft_s,
                outcome=outcome,
            )
        if outcome == "rejected":
            self.counters.rejected(reason or "unknown")
        else:
            self.counters.outcome(outcome)

    async def _watch_disconnect(self, request: Request, run: Run) -> None:
        """When the client disconnects, abort at once, even if no one is reading the run."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                run.gone.set()
                if not run.ended:
                    self.finish(run, "client disconnected")
                    self._outcome(run, "aborted")
                return

    def _failed(self, run: Run, failure: Failure) -> ApiError:
        """The backend's original error, unchanged (I6)."""
        e = failure.error
        if e.type == "aborted":  # an abort from outside this request's router path
            self._outcome(run, "aborted")
        elif e.status < 500:
            self._outcome(run, "rejected", e.code or e.type)
        else:
            self._outcome(run, "failed")
        return ApiError(e.status, e.message, type=e.type, param=e.param, code=e.code)

    def _apply(self, run: Run, out: OutputAssembler, event: Event) -> Piece | Failure:
        if isinstance(event, Failure):
            run.ended = True
            if Fault.ABORT_AS_SUCCESS in self.config.faults:
                # Lab (SGLang #33507): the failure is dressed up as a normal, truncated answer.
                out.finish_reason = "length"
                return Piece("", (), "length", out.emitted)
            return event
        if event.finish_reason is not None:
            run.ended = True
        piece = out.push(event)
        if out.stopped_by_string:
            self.finish(run, "stop string matched")
        return piece

    async def _collect(self, run: Run, event: Event | None) -> Response:
        out = self._assembler(run)
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        while True:
            if event is None:
                return self._client_gone(run)
            result = self._apply(run, out, event)
            if isinstance(result, Failure):
                self.finish(run, None)
                raise self._failed(run, result)
            text.append(result.text)
            logprobs.extend(result.logprobs)
            if result.finish_reason is not None:
                break
            event = await self.next_event(run)
        self.finish(run, None)
        self._outcome(run, "finished")
        body = run.shape.body("".join(text), logprobs, out.finish_reason, self._usage(run, out))
        return JSONResponse(body)

    async def _stream(
        self, run: Run, event: Event | None, watcher: asyncio.Task[None]
    ) -> AsyncIterator[str]:
        req, shape = run.prep.req, run.shape
        out = self._assembler(run)
        try:
            if req.kind == "chat":
                yield shape.role_chunk()
            while True:
                if event is None:
                    return  # client gone; `finally` aborts
                result = self._apply(run, out, event)
                if isinstance(result, Failure):
                    self.finish(run, None)
                    err = self._failed(run, result)
                    yield sse(err.body())
                    yield DONE
                    return
                if result.text or result.logprobs or result.finish_reason:
                    yield shape.piece_chunk(result)
                if result.finish_reason is not None:
                    break
                event = await self.next_event(run)
            self.finish(run, None)
            self._outcome(run, "finished")
            if req.include_usage:
                yield shape.usage_chunk(self._usage(run, out))
            yield DONE
        except Exception:
            # A router bug mid-stream: still end honestly (I6), never with a silent cut.
            log.exception("stream %s failed in the router", run.room[:8])
            self.finish(run, "router error")
            self._outcome(run, "failed")
            yield sse(INTERNAL_ERROR.body())
            yield DONE
        finally:
            watcher.cancel()
            if not run.counted:
                # The client went away mid-stream (or the send failed): free its pages now.
                self.finish(run, "client disconnected")
                self._outcome(run, "aborted")

    def _assembler(self, run: Run) -> OutputAssembler:
        req = run.prep.req
        return OutputAssembler(self.admission.tokenizer, req.stop, req.logprobs is not None)

    def _usage(self, run: Run, out: OutputAssembler) -> dict[str, Any]:
        return usage(len(run.prep.prompt_ids), out.completion_tokens, out.cached_tokens)
