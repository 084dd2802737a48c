"""What the latency check changes for a second sweep when the first could not have seen a
skip (`latency.skip`): a neighbour nearer the longest prompt, or as many repeats as the
noise it measured needs, within the time the audit has left."""

from __future__ import annotations

import math

from kvfence.audit.base import Verdict
from kvfence.audit.checks.latency.analysis import LatencyAnalysis, LatencyConfig, LatencySample
from kvfence.audit.checks.latency.exact import buckets, median_of
from kvfence.audit.checks.latency.skip import paid_test, skip_test

# More repeats than the noise extrapolates to, for most fresh sweeps (not half) to get there.
POWER_FACTOR = 1.5
# A fresh sweep is not worth its time when the most repeats the check can run are below
# the noise's bare extrapolation by this factor: it would end undecided all the same.
HOPELESS_FACTOR = 2.0

__all__ = [
    "POWER_FACTOR",
    "closer_neighbour",
    "hopeless",
    "noise_hid_a_skip",
    "noise_needs",
    "repeats_for_need",
    "repeats_that_fit",
]


def closer_neighbour(lengths: list[int], samples: list[LatencySample]) -> list[int]:
    """The sweep with its neighbour halfway to the longest prompt, where the cost jumps past
    the neighbour; else unchanged.

    A neighbour that costs no more than a short prompt cannot show a skip, whatever the
    repeats: the test compares the long prompts with it. Serving stacks step prefill in
    chunks and pay per step, so the cost can stay flat to half the limit and jump past it
    (the vLLM P/D fleet here, loaded: 16 and 511 tokens 0.39 and 0.44 s, 1,023 tokens
    1.16 s). The move is made only when the long prompts cost more over the neighbour than
    the neighbour over a short one: a skip makes the long prompts cheap, and then the
    neighbour stays where it is (a skip that also reached a nearer neighbour, a reject path
    past a pool, would hide in both). Any shorter neighbour keeps H0's order, and the next
    sweep is judged alone on its own data."""
    b = buckets(samples)
    if len(lengths) < 3 or lengths[-1] - lengths[-2] < 2 or not (b.short and b.neighbour):
        return lengths
    short, mid = median_of(b.short), median_of(b.neighbour)
    if not b.long or median_of(b.long) - mid <= mid - short:
        return lengths
    return [*lengths[:-2], (lengths[-2] + lengths[-1]) // 2, lengths[-1]]


def noise_hid_a_skip(result: LatencyAnalysis, cfg: LatencyConfig) -> bool:
    """The sweep was undecided because its noise, at its sizes, hid what a pass needs: a skip
    it could have failed (`skip_test`) or the long prompts' own cost (`paid_test`), each at
    alpha x margin."""
    level = (cfg.alpha if cfg.alpha is not None else 0.0) * cfg.skip_margin
    skip = result.evidence.get("skip_visible_p_value")
    paid = result.evidence.get("paid_p_value")
    return result.verdict is Verdict.INCONCLUSIVE and any(
        isinstance(p, float) and p >= level for p in (skip, paid)
    )


def repeats_for_need(need: float, cfg: LatencyConfig, repeats: int) -> int:
    """Repeats per length for a fresh sweep whose noise needs `need` (`noise_needs`), with
    `POWER_FACTOR`'s margin: at most ``cfg.max_repeats``, at least `repeats`."""
    if math.isinf(need):
        return cfg.max_repeats  # no separation at all: only the most the check allows
    return max(repeats, min(cfg.max_repeats, math.ceil(need * POWER_FACTOR)))


def hopeless(need: float, can: int) -> bool:
    """A fresh sweep of at most `can` repeats per length would end undecided all the same:
    the noise's bare need (`noise_needs`) is `HOPELESS_FACTOR` times more, or unbounded."""
    return need > HOPELESS_FACTOR * can


def noise_needs(
    samples: list[LatencySample],
    cfg: LatencyConfig,
    repeats: int,
    test_p: float | None,
    paid_only: bool = False,
) -> float:
    """Repeats per length at which a fresh sweep with this sweep's noise reaches a verdict
    about half the time, uncapped (inf: no separation at all); at least `repeats`: the fewer
    of what a pass needs and what a fail needs. ``test_p``: this sweep's own test p-value
    (``analyse(samples, cfg).p_value``, which the caller has already).
    ``paid_only``: a pass judged from `paid_test` alone, for a sweep whose neighbour moves (a
    nearer neighbour separates from the short prompts better, never better than the long
    ones do).

    For a fixed separation between two buckets an exact test's p-value falls exponentially
    with the probes per bucket (a hypergeometric tail), so each test extrapolates,
    log-linearly from its p-value here, to the repeats that reach its level. A pass needs
    `skip_test` and `paid_test` at alpha x margin; a fail needs the test itself at alpha and
    `skip_test` at alpha x margin, and not `paid_test`, which a skip never meets (its long
    prompts are drawn like the short ones). The larger need of each verdict is where a fresh
    sweep reaches it about half the time, and `POWER_FACTOR` more gets most of them there
    (seeded sweeps: 1.0 decided 7 of 20, 1.5 most). Resampling the sweep instead flatters
    it: its values repeat and its tail is cut."""
    b = buckets(samples)
    alpha = cfg.alpha if cfg.alpha is not None else 0.0
    if not b.short or not b.neighbour or not b.long or alpha <= 0:
        return float(repeats)
    args = (cfg.skipped_fraction, cfg.material_fraction, cfg.noise_floor_s)
    level = alpha * cfg.skip_margin
    per_length = min(len(b.short), len(b.neighbour), len(b.long))
    skip, paid = skip_test(b, *args), paid_test(b, *args)
    skip_p = None if skip is None else skip.p_value
    paid_p = None if paid is None else paid.p_value
    to_pass = _extrapolated(
        per_length, [(paid_p, level)] + ([] if paid_only else [(skip_p, level)])
    )
    to_fail = _extrapolated(per_length, [(test_p, alpha), (skip_p, level)])
    return max(float(repeats), min(to_pass, to_fail))


def _extrapolated(per_length: int, tests: list[tuple[float | None, float]]) -> float:
    """Repeats per length at which every (p-value, level) pair here reaches its level, each
    p-value falling log-linearly with the repeats; inf where one cannot fall (p = 1 or no
    test)."""
    wanted = float(per_length)
    for p, level in tests:
        if p is None or p >= 1.0:
            return math.inf
        if p >= level:
            wanted = max(wanted, per_length * math.log(level) / math.log(p))
    return wanted


def repeats_that_fit(remaining_s: float, took_s: float, probes: int, lengths: list[int]) -> int:
    """Repeats per length that the time budget left can pay, at this sweep's pace (half of it:
    the rest of the audit runs after this check)."""
    per_probe = took_s / max(1, probes)
    return int(0.5 * remaining_s / max(per_probe * len(lengths), 1e-9))
