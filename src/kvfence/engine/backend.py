"""The contract between the HTTP router and whatever runs the model.

The router authenticates, tokenizes, validates and then hands a `GenerateWork`
to a `Backend`. A backend is either the in-process pipeline (prefill and
decode engines in one process, the embedded default) or the disaggregated one
(prefill and decode worker processes over ZeroMQ and a KV transport). Both
speak the same typed messages (`kvfence.engine.messages`).

Delivery: `submit` never blocks on the model. Events for the request arrive
through `sink`, possibly from another thread: zero or more `TokenChunk`s, the
last with `finish_reason` set, or exactly one `Failure` (I6: every request
ends exactly once, and a failure is never reported as success).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvfence.engine.counters import Counters
from kvfence.engine.messages import (
    Bootstrap,
    Failure,
    PageRef,
    PrefillWork,
    SamplingParams,
    TokenChunk,
)

if TYPE_CHECKING:
    from kvfence.kv.pool import KVPool

Sink = Callable[[TokenChunk | Failure], None]


@dataclass(frozen=True, slots=True)
class GenerateWork:
    """One admitted request, as the router hands it to a backend; the PD messages derive from it."""

    room: str  # made by the server, never by a client (I9)
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    # tenant, or tenant + cache_salt; a shared namespace only by operator opt-in (I8)
    cache_namespace: str
    # Behind SGLang's router: the prefill bootstrap address the router assigned this room to.
    peer: str = ""

    def bootstrap(self) -> Bootstrap:
        """Decode's reservation request: pages for exactly this prompt (I3 checks against it)."""
        return Bootstrap(
            room=self.room,
            tenant=self.tenant,
            num_prompt_tokens=len(self.prompt_ids),
            max_tokens=self.sampling.max_tokens,
            sampling=self.sampling,
        )

    def prefill_work(self, dest_pages: tuple[PageRef, ...], decode_addr: str = "") -> PrefillWork:
        """Prefill's job, once decode has reserved `dest_pages` (at `decode_addr` in PD mode)."""
        return PrefillWork(
            room=self.room,
            tenant=self.tenant,
            prompt_ids=self.prompt_ids,
            sampling=self.sampling,
            dest_pages=dest_pages,
            cache_namespace=self.cache_namespace,
            decode_addr=decode_addr,
        )


@dataclass(frozen=True, slots=True)
class PoolInfo:
    role: str  # "prefill" or "decode"
    pool_tokens: int
    page_size: int
    pages_used: int
    pages_free: int
    pages_pending: int
    # Of pages_used: pages only the prefix cache holds, which it gives back the moment an
    # allocation needs them (free for the KV usage fraction, as vLLM and SGLang count them).
    pages_cached: int = 0

    @property
    def usage(self) -> float:
        """Fraction of the pool no new request can have now: held by a request, or parked
        until a transfer ends (I7); evictable prefix-cache pages count as free."""
        total = self.pages_used + self.pages_free + self.pages_pending
        held = self.pages_used - self.pages_cached + self.pages_pending
        return held / total if total else 0.0

    @classmethod
    def of(cls, role: str, pool: KVPool, cached: int = 0) -> PoolInfo:
        """A live pool's figures now; `cached`: of its used pages, those only a prefix
        cache holds."""
        return cls(
            role,
            pool.capacity_tokens,
            pool.page_size,
            pool.num_used,
            pool.num_free,
            pool.num_pending,
            cached,
        )


@dataclass(frozen=True, slots=True)
class BackendStats:
    """The backend's counts since start (the router's view of outcomes) and its live pools."""

    counters: Counters = field(default_factory=Counters)
    pools: tuple[PoolInfo, ...] = field(default_factory=tuple)


class Backend(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, work: GenerateWork, sink: Sink) -> None:
        """Queue the work; events arrive through `sink` (maybe from another thread)."""

    def abort(self, room: str, reason: str) -> None:
        """The client is gone or the router gave up: stop the request and release its pages (I7)."""

    def stats(self) -> BackendStats: ...

    def health(self) -> str | None:
        """None while the backend can serve requests; else why it cannot (for /health)."""
