"""Prometheus metrics, one registry per app (no module globals).

Request outcomes, HTTP statuses and rejection reasons are the router's own
counts (what clients saw); tokens, pool pages, prefix-cache and isolation
counters come from the backend's `BackendStats` at scrape time. Isolation
violations and transfer mismatches must stay 0 in production: the router adds
its own violations (an event for a room that is not the request's, I9).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.engine.backend import BackendStats
from kvfence.engine.counters import Counters

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
        c = self.counters
        outcomes = [(o, c.outcomes[o]) for o in OUTCOMES]
        yield _by("kvfence_requests", "Generation requests by final outcome", "outcome", outcomes)
        statuses = sorted(c.statuses.items())
        yield _by("kvfence_http_responses", "HTTP responses by status", "status", statuses)
        reasons = sorted(c.rejections.items())
        yield _by("kvfence_rejections", "Requests refused, by reason", "reason", reasons)
        for name, doc, value in _totals(c, stats.counters):
            yield CounterMetricFamily(name, doc, value=value)
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


def _by(name: str, doc: str, label: str, values: Sequence[tuple[str, int]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in values:
        family.add_metric([key], n)
    return family


def _totals(c: RouterCounters, s: Counters) -> list[tuple[str, str, float]]:
    """The single-value counters: (name, help, value)."""
    return [
        ("kvfence_prompt_tokens", "Prompt tokens processed", s.prompt_tokens),
        ("kvfence_generation_tokens", "Tokens generated", s.generation_tokens),
        (
            "kvfence_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_cache_queried_tokens,
        ),
        (
            "kvfence_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            s.prefix_cache_hit_tokens,
        ),
        (
            "kvfence_isolation_violations",
            "Reads the ledger refused or events for a foreign room (must stay 0)",
            s.isolation_violations + c.isolation_violations,
        ),
        (
            "kvfence_room_collisions",
            "Server-made room ids drawn twice and redrawn (I9)",
            c.room_collisions,
        ),
        (
            "kvfence_transfer_mismatches",
            "Transfers that did not match their reservation (must stay 0)",
            s.transfer_mismatches,
        ),
        ("kvfence_transfer_failures", "KV transfers that failed", s.transfer_failures),
    ]


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
