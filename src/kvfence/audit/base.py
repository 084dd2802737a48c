"""The audit's core values: verdicts, facts with sources, check results and their plots.

A leaf: it imports nothing else of the audit but the budget (itself a leaf), so every
other module (the HTTP client, the engine adapters, the checks) can build on it without
an import running back. The contract a check follows and the context it gets are in
`audit.contract`.

Fail closed: a `Fact` whose value is None is unknown, and a check must treat it as
INCONCLUSIVE, never PASS. `evidence` is a JSON-serialisable dict a reviewer can act on;
`plots` are data, not pictures (the HTML report draws them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from kvfence.audit.budget import Budget, BudgetExhausted

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_HEADROOM",
    "STATISTICAL_CHECKS",
    "Budget",
    "BudgetExhausted",
    "CheckResult",
    "Fact",
    "JSONValue",
    "Plot",
    "PlotSeries",
    "Tenant",
    "Verdict",
    "worst",
]

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
