"""An ambiguous latency sweep (inconclusive, or a pass with p < recheck_below) is replaced by
a fresh one, each tested alone at alpha / sweeps; a clear verdict stops at once. Seen on the
lab at load 13: one sweep passed with p = 0.063 (a leak blurred by the machine's load)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfence.audit.base import Verdict
from kvfence.audit.checks.latency import check as latency
from kvfence.audit.checks.latency.check import LatencyAnalysis, LatencyConfig, Sweep
from kvfence.audit.contract import AuditContext


def _run(monkeypatch: pytest.MonkeyPatch, outcomes: list[tuple[Verdict, float | None]]) -> Any:
    calls: list[int] = []

    def sweep(*args: Any) -> Sweep:
        calls.append(1)
        return Sweep()

    monkeypatch.setattr(latency, "_sweep", sweep)
    results = iter(LatencyAnalysis(v, f"sweep {i}", p_value=p) for i, (v, p) in enumerate(outcomes))
    monkeypatch.setattr(latency, "analyse", lambda samples, cfg: next(results))
    cfg = LatencyConfig(alpha=1e-4, sweeps=2)
    ctx = AuditContext()
    _, result, earlier = latency._decisive_sweep(ctx, None, cfg, [16, 511], 3)  # type: ignore[arg-type]
    return len(calls), result, earlier


@pytest.mark.parametrize(
    "first", [(Verdict.PASS, 0.06), (Verdict.INCONCLUSIVE, None)], ids=["lean", "undecided"]
)
def test_an_ambiguous_sweep_is_replaced(
    monkeypatch: pytest.MonkeyPatch, first: tuple[Verdict, float | None]
) -> None:
    n, result, earlier = _run(monkeypatch, [first, (Verdict.FAIL, 1e-9)])
    assert n == 2 and result.verdict is Verdict.FAIL and earlier[0]["verdict"] == first[0].value


@pytest.mark.parametrize("clear", [(Verdict.PASS, 1.0), (Verdict.FAIL, 1e-9)], ids=["pass", "fail"])
def test_a_clear_sweep_decides(
    monkeypatch: pytest.MonkeyPatch, clear: tuple[Verdict, float | None]
) -> None:
    n, result, earlier = _run(monkeypatch, [clear, (Verdict.PASS, 1.0)])
    assert n == 1 and result.verdict is clear[0] and earlier == []


def test_at_most_sweeps(monkeypatch: pytest.MonkeyPatch) -> None:
    n, result, _ = _run(
        monkeypatch, [(Verdict.PASS, 0.1), (Verdict.PASS, 0.2), (Verdict.FAIL, 0.0)]
    )
    assert n == 2 and result.verdict is Verdict.PASS  # the last allowed sweep stands
