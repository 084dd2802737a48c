"""The engine metrics vLLM's and SGLang's operators look for, under kvfence's own names.

Each has a `model_name` label (the served model id, as in vLLM and SGLang) so a
dashboard built for those engines needs only the name changed:

- requests running and waiting, counted by the HTTP router that serves them: a
  request is waiting from submission until its first token (queued for pages,
  for prefill, or in prefill) and running from then until it ends;
- the KV cache usage per pool role, a fraction in [0, 1]: pages a request holds
  or a transfer may still write (I7), over the pool; pages only the prefix cache
  keeps are free here, since the next allocation takes them back;
- end-to-end latency of finished requests (submission to the last token) and
  the inter-token latency (the gap between successive token events of one
  request), as histograms. Time to first token is `request_log.py`'s.

The gauges are read from the router and the backend at scrape time, so a value
is never older than the scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.engine.backend import BackendStats, PoolInfo
from kvfence.engine.messages import TokenChunk


class Run(Protocol):
    """What the timings read and write of one of the router's requests (`router.Run`): a
    protocol, so this module needs nothing from the router that imports it."""

    room: str
    submitted_s: float
    ttft_s: float | None
    last_token_s: float | None
    prefill_s: float | None
    cached_tokens: int
    generated: int


MODEL_LABEL = "model_name"

# Seconds: 0.25 ms .. 60 s roughly x2 (a decode step of a small model on a CPU is a few ms).
TOKEN_GAP_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.125,
    0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0,
)  # fmt: skip
# Whole requests run far longer than one token: up to 40 minutes (vLLM's reach is longer still).
REQUEST_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
    320.0, 640.0, 1280.0, 2400.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Load:
    """Requests the router holds now: `running` have had their first token, `waiting` not."""

    running: int
    waiting: int


def usage_by_role(pools: Iterable[PoolInfo]) -> dict[str, float]:
    """The KV usage fraction of each role, its workers' pools taken together."""
    by_role: dict[str, list[PoolInfo]] = {}
    for p in pools:
        by_role.setdefault(p.role, []).append(p)
    return {role: _combined(role, ps).usage for role, ps in sorted(by_role.items())}


def _combined(role: str, pools: list[PoolInfo]) -> PoolInfo:
    return PoolInfo(
        role,
        sum(p.pool_tokens for p in pools),
        pools[0].page_size,
        sum(p.pages_used for p in pools),
        sum(p.pages_free for p in pools),
        sum(p.pages_pending for p in pools),
        sum(p.pages_cached for p in pools),
    )


class LoadCollector(Collector):
    """Requests running and waiting, and KV usage by role, read at scrape time."""

    def __init__(
        self, model_name: str, load: Callable[[], Load], stats: Callable[[], BackendStats]
    ) -> None:
        self.model_name = model_name
        self.load = load
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        load = self.load()
        model = [self.model_name]
        for name, doc, value in (
            (
                "kvfence_num_requests_running",
                "Requests that have had their first token and have not ended",
                load.running,
            ),
            (
                "kvfence_num_requests_waiting",
                "Requests submitted that have no token yet (queued for pages or prefill, or in it)",
                load.waiting,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
            gauge.add_metric(model, value)
            yield gauge
        usage = GaugeMetricFamily(
            "kvfence_kv_cache_usage_perc",
            "KV pool in use by role, 0..1 (evictable prefix-cache pages count as free)",
            labels=[MODEL_LABEL, "role"],
        )
        for role, fraction in usage_by_role(self.stats().pools).items():
            usage.add_metric([self.model_name, role], fraction)
        yield usage


class RequestTimes:
    """Per-request timings as the router sees its events, and which live requests are running.

    Called on the server's event loop only (the router's), so the set needs no lock. A room
    enters `started` with its first token event while it is live, and leaves when the router
    ends it: `started` stays a subset of the router's live rooms.
    """

    def __init__(self, registry: CollectorRegistry | None, model_name: str) -> None:
        self.started: set[str] = set()
        self.e2e = Histogram(
            "kvfence_e2e_request_latency_seconds",
            "Finished requests: submission to the last token",
            [MODEL_LABEL],
            buckets=REQUEST_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.inter_token = Histogram(
            "kvfence_inter_token_latency_seconds",
            "Gap between successive token events of one request",
            [MODEL_LABEL],
            buckets=TOKEN_GAP_BUCKETS,
            registry=registry,
        ).labels(model_name)

    def chunk(self, run: Run, chunk: TokenChunk, live: Container[str]) -> None:
        """A token event for `run`: its first-token facts, counts and the gap since the last."""
        now = time.perf_counter()
        if run.ttft_s is None:
            run.ttft_s = now - run.submitted_s
            run.prefill_s = chunk.prefill_s if chunk.prefill_s > 0 else None
            if run.room in live:  # never re-add a room the router has already ended
                self.started.add(run.room)
        run.cached_tokens = max(run.cached_tokens, chunk.cached_tokens)
        run.generated += len(chunk.token_ids)
        if chunk.token_ids:
            if run.last_token_s is not None:
                self.inter_token.observe(now - run.last_token_s)
            run.last_token_s = now

    def ended(self, run: Run, outcome: str | None) -> None:
        """The router ended `run` (outcome None: its side closed, the outcome not yet known)."""
        self.started.discard(run.room)
        if outcome == "finished":
            self.e2e.observe(time.perf_counter() - run.submitted_s)

    def load(self, live: Sized) -> Load:
        running = len(self.started)
        return Load(running=running, waiting=len(live) - running)
