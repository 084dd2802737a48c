"""The guard's false-alarm budget: from "at most B false alerts per 30 days" to a per-test alpha.

The guard repeats its timing test every interval, forever; a fixed per-test
alpha would become a steady stream of false alarms (1e-3 at one test a minute
is 43 a month). So the operator sets the budget B and each test runs at

    alpha = B / (tests in 30 days) = B · interval / 30 d.

By linearity of expectation the expected number of false alarms on an honest
target in 30 days is at most B, and by the union bound the chance of even one
is at most B — both hold whatever the dependence between tests (consecutive
windows share most of their probes), so no independence is assumed. An
interval that runs long or skips its probe round only lowers the count.

The canary needs no alpha: a crossing is tenant A's sentinel found verbatim
in tenant B's answer, deterministic evidence that cannot happen by chance on
an isolated engine, so each crossing alerts.
"""

from __future__ import annotations

from dataclasses import dataclass

THIRTY_DAYS_S = 30 * 86400.0


@dataclass(frozen=True, slots=True)
class AlarmBudget:
    """False alarms allowed per target per 30 days, and the interval the tests run at."""

    false_alarms_per_30d: float = 1.0
    interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.false_alarms_per_30d <= 0 or self.interval_s <= 0:
            raise ValueError("need a positive false-alarm budget and interval")

    @property
    def tests_per_30d(self) -> float:
        return max(1.0, THIRTY_DAYS_S / self.interval_s)

    @property
    def alpha(self) -> float:
        """Each timing test's level (capped at 0.5: a test that alarms more than half the time
        on an honest engine says nothing)."""
        return min(0.5, self.false_alarms_per_30d / self.tests_per_30d)

    def describe(self) -> str:
        return (
            f"false-alarm budget {self.false_alarms_per_30d:g} per target per 30 days: "
            f"{self.tests_per_30d:.0f} timing tests at {self.interval_s:g} s -> "
            f"alpha {self.alpha:.2g} per test (union bound); canary crossings are "
            "deterministic evidence (no alpha)"
        )
