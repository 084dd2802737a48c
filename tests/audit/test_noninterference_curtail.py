"""Stopping B's repeats under load early never changes the noninterference verdict: every way
the remaining rounds could go is enumerated and judged as the full design would judge it."""

from __future__ import annotations

import itertools
import random

import pytest

from kvfence.audit.checks.noninterference.curtail import decided
from kvfence.audit.checks.noninterference.probes import Tally
from kvfence.audit.stats import divergence_excess


def _tally(per_probe: dict[int, tuple[int, int]]) -> Tally:
    """per_probe: probe -> (answers, diverged)."""
    return Tally(
        total=sum(n for n, _ in per_probe.values()),
        diverged=sum(d for _, d in per_probe.values()),
        per_probe={i: [n, d] for i, (n, d) in per_probe.items()},
    )


def _fails(alpha: float, alone: Tally, loaded: Tally) -> bool:
    """The check's rule (`check._fisher`): pooled and per-probe one-sided Fisher tests, each at
    alpha / (probes + 1)."""
    probes = sorted(alone.per_probe.keys() & loaded.per_probe.keys())
    level = alpha / (len(probes) + 1)
    tests = [divergence_excess(alone.diverged, alone.total, loaded.diverged, loaded.total)]
    for i in probes:
        (a_n, a_d), (l_n, l_d) = alone.per_probe[i], loaded.per_probe[i]
        tests.append(divergence_excess(a_d, a_n, l_d, l_n))
    return min(t.p_value for t in tests) < level


def _completions(
    loaded: dict[int, tuple[int, int]], rounds_left: int
) -> list[dict[int, tuple[int, int]]]:
    """Every final tally the remaining rounds can give (each probe: 0..left more divergences)."""
    probes = sorted(loaded)
    out = []
    for extra in itertools.product(range(rounds_left + 1), repeat=len(probes)):
        out.append(
            {
                i: (loaded[i][0] + rounds_left, loaded[i][1] + e)
                for i, e in zip(probes, extra, strict=True)
            }
        )
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_stop_reaches_the_verdict_every_completion_reaches(seed: int) -> None:
    rng = random.Random(seed)
    alpha, repeats, probes = 1e-2, 8, 3
    stops = {"fail": 0, "pass": 0}
    for _ in range(150):
        alone = {i: (repeats, rng.choice((0, 0, 0, 1))) for i in range(probes)}
        done = rng.randrange(1, repeats)
        rate = rng.choice((0.0, 0.0, 0.3, 0.9, 1.0))
        loaded = {i: (done, sum(rng.random() < rate for _ in range(done))) for i in range(probes)}
        why = decided(alpha, _tally(alone), _tally(loaded), repeats - done)
        if why is None:
            continue
        finals = [
            _fails(alpha, _tally(alone), _tally(final))
            for final in _completions(loaded, repeats - done)
        ]
        if "fails whatever" in why:
            stops["fail"] += 1
            assert all(finals), (alone, loaded, why)
        else:
            stops["pass"] += 1
            assert not any(finals), (alone, loaded, why)
    assert stops["fail"] and stops["pass"], stops  # both kinds of stop were exercised


def test_an_honest_engine_stops_after_seven_of_ten_rounds_and_a_leak_after_four() -> None:
    """The default design (4 probes, 10 repeats, the audit's 1e-3 over three checks)."""
    alpha = 1e-3 / 3
    alone = _tally({i: (10, 0) for i in range(4)})
    honest = [decided(alpha, alone, _tally({i: (k, 0) for i in range(4)}), 10 - k) for k in (6, 7)]
    assert honest[0] is None and honest[1] is not None and "could reach" in honest[1]
    leak = [decided(alpha, alone, _tally({i: (k, k) for i in range(4)}), 10 - k) for k in (3, 4)]
    assert leak[0] is None and leak[1] is not None and "fails whatever" in leak[1]
