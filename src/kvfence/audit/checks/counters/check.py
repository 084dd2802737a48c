"""The engine's own isolation / transfer failure counters must not move during the audit.

`snapshot` runs first in the runbook; `CountersCheck` runs last and compares.
kvfence: isolation violations (I1), transfer mismatches (I3), transfer
failures; SGLang PD: transfer and bootstrap failures when exported. An
engine without such counters gets SKIPPED (nothing to compare), not PASS —
unless it states it is not disaggregated (`premises.disaggregation`): then
no KV transfer exists to fail and the verdict is NOT_APPLICABLE, naming the
fact. Counters an engine does export are compared whatever it states.
"""

from __future__ import annotations

from typing import Any

from kvfence.audit.base import CheckResult, Fact, Verdict
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.premises import disaggregation
from kvfence.audit.targets.base import Target

INFORMATIONAL = "(informational)"


class CountersCheck(Check):
    """Compare counters against the snapshot taken before the other checks ran."""

    name = "counters"
    description = "engine-reported isolation/transfer failure counters unchanged across the audit"

    def __init__(self) -> None:
        self._before: dict[str, dict[str, Fact]] = {}

    def snapshot(self, ctx: AuditContext, target: Target) -> None:
        """Read the counters now (call before the other checks)."""
        self._before[target.url] = target.read_counters(ctx.client(target, "a"))

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        before = self._before.get(target.url)
        after = target.read_counters(ctx.client(target, "a"))
        if before is None:
            return self.result(
                target, Verdict.INCONCLUSIVE, "no snapshot was taken before the audit"
            )
        watched = [k for k, f in before.items() if INFORMATIONAL not in f.note]
        if not watched and not after:
            return self._nothing_to_compare(ctx, target)
        rows, moved, unreadable = compare(before, after)
        evidence: dict[str, Any] = {
            "counters": rows,
            "informational": _informational(before, after),
        }
        if moved:
            return self.result(
                target,
                Verdict.FAIL,
                "failure counters moved during the audit: " + "; ".join(moved),
                evidence,
            )
        if unreadable:
            why = _why_unreadable(before, after, unreadable)
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                "counters not readable before and after: " + ", ".join(unreadable) + why,
                evidence,
            )
        return self.result(
            target,
            Verdict.PASS,
            f"{len(rows)} failure counters unchanged: "
            + ", ".join(f"{r['counter']}={r['after']}" for r in rows),
            evidence,
        )

    def _nothing_to_compare(self, ctx: AuditContext, target: Target) -> CheckResult:
        """No counters: not applicable where the engine states it moves no KV, else skipped."""
        none = f"{target.engine} exports no isolation or transfer failure counters"
        premise = disaggregation(target.facts(ctx.client(target, "a")))
        if premise.absent:
            return self.result(
                target,
                Verdict.NOT_APPLICABLE,
                premise.decided(f"no KV transfer can fail or mismatch; {none}"),
                {"premises": [premise.to_json()]},
            )
        return self.result(target, Verdict.SKIPPED, none, {"premises": [premise.to_json()]})


def _why_unreadable(before: dict[str, Fact], after: dict[str, Fact], names: list[str]) -> str:
    """The engine's reasons (each once), e.g. that /metrics needs --operator-key."""
    notes = [f.note for n in names for f in (before.get(n), after.get(n)) if f and not f.known]
    distinct = list(dict.fromkeys(n for n in notes if n))
    return f" ({'; '.join(distinct)})" if distinct else ""


def _informational(before: dict[str, Fact], after: dict[str, Fact]) -> dict[str, Any]:
    """Counters shown for context only: they may move during an audit without meaning a leak."""
    return {
        k: {"before": before[k].value if k in before else None, "after": f.value}
        for k, f in after.items()
        if INFORMATIONAL in f.note
    }


def compare(
    before: dict[str, Fact], after: dict[str, Fact]
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(a row per watched counter, the ones that moved, the ones not readable both times)."""
    watched = {k for k, f in before.items() if INFORMATIONAL not in f.note}
    watched |= {k for k, f in after.items() if INFORMATIONAL not in f.note}
    rows: list[dict[str, Any]] = []
    moved: list[str] = []
    unreadable: list[str] = []
    for name in sorted(watched):
        b, a = before.get(name), after.get(name)
        seen = a or b
        rows.append(
            {
                "counter": name,
                "before": b.value if b else None,
                "after": a.value if a else None,
                "source": seen.source if seen else "",
            }
        )
        if b is None or a is None or not b.known or not a.known:
            unreadable.append(name)
        elif a.value != b.value:
            # The engine's meaning of the counter, where its adapter knows it.
            meaning = f" ({a.note})" if a.note else ""
            moved.append(f"{name} {b.value} → {a.value}{meaning}")
    return rows, moved, unreadable
