"""The check contract: what every check gets (`AuditContext`) and how it runs (`run_check`).

The values a check returns (verdicts, facts, results) are in `audit.base`.

Contract for every check (each in its package under `audit.checks`, named in
`audit.check_table`):

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

from kvfence.audit.base import (
    DEFAULT_ALPHA,
    DEFAULT_HEADROOM,
    STATISTICAL_CHECKS,
    Budget,
    BudgetExhausted,
    CheckResult,
    JSONValue,
    Plot,
    Tenant,
    Verdict,
)
from kvfence.audit.client import ProbeClient
from kvfence.audit.pacing import Pacing
from kvfence.audit.targets.base import Target

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
    - `pacing`: how a paced client (`client(..., paced=True)`, the statistical checks')
      retries a 503 or a request that got no answer; the other checks read those as
      answers (a pool that ran out, a refusal), so theirs never retry.
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
    pacing: Pacing = field(default_factory=Pacing)
    alpha: float = DEFAULT_ALPHA
    statistical: tuple[str, ...] = STATISTICAL_CHECKS
    # Worker URLs to probe beside the target's own (`--worker`): a fleet's nodes that a
    # router does not list, or lists only to its operator.
    workers: tuple[str, ...] = ()
    rng: random.Random = field(init=False)
    _clients: dict[tuple[str, str, bool], ProbeClient] = field(init=False, default_factory=dict)
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

    def client(self, target: Target, tenant: Tenant = "a", *, paced: bool = False) -> ProbeClient:
        """The (cached, thread-safe) HTTP client for `tenant` on `target`; `paced`: one that
        retries availability failures within `pacing`."""
        return self.client_for_url(target.url, tenant, paced=paced)

    def client_for_url(self, url: str, tenant: Tenant = "a", *, paced: bool = False) -> ProbeClient:
        """The same client by URL (engine detection runs before a `Target` exists)."""
        url = url.rstrip("/")
        with self._lock:
            cached = self._clients.get((url, tenant, paced))
            if cached is None:
                cached = ProbeClient(
                    url,
                    api_key=self.key(tenant),
                    budget=self.budget,
                    timeout_s=self.request_timeout_s,
                    operator_key=self.operator_key,
                    pacing=self.pacing if paced else None,
                )
                self._clients[(url, tenant, paced)] = cached
            return cached

    def retries(self) -> tuple[int, float]:
        """(requests sent again, seconds spent on unavailable tries and the pauses after them)
        over the paced clients so far (`kvfence.audit.pacing`)."""
        with self._lock:
            paced = [c.retry for (_, _, is_paced), c in self._clients.items() if is_paced]
        return sum(a.retried for a in paced), sum(a.spent_s for a in paced)

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

    Fills `requests_sent` (budget delta) and `duration_s`; a statistical check's evidence
    gets `pacing`: the 503s and timeouts its paced clients sent again, none of them counted.
    """
    sent0 = ctx.budget.sent
    retried0, waited0 = ctx.retries()
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
    retried, waited = ctx.retries()
    if check.name in STATISTICAL_CHECKS or retried > retried0:
        res.evidence["pacing"] = {
            "retried": retried - retried0,
            "waited_s": round(waited - waited0, 1),
            "retries_per_request": ctx.pacing.retries,
            "max_wait_s_per_client": ctx.pacing.max_wait_s,
        }
    return res
