"""The audit's framework: verdicts, facts with sources, check results, the check contract.

Contract for every check (capacity, boundary, canary, counters, noninterference,
latency, prefix sharing):

- A check is a `Check` subclass with a unique `name` and a `run(ctx, target)`
  that returns one `CheckResult` for one target. It talks to the target only
  through `ctx.client(target, tenant)` (a `ProbeClient`, HTTP only, every
  request charged to `ctx.budget`) and reads capacity facts only through
  `target.facts(client)`.
- **Fail closed.** A fact that could not be read, a probe that got no HTTP
  answer, an exhausted budget or any exception is `INCONCLUSIVE`, never
  `PASS`. `run_check` enforces this for exceptions; a check must enforce it
  for facts (`Fact.known`).
- `evidence` is a JSON-serialisable dict a reviewer can act on: the numbers,
  where they came from (`Fact.to_json()`), and for a failure the exact
  request(s) that showed it.
- `plots` are data, not pictures: the HTML report draws them (`Plot`).

This module imports nothing from kvfence.engine / model / serve / lab: the
audit must not be able to tell a lab from production except by what the
server says over HTTP.
"""

from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from kvfence.audit.budget import Budget, BudgetExhausted

if TYPE_CHECKING:
    from kvfence.audit.client import ProbeClient
    from kvfence.audit.targets.base import Target

DEFAULT_HEADROOM = 1.25
DEFAULT_ALPHA = 1e-3  # family-wise false-alarm rate of one audit, per target
# The checks that decide by a p-value; `--alpha` is split over those a run includes.
STATISTICAL_CHECKS = ("noninterference", "latency", "prefix_sharing")
Tenant = Literal["a", "b"]
JSONValue = Any  # a value json.dumps accepts (dict/list/str/int/float/bool/None)


class Verdict(StrEnum):
    """A check's outcome. INCONCLUSIVE blocks a deploy by default.

    NOT_APPLICABLE: the engine itself states a fact under which the check's
    question cannot arise (no prefix cache, not disaggregated; see
    `audit.premises`) and nothing was left to measure. It is decisive — a
    deploy gate passes on it — but it is not PASS: a reader sees that a stated
    fact, not a measurement, decided. An unknown fact never gives it.
    """

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"
    NOT_APPLICABLE = "not_applicable"

    @property
    def severity(self) -> int:
        """Order for combining: fail > inconclusive > pass > not_applicable > skipped."""
        return {"skipped": 0, "not_applicable": 1, "pass": 2, "inconclusive": 3, "fail": 4}[
            self.value
        ]

    @property
    def decisive_ok(self) -> bool:
        """A verdict a deploy pipeline passes on (measured, or decided by a stated premise)."""
        return self in (Verdict.PASS, Verdict.NOT_APPLICABLE)


def worst(verdicts: list[Verdict]) -> Verdict:
    """The combined verdict of several (fail > inconclusive > pass > not_applicable); empty → SKIPPED."""
    return max(verdicts, key=lambda v: v.severity, default=Verdict.SKIPPED)


@dataclass(frozen=True, slots=True)
class Fact:
    """One value read from a live target, with where it came from.

    `value is None` means unknown: `source` then says what was tried and
    `note` why it failed. Checks must treat an unknown fact as inconclusive.
    Examples of sources: "GET /server_info max_total_num_tokens",
    "GET /metrics vllm:cache_config_info num_gpu_blocks×block_size".
    """

    value: int | float | bool | str | None
    source: str
    note: str = ""

    @property
    def known(self) -> bool:
        return self.value is not None

    @classmethod
    def unknown(cls, source: str, note: str = "") -> Fact:
        return cls(None, source, note)

    def as_int(self) -> int | None:
        """The value as an int when it is a number (bools are not numbers here)."""
        if isinstance(self.value, bool) or self.value is None:
            return None
        if isinstance(self.value, int):
            return self.value
        if isinstance(self.value, float) and self.value.is_integer():
            return int(self.value)
        return None

    def to_json(self) -> dict[str, JSONValue]:
        return {"value": self.value, "source": self.source, "note": self.note}


PlotKind = Literal["xy", "hist", "ladder"]
SeriesStyle = Literal["points", "line", "hist"]


@dataclass(slots=True)
class PlotSeries:
    """One series of a plot.

    - "points"/"line": paired `x`, `y`.
    - "hist": raw samples in `x` (the renderer bins them; `y` empty).
    `flags[i]` marks point i as flagged (drawn red: a TTFT that is too fast,
    a boundary rung that answered wrongly). `labels[i]` names point i.
    """

    name: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    style: SeriesStyle = "points"
    flags: list[bool] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "name": self.name,
            "x": list(self.x),
            "y": list(self.y),
            "style": self.style,
            "flags": list(self.flags),
            "labels": list(self.labels),
        }


@dataclass(slots=True)
class Plot:
    """Plot data attached to a result; report.py draws it as inline SVG.

    kinds: "xy" (e.g. TTFT vs prompt length: a "points" series, a "line" fit,
    flagged points), "hist" (e.g. hit vs miss timing: one "hist" series each),
    "ladder" (the boundary ladder: x = prompt tokens, y = HTTP status,
    labels = rung names, flags = rung answered wrongly).
    """

    kind: PlotKind
    title: str
    x_label: str = ""
    y_label: str = ""
    series: list[PlotSeries] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "kind": self.kind,
            "title": self.title,
            "x_label": self.x_label,
            "y_label": self.y_label,
            "series": [s.to_json() for s in self.series],
            "note": self.note,
        }


@dataclass(slots=True)
class CheckResult:
    """One check's verdict on one target, with the evidence behind it.

    `requests_sent` and `duration_s` are filled by `run_check` from the
    budget and the clock; a check may leave them at 0.
    """

    check: str
    target: str
    verdict: Verdict
    summary: str
    evidence: dict[str, JSONValue] = field(default_factory=dict)
    requests_sent: int = 0
    duration_s: float = 0.0
    plots: list[Plot] = field(default_factory=list)
    p_value: float | None = None  # statistical checks: the test's p-value ...
    alpha: float | None = None  # ... and the level it was judged at (the check's share)
    target_name: str = ""  # the target's name in the reports (set by the runbook)

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "check": self.check,
            "target": self.target,
            "target_name": self.target_name or self.target,
            "verdict": self.verdict.value,
            "summary": self.summary,
            "evidence": self.evidence,
            "requests_sent": self.requests_sent,
            "duration_s": round(self.duration_s, 4),
            "p_value": self.p_value,
            "alpha": self.alpha,
            "plots": [p.to_json() for p in self.plots],
        }


ProgressFn = Callable[[str, float | None], None]


def _no_progress(message: str, fraction: float | None) -> None:
    """Default progress sink: discard (quiet mode, tests)."""


@dataclass
class AuditContext:
    """What every check gets: tenant keys, limits, randomness, progress, HTTP clients.

    - `key_a` / `key_b`: API keys of two tenants (None = no auth header).
      Tenant A is the victim whose data must not leak; tenant B the observer.
    - `operator_key`: read /metrics and /server_info with it (operator data on
      kvfence; without it those facts may be unreadable, never a pass).
    - `context_override`: use this context length instead of the target's.
    - `seed` seeds `rng`; checks draw all randomness (sentinels, prefixes)
      from `rng` so a run is reproducible.
    - `progress(message, fraction_or_None)`: report long work; cheap to call.
    - `request_timeout_s`: per request, further capped by the budget's time.
    - `alpha`: the family-wise false-alarm rate per target; `statistical` the
      statistical checks this run includes. `alpha_for(check)` is one check's
      Bonferroni share, so the chance that any of them fails an honest target
      is at most `alpha` whatever the dependence between them.
    """

    key_a: str | None = None
    key_b: str | None = None
    operator_key: str | None = None
    headroom: float = DEFAULT_HEADROOM
    context_override: int | None = None
    budget: Budget = field(default_factory=Budget)
    seed: int = 0
    progress: ProgressFn = _no_progress
    quiet: bool = False
    request_timeout_s: float = 120.0
    alpha: float = DEFAULT_ALPHA
    statistical: tuple[str, ...] = STATISTICAL_CHECKS
    # Worker URLs to probe beside the target's own (`--worker`): a fleet's nodes that a
    # router does not list, or lists only to its operator.
    workers: tuple[str, ...] = ()
    rng: random.Random = field(init=False)
    _clients: dict[tuple[str, str], ProbeClient] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.headroom < 1.0:
            raise ValueError(f"headroom must be >= 1, got {self.headroom}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        self.rng = random.Random(self.seed)

    def alpha_for(self, check: str) -> float:
        """`check`'s share of the family-wise alpha (Bonferroni over the run's statistical checks)."""
        return self.alpha / max(1, len(set(self.statistical) & set(STATISTICAL_CHECKS)))

    def key(self, tenant: Tenant) -> str | None:
        return self.key_a if tenant == "a" else self.key_b

    def client(self, target: Target, tenant: Tenant = "a") -> ProbeClient:
        """The (cached, thread-safe) HTTP client for `tenant` on `target`."""
        return self.client_for_url(target.url, tenant)

    def client_for_url(self, url: str, tenant: Tenant = "a") -> ProbeClient:
        """The same client by URL (engine detection runs before a `Target` exists)."""
        from kvfence.audit.client import ProbeClient

        url = url.rstrip("/")
        with self._lock:
            cached = self._clients.get((url, tenant))
            if cached is None:
                cached = ProbeClient(
                    url,
                    api_key=self.key(tenant),
                    budget=self.budget,
                    timeout_s=self.request_timeout_s,
                    operator_key=self.operator_key,
                )
                self._clients[(url, tenant)] = cached
            return cached

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    @contextmanager
    def open(self) -> Iterator[AuditContext]:
        try:
            yield self
        finally:
            self.close()


class Check(ABC):
    """One check of the runbook. Subclasses set `name` and implement `run`.

    `run` must not raise for expected trouble (a 5xx, a timeout): it returns
    INCONCLUSIVE with what went wrong. Unexpected exceptions are turned into
    INCONCLUSIVE by `run_check` (fail closed).
    """

    name: str = ""
    description: str = ""

    @abstractmethod
    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        """Run against one target; return exactly one result for it."""

    def result(
        self,
        target: Target,
        verdict: Verdict,
        summary: str,
        evidence: dict[str, JSONValue] | None = None,
        plots: list[Plot] | None = None,
    ) -> CheckResult:
        """Shorthand to build this check's result for `target`."""
        return CheckResult(
            check=self.name,
            target=target.url,
            verdict=verdict,
            summary=summary,
            evidence=evidence or {},
            plots=plots or [],
        )


def run_check(check: Check, ctx: AuditContext, target: Target) -> CheckResult:
    """Run one check, fail closed: any exception → INCONCLUSIVE, never PASS.

    Fills `requests_sent` (budget delta) and `duration_s`.
    """
    sent0 = ctx.budget.sent
    t0 = time.monotonic()
    try:
        res = check.run(ctx, target)
    except BudgetExhausted as e:
        res = check.result(target, Verdict.INCONCLUSIVE, f"budget exhausted: {e}")
    except Exception as e:  # fail closed: a crashed check cannot vouch for anything
        res = check.result(
            target,
            Verdict.INCONCLUSIVE,
            f"check raised {type(e).__name__}: {e}",
            {"exception": f"{type(e).__name__}: {e}"},
        )
    res.requests_sent = ctx.budget.sent - sent0
    res.duration_s = time.monotonic() - t0
    return res
