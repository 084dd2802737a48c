"""The guard's pieces without a server: fingerprint diffs and how an interval is graded."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfence.audit.base import CheckResult, Fact, Verdict
from kvfence.audit.checks.latency.check import LatencySample, design_p_value
from kvfence.audit.targets.base import TargetFacts
from kvfence.watch.budget import AlarmBudget
from kvfence.watch.cli import parse_listen, verdict_of
from kvfence.watch.fingerprint import Fingerprint
from kvfence.watch.guard import Interval
from kvfence.watch.metrics import WatchMetrics
from kvfence.watch.probes import MIN_ROUNDS, ROUND, SLACK, TimingWindow, window_rounds


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


def test_dashboard_and_rules_name_only_metrics_that_exist() -> None:
    """Every series the dashboard and the rules query is one the guard or kvfence exports."""
    root = Path(__file__).resolve().parents[2] / "deploy"
    dash = json.loads((root / "grafana" / "kvfence-guard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append((root / "prometheus" / "kvfence-rules.yml").read_text())
    guard = {m.name for m in WatchMetrics().registry.collect()}
    engine = {"kvfence_prefill_seconds", "kvfence_time_to_first_token_seconds"}
    engine |= {"kvfence_request_prompt_tokens", "kvfence_request_cached_tokens"}
    engine |= {f"kvfence_{n}" for n in ("isolation_violations", "transfer_mismatches")}
    engine |= {"kvfence_transfer_failures"}
    engine |= {f"kvfence_num_requests_{n}" for n in ("running", "waiting")}
    engine |= {"kvfence_kv_cache_usage_perc", "kvfence_e2e_request_latency_seconds"}
    engine |= {"kvfence_inter_token_latency_seconds"}
    known = guard | engine
    used = set(re.findall(r"\b(kvfence_[a-z0-9_]+)", "\n".join(exprs)))
    base = {re.sub(r"_(total|bucket)$", "", u) for u in used}  # counter / histogram series
    assert base - known == set()
    assert len(dash["panels"]) >= 10
    # ...and every series the guard exports is charted or alerted on (none exported unseen);
    # the guard's own request load is charted per target.
    assert guard - base == set()
    charted = "\n".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    assert 'rate(kvfence_guard_requests_total{target=~"$target"}[5m])' in charted


ALPHA_1S = AlarmBudget(1.0, 1.0).alpha  # the Prometheus test's interval: ~3.9e-7 per test


def _window(
    seconds_of: Callable[[int, random.Random], float], seed: int = 0, rounds: int = 40
) -> TimingWindow:
    """The rounds the guard sends: longest and neighbour twice, one shorter in rotation."""
    rng = random.Random(seed)
    w = TimingWindow(ALPHA_1S)
    assert w.samples.maxlen == ROUND * window_rounds(ALPHA_1S) >= ROUND * rounds
    others = (16, 38, 90)
    for i in range(rounds):
        for n in (511, 214, 511, 214, others[i % 3]):
            w.samples.append(LatencySample(n, seconds_of(n, rng), "ttft", f"{n}"))
    return w


def test_the_budget_sets_each_tests_alpha_by_the_union_bound() -> None:
    assert AlarmBudget(1.0, 60.0).alpha == pytest.approx(1 / 43200)
    assert AlarmBudget(3.0, 1.0).alpha == pytest.approx(3 / 2_592_000)
    assert "alpha 2.3e-05 per test" in AlarmBudget().describe()
    with pytest.raises(ValueError):
        AlarmBudget(0.0, 60.0)
    # The window is big enough that a total skip reaches the alpha with SLACK probes to spare,
    # and grows with -log alpha.
    rounds = window_rounds(ALPHA_1S)
    assert rounds >= MIN_ROUNDS and 2 * design_p_value(2 * rounds, 2 * rounds, SLACK) < ALPHA_1S
    assert design_p_value(2 * MIN_ROUNDS, 2 * MIN_ROUNDS, SLACK) >= 1e-30
    assert window_rounds(1e-30) > MIN_ROUNDS


def test_timing_alarm_is_the_exact_test_at_the_budget_alpha() -> None:
    def noise(rng: random.Random, scale: float = 0.02) -> float:
        return 0.05 + rng.expovariate(1 / scale)  # load only ever adds delay

    def real(n: int, rng: random.Random, scale: float = 0.02) -> float:
        return 0.2e-3 * n + noise(rng, scale)

    def skipped(n: int, rng: random.Random) -> float:  # the lab: over-pool = 1-token placeholder
        return real(1 if n > 336 else n, rng, 0.005)

    result, alarm = _window(skipped).judge()
    assert alarm, result.summary  # one window is enough: no streak rule
    assert result.p_value is not None and result.p_value < ALPHA_1S == result.alpha
    young, alarm = _window(skipped, rounds=4).judge()  # best p 1/C(16, 8): cannot page yet
    assert not alarm and young.verdict is Verdict.INCONCLUSIVE, young.summary
    for seed in range(20):  # heavy load noise (mean 20 ms over a 4-100 ms prefill)
        flat, paid = _window(lambda n, r: noise(r), seed), _window(real, seed)
        assert not flat.judge()[1]  # no prefill cost: never an alarm
        assert not paid.judge()[1]  # prefill paid: never an alarm


def test_probe_rounds_stay_within_the_target_time_share() -> None:
    from kvfence.watch.guard import GuardConfig, Keys, TargetGuard

    config = GuardConfig(interval_s=60.0, max_target_share=0.02)
    guard = TargetGuard(
        "http://127.0.0.1:9", "kvfence", Keys(None, None, None), config, WatchMetrics()
    )
    try:
        assert guard.next_round_at <= time.monotonic()  # nothing spent yet: the first round runs
        # A round of 18 s (near-context prefills on a small CPU model) waits 900 s for the next:
        # 18 / 900 = 2%, whatever the round's size and the interval.
        assert guard.spaced(1000.0, 18.0) == pytest.approx(1900.0)
        assert guard.spaced(1000.0, 0.3) == pytest.approx(1015.0)
        # A round not yet due is skipped before any request (the target is never touched).
        guard.next_round_at = time.monotonic() + 600.0
        out = Interval(True)
        guard._probe(None, facts(1024), out)  # type: ignore[arg-type]
        assert out.notes and "probe round skipped: next in" in out.notes[-1], out.notes
    finally:
        guard.close()
