"""Prometheus metrics, one registry per app (no module globals).

Request outcomes, HTTP statuses and rejection reasons are the router's own
counts (what clients saw); tokens, pool pages, prefix-cache and isolation
counters come from the backend's `BackendStats` at scrape time. Isolation
violations and transfer mismatches must stay 0 in production: the router adds
its own violations (an event for a room that is not the request's, I9).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.engine.backend import BackendStats

Outcome = Literal["finished", "rejected", "aborted", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("finished", "rejected", "aborted", "failed")


@dataclass(slots=True)
class RouterCounters:
    """Counts kept by the router; only touched from the event loop."""

    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    isolation_violations: int = 0
    room_collisions: int = 0

    def outcome(self, outcome: Outcome) -> None:
        self.outcomes[outcome] += 1

    def rejected(self, reason: str) -> None:
        self.outcomes["rejected"] += 1
        self.rejections[reason] += 1


class _Collector(Collector):
    def __init__(
        self,
        counters: RouterCounters,
        stats: Callable[[], BackendStats],
        max_total_num_tokens: int,
        context_length: int,
    ) -> None:
        self.counters = counters
        self.stats = stats
        self.max_total_num_tokens = max_total_num_tokens
        self.context_length = context_length

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        c, s = self.counters, stats.counters

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        requests = CounterMetricFamily(
            "kvfence_requests", "Generation requests by final outcome", labels=["outcome"]
        )
        for outcome in OUTCOMES:
            requests.add_metric([outcome], c.outcomes[outcome])
        yield requests
        http = CounterMetricFamily(
            "kvfence_http_responses", "HTTP responses by status", labels=["status"]
        )
        for status, n in sorted(c.statuses.items()):
            http.add_metric([status], n)
        yield http
        rejections = CounterMetricFamily(
            "kvfence_rejections", "Requests refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(c.rejections.items()):
            rejections.add_metric([reason], n)
        yield rejections
        yield counter("kvfence_prompt_tokens", "Prompt tokens processed", s.prompt_tokens)
        yield counter("kvfence_generation_tokens", "Tokens generated", s.generation_tokens)
        yield counter(
            "kvfence_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_cache_queried_tokens,
        )
        yield counter(
            "kvfence_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            s.prefix_cache_hit_tokens,
        )
        yield counter(
            "kvfence_isolation_violations",
            "Reads the ledger refused or events for a foreign room (must stay 0)",
            s.isolation_violations + c.isolation_violations,
        )
        yield counter(
            "kvfence_room_collisions",
            "Server-made room ids drawn twice and redrawn (I9)",
            c.room_collisions,
        )
        yield counter(
            "kvfence_transfer_mismatches",
            "Transfers that did not match their reservation (must stay 0)",
            s.transfer_mismatches,
        )
        yield counter("kvfence_transfer_failures", "KV transfers that failed", s.transfer_failures)
        pages = GaugeMetricFamily(
            "kvfence_pool_pages", "KV pool pages by role and state", labels=["role", "state"]
        )
        for p in stats.pools:
            pages.add_metric([p.role, "used"], p.pages_used)
            pages.add_metric([p.role, "free"], p.pages_free)
            pages.add_metric([p.role, "pending"], p.pages_pending)
        yield pages
        yield GaugeMetricFamily(
            "kvfence_max_total_num_tokens",
            "Smallest prefill KV pool, in tokens",
            value=self.max_total_num_tokens,
        )
        yield GaugeMetricFamily(
            "kvfence_context_length", "Advertised context window", value=self.context_length
        )


def make_registry(
    counters: RouterCounters,
    stats: Callable[[], BackendStats],
    *,
    max_total_num_tokens: int,
    context_length: int,
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(counters, stats, max_total_num_tokens, context_length))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
