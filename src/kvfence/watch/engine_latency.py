"""The engines' own TTFT / prefill histograms, read from /metrics each interval (signal 3).

Which histograms (names read in each engine's source):

- kvfence: `kvfence_prefill_seconds` and `kvfence_time_to_first_token_seconds`, labelled
  by prompt-length bucket (`prompt_tokens_le`, the next power of two), buckets from 0.25 ms;
- vLLM 0.32 (`v1/metrics/loggers.py`): `vllm:time_to_first_token_seconds` (from 1 ms) and
  `vllm:request_prefill_time_seconds` (from 0.3 s), per engine index, not by length;
- SGLang 0.5 (`srt/observability/metrics_collector.py`): `sglang:time_to_first_token_seconds`
  (from 0.1 s; labels model_name, is_streaming), not by length.

Each interval the guard keeps the cumulative snapshot and derives the interval's delta
(observations, and the p5 / p50 as bucket edges: "at most this"). A count that went down is
an engine restart: the new counts are the delta, as Prometheus's rate() treats a reset.

How they are used, exactly (`LongBucketEvidence`): where a histogram is labelled by prompt
length (kvfence's prefill), the guard counts this interval's engine-side prefills in the
bucket its long probes fall in that came in no slower than the p95 of the engine's shortest
length bucket, all in the engine's own clock (no network, no queueing in front of it). A
long prompt prefilled as fast as a short one is signal 3 as INCIDENT.md states it. The count
is exported, and printed beside a timing alarm as corroboration. It never raises an alarm and
never suppresses one: the histograms hold every tenant's traffic, where a tenant's legitimate
hit on its own cached prefix is a fast long prompt, and that traffic is not the interleaved
fresh-prompt design the exact test's H0 rests on (alarming on it would be a false alarm);
and an engine's own claim silencing the guard's external measurement would let a broken
engine vouch for itself. So the alarm's error rate stays the budget's (watch.budget).
Histograms not labelled by length (vLLM, SGLang) are exported only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfence.audit.targets.base import Sample

LENGTH_LABEL = "prompt_tokens_le"
# (metric, what it times). Only these names are read; any other label is summed over.
HISTOGRAMS: tuple[tuple[str, str], ...] = (
    ("kvfence_prefill_seconds", "prefill"),
    ("kvfence_time_to_first_token_seconds", "ttft"),
    ("vllm:time_to_first_token_seconds", "ttft"),
    ("vllm:request_prefill_time_seconds", "prefill"),
    ("sglang:time_to_first_token_seconds", "ttft"),
)
PREFILL = "kvfence_prefill_seconds"  # the one histogram labelled by length
ALL_LENGTHS = ""  # the length label of a histogram not labelled by length

Key = tuple[str, str]  # (metric, prompt-length bucket or ALL_LENGTHS)


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram's cumulative bucket counts (``le`` ascending, +Inf last) and total."""

    edges: tuple[float, ...]
    cumulative: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, old: Histogram | None) -> Histogram:
        """The observations since ``old`` (all of them after a reset or a bucket change)."""
        if old is None or old.edges != self.edges:
            return self
        diff = tuple(a - b for a, b in zip(self.cumulative, old.cumulative, strict=True))
        return self if any(d < 0 for d in diff) else Histogram(self.edges, diff)

    def quantile_edge(self, q: float) -> float | None:
        """The upper edge of the bucket holding the q-quantile (None: no observations)."""
        if self.count <= 0:
            return None
        need = q * self.count
        return next(e for e, c in zip(self.edges, self.cumulative, strict=True) if c >= need)

    def under(self, seconds: float) -> float:
        """Observations whose whole bucket lies under ``seconds`` (upper edge <= it)."""
        below = [c for e, c in zip(self.edges, self.cumulative, strict=True) if e <= seconds]
        return below[-1] if below else 0.0


def read_histograms(samples: list[Sample]) -> dict[Key, Histogram]:
    """Every known histogram in a /metrics page, summed over labels other than length."""
    wanted = {f"{name}_bucket": name for name, _ in HISTOGRAMS}
    acc: dict[Key, dict[float, float]] = {}
    for s in samples:
        name = wanted.get(s.name)
        if name is None or "le" not in s.labels:
            continue
        key = (name, s.labels.get(LENGTH_LABEL, ALL_LENGTHS))
        le = math.inf if s.labels["le"] in ("+Inf", "inf") else float(s.labels["le"])
        buckets = acc.setdefault(key, {})
        buckets[le] = buckets.get(le, 0.0) + s.value
    out = {}
    for key, buckets in acc.items():
        edges = tuple(sorted(buckets))
        out[key] = Histogram(edges, tuple(buckets[e] for e in edges))
    return out


@dataclass(frozen=True, slots=True)
class LongBucketEvidence:
    """The engine's own prefills this interval in the bucket of the guard's long probes, and
    how many came in no slower than the engine's shortest prompts (its own clock)."""

    bucket: str
    observations: float
    as_fast_as_short: float
    short_bucket: str
    short_p95_s: float

    def note(self) -> str:
        return (
            f"engine's own {PREFILL}{{{LENGTH_LABEL}={self.bucket}}} this interval: "
            f"{self.as_fast_as_short:g} of {self.observations:g} prefills no slower than the p95 "
            f"of its {self.short_bucket}-token bucket ({self.short_p95_s * 1000:.2f} ms; "
            "corroboration only, never an alarm by itself)"
        )


class EngineLatency:
    """The previous snapshot of one target's histograms, and the interval's deltas."""

    def __init__(self) -> None:
        self.last: dict[Key, Histogram] = {}
        self.delta: dict[Key, Histogram] = {}

    def update(self, samples: list[Sample] | None) -> dict[Key, Histogram]:
        """Read a /metrics page (None: unreadable, no delta) and return the interval's deltas."""
        now = read_histograms(samples) if samples is not None else {}
        self.delta = {k: h.minus(self.last.get(k)) for k, h in now.items()}
        self.last = now
        return self.delta

    def long_bucket(self, prompt_tokens: int) -> LongBucketEvidence | None:
        """Evidence from the length-labelled prefill histogram for ``prompt_tokens``-token
        prompts (None: no such histogram, or no observations to compare)."""
        by_length = sorted(
            (int(b), h) for (m, b), h in self.last.items() if m == PREFILL and b.isdigit()
        )
        long = next((b for b, _ in by_length if b >= prompt_tokens), None)
        short = next(((b, h) for b, h in by_length if h.count > 0 and b < prompt_tokens), None)
        delta = self.delta.get((PREFILL, str(long))) if long is not None else None
        if delta is None or short is None or delta.count <= 0:
            return None
        edge = short[1].quantile_edge(0.95)
        if edge is None or math.isinf(edge):
            return None
        return LongBucketEvidence(str(long), delta.count, delta.under(edge), str(short[0]), edge)
