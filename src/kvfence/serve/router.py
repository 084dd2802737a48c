"""The request path: auth -> parse -> tokenize -> validate -> room -> backend -> SSE / JSON.

Everything that can be refused is refused before `backend.submit` (I4: the
edge limit on prompt + max_tokens; bad input of any kind), so a refused
request allocates nothing. After submission a request ends exactly once
(I6): content with a finish reason, or the backend's original error as an
error status (or an SSE error event) — never a normal 200. Room ids are made
here with `secrets`, never taken from a client, and checked for collisions
(I9). Each request only ever sees events for its own room; the client gets
no room id, no handle to cancel and no view of other tenants' requests (I10).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvfence.engine.backend import Backend, GenerateWork
from kvfence.engine.messages import ErrorInfo, Failure, MessageError, SamplingParams, TokenChunk
from kvfence.faults import Fault
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve import protocol
from kvfence.serve.config import Capacity, ServeConfig
from kvfence.serve.metrics import Outcome, RouterCounters
from kvfence.serve.output import OutputAssembler, Piece
from kvfence.serve.protocol import ApiError, GenerationRequest, bad_request
from kvfence.serve.request_log import RequestLatency
from kvfence.serve.tenants import TenantRegistry

log = logging.getLogger(__name__)
ROOM_ATTEMPTS = 4
INTERNAL_ERROR = ApiError(
    500,
    "internal server error; the request was stopped",
    type="server_error",
    code="internal_error",
)
Event = TokenChunk | Failure


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request that passed every check and may be submitted."""

    req: GenerationRequest
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_namespace: str


@dataclass(slots=True)
class Run:
    """One submitted request, as the router sees it."""

    room: str
    tenant: str
    prep: Prepared
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # the client disconnected
    ended: bool = False  # the backend's side is over (terminal event seen, or aborted)
    counted: bool = False  # its outcome is in the metrics (exactly once)
    # What the client sees as the id: independent of the room, which clients never learn (I9).
    response_id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    # Signal 3: timings of this request, for the histograms and its log line.
    submitted_s: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    prefill_s: float | None = None
    cached_tokens: int = 0
    generated: int = 0


class Router:
    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        config: ServeConfig,
        capacity: Capacity,
        tenants: TenantRegistry,
        counters: RouterCounters,
        latency: RequestLatency | None = None,
    ) -> None:
        self.latency = latency
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.capacity = capacity
        self.tenants = tenants
        self.counters = counters
        self.rooms: dict[str, str] = {}  # live room -> tenant
        self._watchers: set[asyncio.Task[None]] = set()

    # ---- auth ---------------------------------------------------------------------------

    def authenticate(self, request: Request) -> str:
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        if tenant is None:
            raise ApiError(
                401,
                "missing or invalid API key; send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )
        return tenant

    # ---- validation ---------------------------------------------------------------------

    def prepare(self, req: GenerationRequest, tenant: str) -> Prepared:
        """Tokenize and check everything; raises `ApiError`, never touches the backend."""
        self.check_model(req.model)
        ids, param = self._prompt_ids(req)
        self.check_ids(ids, param)
        self.check_ids(req.stop_token_ids, "stop_token_ids")
        max_tokens = self._max_tokens(len(ids), req.max_tokens, param)
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=req.logprobs,
            )
        except MessageError as e:
            raise bad_request(str(e), None) from None
        return Prepared(req, tenant, ids, sampling, self.cache_namespace(tenant, req.cache_salt))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def cache_namespace(self, tenant: str, salt: str | None) -> str:
        """The prefix-cache namespace (I8): the tenant's own, split further by `cache_salt`."""
        shared = self.config.prefix_namespacing == "shared"
        base = "shared" if shared else f"tenant:{tenant}"
        if salt is None:
            return base
        return f"{base}/salt:{hashlib.sha256(salt.encode()).hexdigest()[:32]}"

    def encode_chat(self, messages: tuple[protocol.ChatMessage, ...]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages]
            )
        except Exception as e:  # jinja raises many kinds; any of them is a bad conversation
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        return self.tokenizer.encode(text)

    def _prompt_ids(self, req: GenerationRequest) -> tuple[tuple[int, ...], str]:
        if req.kind == "chat":
            assert isinstance(req.prompt, tuple)
            messages = tuple(m for m in req.prompt if isinstance(m, protocol.ChatMessage))
            return tuple(self.encode_chat(messages)), "messages"
        if isinstance(req.prompt, str):
            return tuple(self.tokenizer.encode(req.prompt)), "prompt"
        return tuple(t for t in req.prompt if isinstance(t, int)), "prompt"

    def check_ids(self, ids: tuple[int, ...], param: str) -> None:
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"`{param}` holds token id {bad}, outside the vocabulary [0, {vocab})",
                param,
                "token_out_of_vocab",
            )

    def _max_tokens(self, n: int, asked: int | None, param: str) -> int:
        ctx, edge = self.config.context_length, self.capacity.edge_limit
        if n == 0:
            raise bad_request(f"`{param}` is empty; send at least one token", param, "empty_prompt")
        if n > ctx:
            raise bad_request(
                f"`{param}` has {n} tokens; this model's maximum context length is {ctx} tokens",
                param,
                "context_length_exceeded",
            )
        # I4: with an undersized pool the edge is the pool, and it is enforced here,
        # before the backend sees anything.
        limit_name = "pool_capacity_exceeded" if edge < ctx else "context_length_exceeded"
        default = max(1, min(self.config.default_max_tokens, edge - n))
        max_tokens = asked if asked is not None else default
        if n + max_tokens > edge:
            raise bad_request(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"this server's limit of {edge} tokens per request (max_req_input_len)",
                param if n >= edge else "max_tokens",
                limit_name,
            )
        return max_tokens

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

    # ---- submission ---------------------------------------------------------------------

    def submit(self, prep: Prepared) -> Run:
        run = Run(room=self.new_room(prep.tenant), tenant=prep.tenant, prep=prep)
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
            _time_chunk(run, event)
        return event

    def finish(self, run: Run, reason: str | None) -> None:
        """Close our side of the run; abort the backend's side when it is not over (I7)."""
        if not run.ended:
            run.ended = True
            self.backend.abort(run.room, reason or "router finished the request")
        self.rooms.pop(run.room, None)

    # ---- the endpoints -------------------------------------------------------------------

    async def generate(self, request: Request, kind: protocol.Kind) -> Response:
        tenant: str | None = None
        try:
            tenant = self.authenticate(request)
            obj = protocol.load_json(await read_body(request, self.body_limit))
            req = protocol.parse_chat(obj) if kind == "chat" else protocol.parse_completion(obj)
            prep = self.prepare(req, tenant)
            run = self.submit(prep)
        except ApiError as e:
            self.counters.rejected(e.code or e.type)
            if self.latency is not None and tenant is not None:
                self.latency.record(tenant, 0, outcome="rejected")
            raise
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
        if prep.req.stream:
            return StreamingResponse(
                self._stream(run, first, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
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

    @property
    def body_limit(self) -> int:
        return 16 * 1024 * 1024 + 32 * self.config.context_length

    def _client_gone(self, run: Run) -> Response:
        self.finish(run, "client disconnected")
        self._outcome(run, "aborted")
        return Response(status_code=499)

    def _outcome(self, run: Run, outcome: Outcome, reason: str | None = None) -> None:
        if run.counted:
            return
        run.counted = True
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
        req = run.prep.req
        out = self._assembler(req)
        text: list[str] = []
        logprobs: list[protocol.TokenLogprob] = []
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
        body = self._envelope(run, final=True)
        content = "".join(text)
        lp = self._logprobs_body(req, logprobs, 0)
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": content}}
        else:
            choice = {"index": 0, "text": content}
        body["choices"] = [{**choice, "logprobs": lp, "finish_reason": out.finish_reason}]
        body["usage"] = self._usage(run, out)
        return JSONResponse(body)

    async def _stream(
        self, run: Run, event: Event | None, watcher: asyncio.Task[None]
    ) -> AsyncIterator[str]:
        req = run.prep.req
        out = self._assembler(req)
        try:
            if req.kind == "chat":
                yield self._chunk(run, {"role": "assistant", "content": ""}, None, None)
            while True:
                if event is None:
                    return  # client gone; `finally` aborts
                result = self._apply(run, out, event)
                if isinstance(result, Failure):
                    self.finish(run, None)
                    err = self._failed(run, result)
                    yield sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
                if result.text or result.logprobs or result.finish_reason:
                    yield self._piece_chunk(run, result)
                if result.finish_reason is not None:
                    break
                event = await self.next_event(run)
            self.finish(run, None)
            self._outcome(run, "finished")
            if req.include_usage:
                yield sse(
                    {
                        **self._envelope(run, final=False),
                        "choices": [],
                        "usage": self._usage(run, out),
                    }
                )
            yield "data: [DONE]\n\n"
        except Exception:
            # A router bug mid-stream: still end honestly (I6), never with a silent cut.
            log.exception("stream %s failed in the router", run.room[:8])
            self.finish(run, "router error")
            self._outcome(run, "failed")
            yield sse(INTERNAL_ERROR.body())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not run.counted:
                # The client went away mid-stream (or the send failed): free its pages now.
                self.finish(run, "client disconnected")
                self._outcome(run, "aborted")

    # ---- response shapes -----------------------------------------------------------------

    def _assembler(self, req: GenerationRequest) -> OutputAssembler:
        return OutputAssembler(self.tokenizer, req.stop, req.logprobs is not None)

    def _envelope(self, run: Run, *, final: bool) -> dict[str, Any]:
        if run.prep.req.kind == "chat":
            obj, prefix = ("chat.completion" if final else "chat.completion.chunk"), "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {
            "id": prefix + run.response_id,
            "object": obj,
            "created": run.created,
            "model": self.config.model_name,
        }

    def _chunk(
        self,
        run: Run,
        payload: dict[str, Any] | str,
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
    ) -> str:
        if run.prep.req.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": payload}
        else:
            choice = {"index": 0, "text": payload}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return sse({**self._envelope(run, final=False), "choices": [choice]})

    def _piece_chunk(self, run: Run, piece: Piece) -> str:
        req = run.prep.req
        lp = self._logprobs_body(req, list(piece.logprobs), piece.text_start)
        payload: dict[str, Any] | str
        if req.kind == "chat":
            payload = {"content": piece.text} if piece.text else {}
        else:
            payload = piece.text
        return self._chunk(run, payload, lp, piece.finish_reason)

    def _logprobs_body(
        self, req: GenerationRequest, entries: list[protocol.TokenLogprob], start: int
    ) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        if req.kind == "chat":
            return protocol.chat_logprobs(entries)
        return protocol.completion_logprobs(entries, start)

    def _usage(self, run: Run, out: OutputAssembler) -> dict[str, Any]:
        return protocol.usage(len(run.prep.prompt_ids), out.completion_tokens, out.cached_tokens)


def _time_chunk(run: Run, chunk: TokenChunk) -> None:
    if run.ttft_s is None:
        run.ttft_s = time.perf_counter() - run.submitted_s
        run.prefill_s = chunk.prefill_s if chunk.prefill_s > 0 else None
    run.cached_tokens = max(run.cached_tokens, chunk.cached_tokens)
    run.generated += len(chunk.token_ids)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"request body exceeds {limit} bytes", param=None, code="body_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)
