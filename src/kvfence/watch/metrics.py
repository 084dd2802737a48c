"""What the guard exports (prometheus-client, one registry per watcher, no module globals).

Every gauge is labelled by `target`. `kvfence_guard_facts_known` is 0 whenever a
target's capacity facts could not be read this interval (target down, facts
absent, credential refused): the shipped rule GuardFactsUnknown alerts on it,
so an unreadable target is never silence (fail closed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

TARGET = ("target",)
# (attribute, type, metric name, help, labels): every series the guard exports.
SERIES: tuple[tuple[str, type[Gauge] | type[Counter], str, str, tuple[str, ...]], ...] = (
    (
        "facts_known",
        Gauge,
        "kvfence_guard_facts_known",
        "1 when this interval read the target's pool and context, else 0 (never healthy)",
        TARGET,
    ),
    (
        "gate_ok",
        Gauge,
        "kvfence_guard_gate_ok",
        "1 when the last capacity gate passed (pool >= context x headroom), else 0",
        TARGET,
    ),
    (
        "boundary_ok",
        Gauge,
        "kvfence_guard_boundary_ok",
        "1 when the last boundary probe passed (limit and limit + 1), else 0",
        TARGET,
    ),
    ("pool", Gauge, "kvfence_guard_pool_tokens", "Live KV pool, in tokens", TARGET),
    ("context", Gauge, "kvfence_guard_context_tokens", "Advertised context length", TARGET),
    (
        "margin",
        Gauge,
        "kvfence_guard_margin_tokens",
        "pool - context x headroom (negative: the pool cannot hold one full context)",
        TARGET,
    ),
    (
        "changes",
        Counter,
        "kvfence_guard_fingerprint_changes",
        "Times the capacity facts changed (each re-ran the gate and the boundary probe)",
        TARGET,
    ),
    (
        "crossings",
        Counter,
        "kvfence_guard_canary_crossings",
        "Canary pairs where tenant A's sentinel reached tenant B",
        TARGET,
    ),
    (
        "too_fast",
        Counter,
        "kvfence_guard_prefill_floor_violations",
        "Intervals whose timing window failed the prefill-latency test (p < alpha; signal 3)",
        TARGET,
    ),
    (
        "prefill_floor",
        Gauge,
        "kvfence_guard_prefill_floor_seconds",
        "The fitted prefill time below which a long prompt is flagged",
        TARGET,
    ),
    (
        "timing_p",
        Gauge,
        "kvfence_guard_prefill_p_value",
        "p-value of the last timing window's test (H0: the long prompts were prefilled)",
        TARGET,
    ),
    (
        "timing_alpha",
        Gauge,
        "kvfence_guard_prefill_alpha",
        "Per-test alpha of the timing test, derived from the false-alarm budget",
        TARGET,
    ),
    (
        "budget",
        Gauge,
        "kvfence_guard_false_alarm_budget_per_30d",
        "False alarms per target per 30 days the operator allows (--false-alarms-per-30d)",
        TARGET,
    ),
    (
        "probes",
        Counter,
        "kvfence_guard_probes",
        "Requests the guard sent, by purpose",
        ("target", "kind"),
    ),
    (
        "requests",
        Counter,
        "kvfence_guard_requests",
        "Every request the guard sent to the target (fact reads, gate, boundary, probes)",
        TARGET,
    ),
    (
        "probe_errors",
        Counter,
        "kvfence_guard_probe_errors",
        "Intervals whose gate re-run or probes failed after the facts were read (an error, "
        "not unknown facts: the gate's state stands; the failed signal is unknown)",
        TARGET,
    ),
    (
        "skipped",
        Counter,
        "kvfence_guard_probes_skipped",
        "Probe rounds skipped to stay within the request budget per minute or the target-time share",
        TARGET,
    ),
    (
        "engine_histograms",
        Gauge,
        "kvfence_guard_engine_histograms",
        "TTFT / prefill histograms read from the target's /metrics this interval (0: none)",
        TARGET,
    ),
    (
        "engine_observations",
        Gauge,
        "kvfence_guard_engine_latency_observations",
        "Observations in the engine's own TTFT / prefill histogram over the last interval",
        ("target", "metric", "prompt_tokens_le"),
    ),
    (
        "engine_p5",
        Gauge,
        "kvfence_guard_engine_latency_p5_seconds",
        "Upper edge of the bucket holding the last interval's p5 of the engine's own histogram",
        ("target", "metric", "prompt_tokens_le"),
    ),
    (
        "engine_fast_long",
        Counter,
        "kvfence_guard_engine_fast_long_prefills",
        "Engine-side prefills in the long probes' length bucket no slower than the p95 of the "
        "shortest bucket (corroboration of signal 3; never an alarm by itself)",
        TARGET,
    ),
    (
        "last_success",
        Gauge,
        "kvfence_guard_last_success_timestamp_seconds",
        "Unix time of the last interval that read the target's facts",
        TARGET,
    ),
)


class WatchMetrics:
    facts_known: Gauge
    gate_ok: Gauge
    boundary_ok: Gauge
    pool: Gauge
    context: Gauge
    margin: Gauge
    changes: Counter
    crossings: Counter
    too_fast: Counter
    prefill_floor: Gauge
    timing_p: Gauge
    timing_alpha: Gauge
    budget: Gauge
    probes: Counter
    requests: Counter
    skipped: Counter
    probe_errors: Counter
    last_success: Gauge
    engine_histograms: Gauge
    engine_observations: Gauge
    engine_p5: Gauge
    engine_fast_long: Counter

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=False)
        for attr, kind, name, help_text, labels in SERIES:
            setattr(self, attr, kind(name, help_text, labels, registry=self.registry))

    def start(self, target: str) -> None:
        """Create every series at its resting value, so rate()/increase() see the first event."""
        for c in (
            self.changes,
            self.crossings,
            self.too_fast,
            self.skipped,
            self.probe_errors,
            self.requests,
            self.engine_fast_long,
        ):
            c.labels(target).inc(0)
