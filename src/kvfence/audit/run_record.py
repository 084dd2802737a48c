"""What one audit run found: each target's summary and every check's result.

`AuditRun` is everything a report needs; its verdict is the worst of its results and its
exit code is the CLI's (0 pass, 1 fail, 2 inconclusive or nothing verified).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.audit.base import CheckResult, JSONValue, Verdict, worst


@dataclass(slots=True)
class TargetSummary:
    url: str
    engine: str | None
    detected_by: str | None
    facts: dict[str, JSONValue] | None = None
    error: str | None = None
    requests_sent: int = 0  # detection, facts and the counter snapshot (not any check's)
    name: str = ""  # what the reports call it (`--target NAME=URL`); "" shows the URL

    @property
    def label(self) -> str:
        return self.name or self.url

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "name": self.label,
            "url": self.url,
            "engine": self.engine,
            "detected_by": self.detected_by,
            "facts": self.facts,
            "error": self.error,
            "requests_sent": self.requests_sent,
        }


@dataclass(slots=True)
class AuditRun:
    """Everything a report needs."""

    targets: list[TargetSummary]
    results: list[CheckResult]
    checks: tuple[str, ...]
    started_at: str
    duration_s: float
    requests_sent: int
    settings: dict[str, JSONValue] = field(default_factory=dict)

    @property
    def verdict(self) -> Verdict:
        return worst([r.verdict for r in self.results])

    def exit_code(self, fail_on_inconclusive: bool = True) -> int:
        """0 all passed (or not applicable, or skipped), 1 any fail, 2 inconclusive (when it blocks)."""
        v = self.verdict
        if v is Verdict.FAIL:
            return 1
        if v is Verdict.INCONCLUSIVE:
            return 2 if fail_on_inconclusive else 0
        if not any(r.verdict.decisive_ok for r in self.results):
            return 2 if fail_on_inconclusive else 0  # nothing was actually verified
        return 0

    def counts(self) -> dict[str, int]:
        out = {v.value: 0 for v in Verdict}
        for r in self.results:
            out[r.verdict.value] += 1
        return out

    def name_of(self, url: str) -> str:
        """The name a report shows for the target at `url` (the URL where none was given)."""
        return next((t.label for t in self.targets if t.url == url), url)

    def results_of(self, target: TargetSummary) -> list[CheckResult]:
        return [r for r in self.results if r.target == target.url]
