"""The guard's pieces without a server: fingerprint diffs and how an interval is graded."""

from __future__ import annotations

from kvfence.audit.base import CheckResult, Fact, Verdict
from kvfence.audit.targets.base import TargetFacts
from kvfence.watch.cli import parse_listen, verdict_of
from kvfence.watch.fingerprint import Fingerprint
from kvfence.watch.guard import Interval


def facts(pool: int | None, faults: str = "none") -> TargetFacts:
    f = TargetFacts(engine=Fact("kvfence", "test"))
    f.pool_tokens = Fact(pool, "test") if pool is not None else Fact.unknown("test", "down")
    f.context_length = Fact(512, "test")
    f.extra["lab_faults"] = Fact(faults, "test")
    return f


def test_a_smaller_pool_or_a_new_fault_is_a_change() -> None:
    base = Fingerprint.of(facts(1024))
    assert Fingerprint.of(facts(1024)) == base and base.gateable
    assert Fingerprint.of(facts(336)).diff(base) == ["pool_tokens: 1024 -> 336"]
    assert Fingerprint.of(facts(1024, "no-ledger-check")).diff(base) == [
        "lab_faults: none -> no-ledger-check"
    ]
    assert not Fingerprint.of(facts(None)).gateable  # unknown pool: fail closed


def test_an_interval_is_graded_like_the_audit() -> None:
    ok = CheckResult("capacity", "t", Verdict.PASS, "")
    bad = CheckResult("capacity", "t", Verdict.FAIL, "")
    assert verdict_of(Interval(True, gate=ok, boundary=ok)) is Verdict.PASS
    assert verdict_of(Interval(True)) is Verdict.PASS  # nothing changed, nothing crossed
    assert verdict_of(Interval(True, gate=bad, boundary=ok)) is Verdict.FAIL
    assert verdict_of(Interval(True, crossed=True)) is Verdict.FAIL
    assert verdict_of(Interval(True, too_fast=True)) is Verdict.FAIL
    assert verdict_of(Interval(False, error="down")) is Verdict.INCONCLUSIVE  # never a pass


def test_listen_address() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen(":9100") == ("127.0.0.1", 9100)
