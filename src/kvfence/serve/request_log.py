"""Per-request latency: Prometheus histograms by prompt length and one JSON log line per request.

Runbook signal 3 ("log prefill duration per prompt length and alert on the p5
of the long-context bucket", INCIDENT.md) needs the engine's own timings at a
resolution that shows a millisecond prefill: the histograms' buckets start at
0.25 ms (vLLM's `request_prefill_time_seconds` starts at 0.3 s, too coarse to
see a skipped prefill on a small model). Prompt lengths are bucketed by the
next power of two so the long-context bucket is one label value.

`prefill_s` is measured by the prefill engine (first forward step to first
token) and travels with the transfer manifest; `ttft_s` is measured here,
from submission to the first event. The log line names the tenant only by a
hash (the names are operator data, I10), and its field names are the ones
`kvfence audit latency --from-log` reads (`prompt_tokens`, `prefill_s`,
`ttft_s`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram

# Seconds: 0.25 ms .. 60 s, roughly x2 per bucket (a skipped prefill on a small model is ~1 ms).
LATENCY_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.125,
    0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0,
)  # fmt: skip
MIN_PROMPT_BUCKET = 16
BUCKET_LABEL = "prompt_tokens_le"


def prompt_bucket(tokens: int, context_length: int) -> str:
    """The bucket label: the next power of two >= tokens (>= 16), capped at the context."""
    edge = MIN_PROMPT_BUCKET
    while edge < tokens:
        edge *= 2
    return str(min(edge, max(context_length, tokens)))


def tenant_hash(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the log line states it (timings are None where it never got that far)."""

    tenant_hash: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_s: float | None
    ttft_s: float | None
    outcome: str
    ts: float

    def to_json(self) -> str:
        return json.dumps({"event": "request", **asdict(self)}, separators=(",", ":"))


class RequestLatency:
    """Histograms and counters in the app's registry, and the optional JSON-lines request log."""

    def __init__(
        self, registry: CollectorRegistry, context_length: int, log_path: Path | None = None
    ) -> None:
        self.context_length = context_length
        self.ttft = Histogram(
            "kvfence_time_to_first_token_seconds",
            "Submission to first token, by prompt-length bucket (engine side, no network)",
            [BUCKET_LABEL],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill = Histogram(
            "kvfence_prefill_seconds",
            "Prefill engine time per request (first forward step to first token), by prompt length",
            [BUCKET_LABEL],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvfence_request_prompt_tokens",
            "Prompt tokens of finished requests, by prompt-length bucket",
            [BUCKET_LABEL],
            registry=registry,
        )
        self.cached_tokens = Counter(
            "kvfence_request_cached_tokens",
            "Prompt tokens of finished requests served from the prefix cache, by bucket",
            [BUCKET_LABEL],
            registry=registry,
        )
        self.log_path = log_path

    def record(
        self,
        tenant: str,
        prompt_tokens: int,
        *,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        prefill_s: float | None = None,
        ttft_s: float | None = None,
        outcome: str,
    ) -> RequestRecord:
        rec = RequestRecord(
            tenant_hash(tenant),
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            prefill_s,
            ttft_s,
            outcome,
            time.time(),
        )
        if outcome == "finished" and prompt_tokens > 0:
            bucket = prompt_bucket(prompt_tokens, self.context_length)
            self.prompt_tokens.labels(bucket).inc(prompt_tokens)
            self.cached_tokens.labels(bucket).inc(cached_tokens)
            if ttft_s is not None:
                self.ttft.labels(bucket).observe(ttft_s)
            if prefill_s is not None:
                self.prefill.labels(bucket).observe(prefill_s)
        if self.log_path is not None:
            # One short append per request: nothing held open, each line whole (O_APPEND).
            with open(self.log_path, "a", encoding="utf-8") as fh:
                fh.write(rec.to_json() + "\n")
        return rec
