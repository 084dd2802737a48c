"""When B's repeats under load may stop early without changing the verdict.

The check's verdict is a function of the counts at the end of the planned repeats: FAIL when
one of its Fisher tests (pooled, and one per probe) reaches its share of alpha. After each
round of repeats (every probe once) the rounds still to come can only add agreeing or
diverging answers, so each test's final p-value lies between two bounds: every remaining
answer diverges (its smallest) or none does (its largest). Once some test is below its level
even at its largest, the verdict is FAIL whatever comes; once every test stays at or above
its level even at its smallest, it cannot be FAIL. Stopping there (deterministic
curtailment) sends fewer requests and reaches the verdict the full design would have: the
error rates are the full design's, exactly. The bounds use the level that is least
favourable to stopping: a probe whose every repeat failed leaves the family, so the final
per-test level can only be larger than counted from the probes that answered so far.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvfence.audit.checks.noninterference.probes import Tally
from kvfence.audit.stats import divergence_excess

__all__ = ["decided"]


def decided(alpha: float, alone: Tally, loaded: Tally, rounds_left: int) -> str | None:
    """Why the rest of the load phase cannot change the verdict, or None (keep going)."""
    if rounds_left <= 0 or alone.total == 0 or loaded.total == 0:
        return None
    answered = [i for i in alone.per_probe if loaded.per_probe.get(i, [0, 0])[0] > 0]
    strictest = alpha / (len(alone.per_probe) + 1)
    loosest = alpha / (len(answered) + 1)
    for label, base, load_d, load_n, left in _tests(alone, loaded, rounds_left):
        if load_n + left == 0:
            continue
        largest = divergence_excess(*base, load_d, load_n + left).p_value
        if largest < strictest:
            return f"{label} fails whatever the {rounds_left} remaining rounds give"
    for _, base, load_d, load_n, left in _tests(alone, loaded, rounds_left):
        if load_n + left == 0:
            continue
        smallest = divergence_excess(*base, load_d + left, load_n + left).p_value
        if smallest < loosest:
            return None
    return (
        f"no test could reach its level even if every one of the {rounds_left} remaining "
        "rounds diverged"
    )


def _tests(
    alone: Tally, loaded: Tally, rounds_left: int
) -> Iterator[tuple[str, tuple[int, int], int, int, int]]:
    """(label, (baseline diverged, baseline total), load diverged, load total, answers to come)
    for the pooled test and each probe's."""
    probes = sorted(i for i, (n, _) in alone.per_probe.items() if n > 0)
    pooled_left = rounds_left * len(probes)
    yield (
        "the pooled test",
        (alone.diverged, alone.total),
        loaded.diverged,
        loaded.total,
        pooled_left,
    )
    for i in probes:
        a_n, a_d = alone.per_probe[i]
        l_n, l_d = loaded.per_probe.get(i, [0, 0])
        yield f"probe {i}", (a_d, a_n), l_d, l_n, rounds_left
