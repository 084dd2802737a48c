"""One guard per target, and the watcher's loop over them.

A target's interval: read its live facts (fresh adapter, fresh reads) ->
fingerprint -> on a change (or the first read) re-run the capacity gate and
the boundary probe -> within the request budget, one canary pair and one
timing round -> the engine's own TTFT / prefill histograms over the interval
(watch.engine_latency: exported, and corroboration beside a timing alarm, never
an alarm by themselves) -> export. Anything that fails to read leaves the facts
unknown for this interval, which is exported, never skipped (fail closed).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.check_table import load_check
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.base import Target, TargetFacts, parse_prometheus
from kvfence.audit.targets.registry import make_target
from kvfence.watch.budget import AlarmBudget
from kvfence.watch.engine_latency import EngineLatency
from kvfence.watch.fingerprint import Fingerprint
from kvfence.watch.metrics import WatchMetrics
from kvfence.watch.probes import ROUND, Makers, TimingWindow, canary_pair

log = logging.getLogger(__name__)
FOREVER_S = 10 * 365 * 86400.0  # the watcher's budget is per minute, not per run
PROBE_ROUND = ROUND + 2 + 6  # timing probes + canary pair + the pair's tokenize/detokenize calls


@dataclass(frozen=True, slots=True)
class Keys:
    a: str | None
    b: str | None
    operator: str | None


@dataclass(frozen=True, slots=True)
class GuardConfig:
    interval_s: float = 60.0
    requests_per_minute: int = 60
    headroom: float = 1.25
    canary: bool = True
    timing: bool = True
    false_alarms_per_30d: float = 1.0
    max_target_share: float = 0.02  # of the target's time, for canary + timing rounds

    @property
    def budget(self) -> AlarmBudget:
        return AlarmBudget(self.false_alarms_per_30d, self.interval_s)


@dataclass(slots=True)
class Interval:
    """What one interval saw on one target (printed by --once, kept for tests)."""

    facts_known: bool
    changed: list[str] = field(default_factory=list)
    gate: CheckResult | None = None
    boundary: CheckResult | None = None
    crossed: bool = False
    too_fast: bool = False
    error: str = ""
    notes: list[str] = field(default_factory=list)
    facts: TargetFacts | None = None  # as read this interval (the gate's inputs, with sources)


class TargetGuard:
    def __init__(
        self, url: str, engine: str, keys: Keys, config: GuardConfig, metrics: WatchMetrics
    ) -> None:
        self.url, self.engine, self.config, self.metrics = url, engine, config, metrics
        self.ctx = AuditContext(
            key_a=keys.a,
            key_b=keys.b,
            operator_key=keys.operator,
            headroom=config.headroom,
            budget=Budget(max_requests=2**62, max_seconds=FOREVER_S),
        )
        self.rng = random.Random()
        self.fingerprint: Fingerprint | None = None
        self.gated = False  # the gate ran on `fingerprint`'s facts
        self.timing = TimingWindow(config.budget.alpha)
        self.makers: Makers | None = None
        self.engine_latency = EngineLatency()
        self.long_tokens: int | None = None  # the timing window's longest probe
        self.sent_at: deque[float] = deque()
        # Probe rounds are spaced so they take at most max_target_share of the time: a round
        # that took d seconds is followed by the next no sooner than d / share after it began.
        # A round's wall time is a sum of sequential request latencies, an upper bound on the
        # engine time it used (a batching engine serves it beside its traffic for less).
        self.next_round_at = 0.0
        self.turn = 0
        self.last: Interval | None = None
        metrics.start(url)
        metrics.budget.labels(url).set(config.false_alarms_per_30d)
        metrics.timing_alpha.labels(url).set(self.timing.alpha)

    def cycle(self) -> Interval:
        sent0 = self.ctx.budget.sent
        try:
            out = self._cycle()
        except Exception as e:  # the target is down or unreadable: unknown, never healthy
            log.warning("guard %s: %s: %s", self.url, type(e).__name__, e)
            out = Interval(facts_known=False, error=f"{type(e).__name__}: {e}")
        self._charge(self.ctx.budget.sent - sent0)
        self.metrics.requests.labels(self.url).inc(self.ctx.budget.sent - sent0)
        if not out.facts_known:
            self.metrics.facts_known.labels(self.url).set(0)
        self.last = out
        return out

    def _cycle(self) -> Interval:
        client = self.ctx.client_for_url(self.url, "a")
        target = make_target(self.url, self.engine, client)
        self.engine = target.engine  # detected once; later intervals skip detection
        facts = target.facts(client)
        target.configure_client(self.ctx.client(target, "b"))
        fp = Fingerprint.of(facts)
        self._export_facts(facts)
        if not fp.gateable:
            note = facts.pool_tokens.note
            return Interval(False, error="pool or context unknown: " + note, facts=facts)
        # Known as soon as read: the gate re-run and the probes below can take minutes on a
        # loaded machine, and the facts' state must not wait for them.
        self.metrics.facts_known.labels(self.url).set(1)
        self.metrics.last_success.labels(self.url).set(time.time())
        out = Interval(True, facts=facts)
        try:
            self._after_facts(target, facts, fp, out)
        except Exception as e:
            # The facts were read (and exported: the gate's alarm stands); what failed is a
            # probe. Counted and alerted on (GuardProbesFailing), never mistaken for unknown
            # facts, which would hide KVPoolBelowContext behind a probe's error.
            log.warning("guard %s: probe failed: %s: %s", self.url, type(e).__name__, e)
            out.error = f"probe failed: {type(e).__name__}: {e}"
            self.metrics.probe_errors.labels(self.url).inc()
        return out

    def _after_facts(
        self, target: Target, facts: TargetFacts, fp: Fingerprint, out: Interval
    ) -> None:
        """A change re-gates (and resets the timing window); then this interval's probes."""
        if fp != self.fingerprint:
            if self.fingerprint is not None:
                out.changed = fp.diff(self.fingerprint)
                self.metrics.changes.labels(self.url).inc()
                log.warning("guard %s: capacity facts changed: %s", self.url, out.changed)
            self.fingerprint, self.gated = fp, False
            self.timing.clear()  # the physics changed with the facts
            self.makers = None  # and maybe the tokenizer
        if not self.gated:  # a change, or a gate re-run that failed: (again) now
            out.gate, out.boundary = self._gate(target)
            self.gated = True
        self._probe(target, facts, out)
        self._read_engine_latency(target, out)

    def _gate(self, target: Target) -> tuple[CheckResult, CheckResult]:
        """The capacity gate and the boundary probe, exactly as `kvfence audit` runs them."""
        results = []
        for name in ("capacity", "boundary"):
            check = load_check(name)
            assert check is not None
            results.append(run_check(check, self.ctx, target))
            self.metrics.probes.labels(self.url, name).inc(results[-1].requests_sent)
        gate, boundary = results
        self.metrics.gate_ok.labels(self.url).set(1 if gate.verdict is Verdict.PASS else 0)
        self.metrics.boundary_ok.labels(self.url).set(1 if boundary.verdict is Verdict.PASS else 0)
        return gate, boundary

    def _probe(self, target: Target, facts: TargetFacts, out: Interval) -> None:
        limit = facts.input_limit(self.ctx.context_override).as_int()
        if limit is None:
            out.notes.append("input limit unknown: no probes")
            return
        if not self._within_budget(PROBE_ROUND):
            self.metrics.skipped.labels(self.url).inc()
            out.notes.append("probe round skipped: request budget per minute reached")
            return
        t0 = time.monotonic()
        if t0 < self.next_round_at:
            self.metrics.skipped.labels(self.url).inc()
            out.notes.append(
                f"probe round skipped: next in {self.next_round_at - t0:.0f} s, so the guard's "
                f"rounds take at most {self.config.max_target_share:.1%} of the target's time"
            )
            return
        try:
            self._round(target, facts, limit, out)
        finally:
            self.next_round_at = self.spaced(t0, time.monotonic() - t0)

    def _round(self, target: Target, facts: TargetFacts, limit: int, out: Interval) -> None:
        """One canary pair and one timing round (the probes the share limit meters)."""
        a, b = self.ctx.client(target, "a"), self.ctx.client(target, "b")
        if self.makers is None:
            self.makers = Makers.of(a, b, facts, self.rng)
        if self.config.canary:
            pair = canary_pair(self.makers, facts, limit, self.rng, self.turn)
            self.metrics.probes.labels(self.url, "canary").inc(pair.sent)
            out.notes.append(pair.detail)
            if pair.crossed:
                out.crossed = True
                self.metrics.crossings.labels(self.url).inc()
        if self.config.timing:
            self.long_tokens = self.timing.config.sweep(limit)[-1]
            self.metrics.probes.labels(self.url, "timing").inc(
                self.timing.probe(b, limit, self.rng)
            )
            result, alarm = self.timing.judge()
            floor = result.evidence.get("alarm_threshold_s")
            if isinstance(floor, float):
                self.metrics.prefill_floor.labels(self.url).set(floor)
            if result.p_value is not None:
                self.metrics.timing_p.labels(self.url).set(result.p_value)
            out.notes.append(f"timing window: {result.verdict.value}: {result.summary}")
            if alarm:
                out.too_fast = True
                self.metrics.too_fast.labels(self.url).inc()
        self.turn += 1

    def _read_engine_latency(self, target: Target, out: Interval) -> None:
        """The engine's own TTFT / prefill histograms over this interval (watch.engine_latency:
        exported and shown beside an alarm; they never raise or silence one)."""
        r = self.ctx.client(target, "a").get("/metrics", timeout_s=30.0)
        delta = self.engine_latency.update(parse_prometheus(r.body) if r.ok else None)
        self.metrics.engine_histograms.labels(self.url).set(len(delta))
        for (metric, bucket), h in delta.items():
            self.metrics.engine_observations.labels(self.url, metric, bucket).set(h.count)
            p5 = h.quantile_edge(0.05)
            if p5 is not None and p5 != float("inf"):
                self.metrics.engine_p5.labels(self.url, metric, bucket).set(p5)
        if self.long_tokens is None:
            return
        evidence = self.engine_latency.long_bucket(self.long_tokens)
        if evidence is not None:
            self.metrics.engine_fast_long.labels(self.url).inc(evidence.as_fast_as_short)
            out.notes.append(evidence.note())

    def _export_facts(self, facts: TargetFacts) -> None:
        pool, ctx = facts.pool_tokens.as_int(), facts.context_length.as_int()
        if pool is not None:
            self.metrics.pool.labels(self.url).set(pool)
        if ctx is not None:
            self.metrics.context.labels(self.url).set(ctx)
        if pool is not None and ctx is not None:
            self.metrics.margin.labels(self.url).set(pool - ctx * self.config.headroom)

    def spaced(self, started: float, took_s: float) -> float:
        """When the next round may start after one that began at `started` and took `took_s`."""
        return started + took_s / self.config.max_target_share

    def _within_budget(self, n: int) -> bool:
        now = time.monotonic()
        while self.sent_at and now - self.sent_at[0] > 60.0:
            self.sent_at.popleft()
        return len(self.sent_at) + n <= self.config.requests_per_minute

    def _charge(self, n: int) -> None:
        now = time.monotonic()
        self.sent_at.extend([now] * n)

    def close(self) -> None:
        self.ctx.close()
