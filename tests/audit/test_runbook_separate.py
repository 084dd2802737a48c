"""`run_audit(..., separate_targets=True)`: the untimed checks of separate targets overlap, a
timed check never overlaps any other check, and the results and their request counts are the
sequential run's."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from kvfence.audit import runbook
from kvfence.audit.base import CheckResult, Verdict
from kvfence.audit.check_table import DEFAULT_CHECKS, TIMED_CHECKS
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.runbook import run_audit
from kvfence.audit.targets.base import Endpoints, Target, TargetFacts

URLS = ("http://127.0.0.1:9/lab", "http://127.0.0.1:9/fix")


class _Offline(Target):
    engine = "offline"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        raise ConnectionError("no server in this test")  # the runbook records it, fail closed


@dataclass
class _Clock:
    """Who ran when; `meet` makes the canary of each target wait for the other's."""

    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    meet: threading.Barrier | None = None


class _Recorded(Check):
    def __init__(self, name: str, clock: _Clock) -> None:
        self.name, self.clock = name, clock

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        start = time.monotonic()
        sends = 1 + URLS.index(target.url) + DEFAULT_CHECKS.index(self.name)
        ctx.budget.charge(sends)  # what a check's requests do, without a server
        if self.name == "canary" and self.clock.meet is not None:
            self.clock.meet.wait()  # BrokenBarrierError after 5 s if the targets do not overlap
        time.sleep(0.05)
        with self.clock.lock:
            self.clock.spans.append((target.url, self.name, start, time.monotonic()))
        return self.result(target, Verdict.PASS, f"{sends} sent")


def _audit(monkeypatch: pytest.MonkeyPatch, clock: _Clock, separate: bool) -> runbook.AuditRun:
    monkeypatch.setattr(runbook, "make_target", lambda url, engine, client, **_: _Offline(url))
    monkeypatch.setattr(runbook, "loaded_or_inconclusive", lambda name, url: _Recorded(name, clock))
    ctx = AuditContext()
    with ctx.open():
        return run_audit(list(URLS), ctx, engine="offline", separate_targets=separate)


def test_untimed_checks_overlap_timed_ones_run_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(meet=threading.Barrier(2, timeout=5))
    run = _audit(monkeypatch, clock, separate=True)
    assert [r.verdict for r in run.results] == [Verdict.PASS] * 2 * len(DEFAULT_CHECKS)
    for url, name, start, end in clock.spans:
        if name not in TIMED_CHECKS:
            continue
        others = [(u, n) for u, n, s, e in clock.spans if s < end and e > start]
        assert others == [(url, name)], f"{name} on {url} overlapped {others}"


def test_results_and_counts_are_the_sequential_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    together = _audit(monkeypatch, _Clock(), separate=True)
    in_turn = _audit(monkeypatch, _Clock(), separate=False)

    def table(run: runbook.AuditRun) -> list[tuple[str, str, int]]:
        return [(r.target, r.check, r.requests_sent) for r in run.results]

    assert table(together) == table(in_turn)
    assert [(t.url, t.error is not None) for t in together.targets] == [(u, True) for u in URLS]
    want = sum(1 + i + j for i in range(len(URLS)) for j in range(len(DEFAULT_CHECKS)))
    assert together.requests_sent == in_turn.requests_sent == want
