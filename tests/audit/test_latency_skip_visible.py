"""The latency check vouches for a sweep only when that sweep would have failed a skipped
prefill (`latency.skip`), and sizes a second sweep from the noise the first one saw.

Timings here are drawn, seeded, with the shapes a loaded 2-core machine gives (a prefill cost
growing with length, plus a wide or long-tailed delay): the rule is about numbers, and the
live checks (tests/peers, tests/audit_stats) run it on real servers.
"""

from __future__ import annotations

import random

from kvfence.audit.base import Verdict
from kvfence.audit.checks.latency.analysis import LatencyConfig, LatencySample, analyse
from kvfence.audit.checks.latency.resweep import closer_neighbour, repeats_for_noise

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
    wanted = repeats_for_noise(first, CFG, REPEATS)
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
