"""The latency check vouches for a sweep only when that sweep would have failed a skipped
prefill (`latency.skip`), and sizes a second sweep from the noise the first one saw.

Timings here are drawn, seeded, with the shapes a loaded 2-core machine gives (a prefill cost
growing with length, plus a wide or long-tailed delay): the rule is about numbers, and the
live checks (tests/peers, tests/audit_stats) run it on real servers.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvfence.audit.base import Verdict
from kvfence.audit.checks.latency import check as latency
from kvfence.audit.checks.latency.analysis import LatencyConfig, LatencySample, analyse
from kvfence.audit.checks.latency.pilot import Pace, planned_probes
from kvfence.audit.checks.latency.resweep import (
    closer_neighbour,
    hopeless,
    noise_needs,
    repeats_for_need,
)
from kvfence.audit.contract import AuditContext

CFG = LatencyConfig(alpha=1e-3 / 3 / 2)  # the runbook's share, per sweep
REPEATS = CFG.repeats_for(1e-3 / 3 / 2)
COST = {16: 0.10, 51: 0.15, 161: 0.25, 511: 0.45, 1023: 0.80}  # seconds of real prefill


def _sweep(
    seed: int, delay: str, spread: float, skip: bool, repeats: int = REPEATS
) -> list[LatencySample]:
    """`repeats` probes per length; `skip`: the longest answered at the shortest's cost."""
    rng = random.Random(seed)
    out = []
    for n, cost in COST.items():
        paid = COST[16] if skip and n == 1023 else cost
        for i in range(repeats):
            noise = rng.uniform(0, spread) if delay == "uniform" else rng.expovariate(1 / spread)
            out.append(LatencySample(n, paid + noise, "ttft", f"probe {n}/{i}"))
    return out


def test_a_noisy_sweep_whose_buckets_still_separate_decides() -> None:
    honest = analyse(_sweep(1, "uniform", 0.6, skip=False, repeats=64), CFG)
    ev = honest.evidence
    # Single probes' spread is large next to the extra cost (under 4 sigma of the short
    # bucket: a bar on it refused this sweep), yet short and neighbour separate.
    assert ev["predicted_prefill_increment_s"] < 4 * ev["short_bucket"]["noise_sigma_s"]
    assert honest.verdict is Verdict.PASS, honest.summary
    skipped = analyse(_sweep(1, "uniform", 0.6, skip=True, repeats=64), CFG)
    assert skipped.verdict is Verdict.FAIL, skipped.summary


def test_a_long_tailed_sweep_that_would_pass_a_skip_vouches_for_nothing() -> None:
    """The extra cost clears 4 sigma of the short bucket, but with this tail the same sweep
    passes a skip: neither it nor the honest one may be a PASS."""
    honest = analyse(_sweep(4, "exponential", 0.3, skip=False), CFG)
    ev = honest.evidence
    assert ev["predicted_prefill_increment_s"] >= 4 * ev["short_bucket"]["noise_sigma_s"]
    assert ev["skip_visible_p_value"] >= CFG.alpha
    assert honest.verdict is Verdict.INCONCLUSIVE, honest.summary
    assert "would not have failed a skipped prefill" in honest.summary
    skipped = analyse(_sweep(4, "exponential", 0.3, skip=True), CFG)
    assert skipped.verdict is Verdict.INCONCLUSIVE, skipped.summary  # never a PASS


def test_the_noise_seen_sizes_the_next_sweep() -> None:
    """A sweep too noisy to vouch for anything asks for more repeats; at that size, fresh
    sweeps with the same noise mostly decide where sweeps of the first size almost never
    did, and neither size passes a skip or fails honest prompts."""
    first = _sweep(0, "uniform", 0.5, skip=False)
    assert analyse(first, CFG).verdict is Verdict.INCONCLUSIVE
    wanted = repeats_for_need(
        noise_needs(first, CFG, REPEATS, analyse(first, CFG).p_value), CFG, REPEATS
    )
    assert REPEATS < wanted < CFG.max_repeats
    decided: dict[int, tuple[int, int]] = {}
    for repeats in (REPEATS, wanted):
        honest = [analyse(_sweep(s, "uniform", 0.5, False, repeats), CFG) for s in range(20, 40)]
        skipped = [analyse(_sweep(s, "uniform", 0.5, True, repeats), CFG) for s in range(20, 40)]
        assert all(r.verdict is not Verdict.PASS for r in skipped)  # never a missed skip
        assert all(r.verdict is not Verdict.FAIL for r in honest)  # never a false alarm
        decided[repeats] = (
            sum(r.verdict is Verdict.PASS for r in honest),
            sum(r.verdict is Verdict.FAIL for r in skipped),
        )
    assert decided[REPEATS][0] <= 3 and decided[REPEATS][1] <= 3, decided
    assert decided[wanted][0] >= 12 and decided[wanted][1] >= 12, decided


def _costs(costs: dict[int, float]) -> list[LatencySample]:
    rng = random.Random(0)
    return [LatencySample(n, c + rng.uniform(0, 0.05)) for n, c in costs.items() for _ in range(9)]


def test_a_flat_then_steep_cost_moves_the_neighbour_and_a_skip_does_not() -> None:
    """Chunked prefill under load (the vLLM P/D fleet): 511 tokens cost what 16 do, 1,023 far
    more; the next sweep's neighbour moves halfway up. Where the long prompts are the cheap
    ones (a skip), it stays: a nearer neighbour could sit in the skip too."""
    lengths = [16, 51, 161, 511, 1023]
    steep = _costs({16: 0.39, 51: 0.39, 161: 0.40, 511: 0.44, 1023: 1.16})
    assert closer_neighbour(lengths, steep) == [16, 51, 161, 767, 1023]
    skipped = _costs({16: 0.39, 51: 0.39, 161: 0.40, 511: 0.44, 1023: 0.40})
    assert closer_neighbour(lengths, skipped) == lengths


# A shape seen on the vLLM P/D fleet under load: flat to half the limit, then steep (16
# and 511 tokens alike, 1,023 three times as much), with the neighbour at 3/4 of the limit
# (its pool holds the longest prompt). Seeds: ones whose skipped sweep passed before the long prompts' own
# times were asked for, and others.
FLEET_COST = {16: 0.39, 58: 0.39, 211: 0.40, 767: 0.80, 1023: 1.16}
LINEAR_COST = {16: 0.10, 51: 0.15, 161: 0.25, 511: 0.45, 1023: 0.80}


def _planned(
    costs: dict[int, float],
    seed: int,
    spread: float,
    skip: bool,
    repeats: int,
    delay: str = "exponential",
) -> list[LatencySample]:
    """A sweep as the live check plans it (`planned_probes`), long-tailed delays unless
    `delay` says "uniform"."""
    rng = random.Random(seed)
    lengths = sorted(costs)
    out = []
    for n, k in planned_probes(lengths, repeats).items():
        paid = costs[lengths[0]] if skip and n == lengths[-1] else costs[n]
        out += [LatencySample(n, paid + _delay(rng, delay, spread)) for _ in range(k)]
    return out


@pytest.mark.parametrize(
    ("costs", "seeds"),
    [(LINEAR_COST, (11, 149, 159, 163, *range(20))), (FLEET_COST, (150, 159, *range(20)))],
    ids=["linear", "fleet"],
)
def test_a_skip_whose_own_draw_came_in_slow_never_passes(
    costs: dict[int, float], seeds: tuple[int, ...]
) -> None:
    """Where a skipped sweep's short prompts came in quick and its long ones slow, the skip
    test vouches and the test does not fail; the long prompts' own times, alike the short
    prompts', keep it from passing."""
    repeats = CFG.sweep_repeats(CFG.alpha or 0.0)
    verdicts = [analyse(_planned(costs, s, 0.3, True, repeats), CFG) for s in seeds]
    assert not [r.summary for r in verdicts if r.verdict is Verdict.PASS]
    vouched = [
        r for r in verdicts if r.verdict is Verdict.INCONCLUSIVE and "own times" in r.summary
    ]
    assert vouched, "the seeds chosen no longer reach the long prompts' own test"


def test_sweeps_are_sized_to_vouch_through_a_few_slowed_probes() -> None:
    """At the exact test's own size a third of the sweeps whose probes are slowed by load
    now and then (exponential delays of mean 0.2 s) cannot pass; at `sweep_repeats` every fresh sweep of that noise passes,
    and a skip of that noise fails or stays undecided, never passes."""
    level = CFG.alpha or 0.0
    small, sized = CFG.repeats_for(level), CFG.sweep_repeats(level)
    assert sized > small
    passed, failed = {}, {}
    for repeats in (small, sized):
        honest = [analyse(_planned(FLEET_COST, s, 0.2, False, repeats), CFG) for s in range(20)]
        skipped = [analyse(_planned(FLEET_COST, s, 0.2, True, repeats), CFG) for s in range(20)]
        assert all(r.verdict is not Verdict.FAIL for r in honest)
        assert all(r.verdict is not Verdict.PASS for r in skipped)
        passed[repeats] = sum(r.verdict is Verdict.PASS for r in honest)
        failed[repeats] = sum(r.verdict is Verdict.FAIL for r in skipped)
    assert passed[small] <= 16 and passed[sized] == 20, passed
    assert failed[sized] >= 16, failed


def test_the_neighbour_moves_up_only_where_the_pool_holds_the_longest_prompt() -> None:
    cfg = LatencyConfig()
    assert cfg.sweep(1023)[-2:] == [511, 1023]  # pool unknown: half
    assert cfg.sweep(1023, pool_tokens=2048)[-2:] == [767, 1023]  # the vLLM P/D fleet
    # The incident's shape: a reject path past the 2,688-token pool would skip a 3,071-token
    # neighbour too; the neighbour stays inside the pool.
    assert cfg.sweep(4095, pool_tokens=2688)[-2:] == [2047, 4095]


def test_the_warm_up_prices_a_sweep_without_under_counting_the_lengths_between() -> None:
    pace = Pace(
        tuple(LatencySample(n, s) for n, s in ((16, 0.4), (16, 0.5), (767, 0.8), (1023, 1.2))),
        failed=0,
    )
    planned = planned_probes([16, 58, 211, 767, 1023], 30)
    assert planned == {16: 30, 58: 10, 211: 10, 767: 30, 1023: 30}
    # 58 and 211 tokens are priced at the next length timed above them (767 tokens).
    assert pace.sweep_s(planned) == pytest.approx(30 * 0.45 + 20 * 0.8 + 30 * 0.8 + 30 * 1.2)
    assert Pace((), failed=3).sweep_s(planned) is None


def _decide(
    monkeypatch: pytest.MonkeyPatch,
    delay: str,
    spread: float,
    seed: int,
    costs: dict[int, float] = COST,
    skip: bool = False,
) -> Any:
    """The live check's loop of sweeps, each sweep drawn fresh with this noise; `skip`: the
    longest prompts answered at the shortest's cost."""
    draws = iter(range(seed, seed + 10))

    def sweep(ctx: Any, client: Any, cfg: LatencyConfig, lengths: list[int], repeats: int) -> Any:
        planned = planned_probes(lengths, repeats)
        rng = random.Random(next(draws))
        paid = {
            n: costs[min(costs)] if skip and n == max(costs) else _cost(costs, n) for n in planned
        }
        samples = [
            LatencySample(n, paid[n] + _delay(rng, delay, spread), "ttft", f"{n}/{i}")
            for n, k in planned.items()
            for i in range(k)
        ]
        return latency.Sweep(repeats, planned, samples)

    monkeypatch.setattr(latency, "_sweep", sweep)
    repeats = CFG.sweep_repeats(CFG.alpha or 0.0)  # the live check's first sweep
    return latency._decisive_sweep(AuditContext(), None, CFG, sorted(costs), repeats)  # type: ignore[arg-type]


def _cost(costs: dict[int, float], n: int) -> float:
    """`costs`, linear between its lengths (a second sweep may move its neighbour)."""
    lengths = sorted(costs)
    hi = next(m for m in lengths if m >= n)
    lo = max((m for m in lengths if m <= n), default=hi)
    if hi == lo:
        return costs[hi]
    return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


def _delay(rng: random.Random, delay: str, spread: float) -> float:
    return rng.uniform(0, spread) if delay == "uniform" else rng.expovariate(1 / spread)


def test_a_sweep_too_noisy_for_any_fresh_sweep_stops_and_says_what_deciding_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The vLLM P/D fleet here: the longest prompt's prefill is a fraction of the noise, and
    a second sweep of the most repeats the check runs ended undecided after minutes. Where
    the noise needs twice the check's cap, the check stops after the first sweep instead,
    whether or not the noise would have moved the neighbour (seed 4 live moved it, and
    its second sweep ended undecided after 688 s)."""
    for seed in range(0, 60, 10):
        _, result, earlier = _decide(monkeypatch, "exponential", 2.0, seed)
        assert earlier == [] and result.verdict is Verdict.INCONCLUSIVE, result.summary
        assert "a fresh sweep would not decide either" in result.summary, result.summary
        needed = result.evidence["next_sweep"]
        assert needed["most"] == CFG.max_repeats, needed
        assert needed["needed"] is None or needed["needed"] > 2 * CFG.max_repeats, needed
    # Where the noise leaves a fresh sweep a good chance (seeded: 6 of 6 such decided), every
    # undecided first sweep gets one, sized from the noise.
    resized = 0
    for seed in range(0, 120, 10):
        _, result, earlier = _decide(monkeypatch, "uniform", 0.5, seed)
        assert result.verdict is not Verdict.FAIL, result.summary
        assert "would not decide either" not in result.summary, result.summary
        resized += bool(earlier) and earlier[0]["next_repeats"]["wanted"] > REPEATS
    assert resized >= 3, resized
    # A cost flat to the neighbour and steep past it: the first sweep cannot see a skip
    # (short and neighbour alike), the long prompts plainly pay; the neighbour moves.
    flat_then_steep = {16: 0.39, 51: 0.39, 161: 0.39, 511: 0.39, 1023: 1.16}
    for seed in (0, 10, 20):
        _, result, earlier = _decide(monkeypatch, "uniform", 0.1, seed, flat_then_steep)
        assert earlier and earlier[0]["neighbour_moved"] == {"from": 511, "to": 767}, earlier
        assert result.verdict is Verdict.PASS, result.summary


# The `small` checkpoint on the vLLM P/D fleet: its short prompts meet stalls of a second.
SMALL_FLEET_COST = {16: 0.25, 58: 0.30, 211: 0.50, 767: 1.30, 1023: 1.60}


def test_a_skip_the_first_sweep_could_not_yet_fail_gets_a_second_sweep_that_fails_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A skip's long prompts never separate from the short ones, so what a pass needs is out
    of reach; a fail needs only the skip to be visible. Live, through a proxy that answered
    the fleet's 1,023-token prompts from their last 16 tokens, the first sweep saw the skip
    at p = 7.5e-9 but could not yet vouch it would (1.4e-7 against 1.7e-8), and stopping
    there, judged by what a pass needs, called the skip inconclusive. Seeded, every such
    sweep gets a second one, and fails."""
    verdicts, resized = [], 0
    for seed in range(0, 200, 10):
        _, result, earlier = _decide(
            monkeypatch, "exponential", 0.6, seed, SMALL_FLEET_COST, skip=True
        )
        verdicts.append(result.verdict)
        resized += bool(earlier)
    assert verdicts == [Verdict.FAIL] * len(verdicts), verdicts
    assert resized >= 2, resized


def test_a_sweep_called_hopeless_would_not_have_decided() -> None:
    """Seeded: first sweeps the rule stops after, each followed by the fresh sweep it would
    have run (the most repeats the check allows), decide at most 1 in 12."""
    decided = stopped = 0
    for seed in range(12):
        for delay, spread in (("exponential", 0.8), ("uniform", 1.2)):
            first = _planned(COST, seed, spread, False, REPEATS, delay)
            if not hopeless(
                noise_needs(first, CFG, REPEATS, analyse(first, CFG).p_value), CFG.max_repeats
            ):
                continue
            stopped += 1
            fresh = _planned(COST, 1000 + seed, spread, False, CFG.max_repeats, delay)
            decided += analyse(fresh, CFG).verdict is Verdict.PASS
    assert stopped >= 12 and decided <= stopped // 12, (stopped, decided)
