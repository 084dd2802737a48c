"""The pieces of the prefill-latency test (`analysis` has the argument): timed
samples, their buckets, the two "fast" labellings and the exact test that combines them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvfence.audit.base import JSONValue
from kvfence.audit.stats import ExcessTest, fast_excess, hypergeom_upper_tail

TimingKind = Literal["prefill", "ttft", "e2e"]


@dataclass(frozen=True, slots=True)
class LatencySample:
    """One timed request: prompt length in tokens and seconds until prefill ended."""

    prompt_tokens: int
    seconds: float
    kind: TimingKind = "ttft"
    source: str = ""  # "line 12", "probe 7": where a flagged point came from


def design_p_value(n_long: int, n_neighbour: int, slack: int) -> float:
    """The p-value when a skip is total but ``slack`` probes go the wrong way.

    "Fast" is below the pooled median, so about half of the pooled probes are
    fast: a total skip puts every long probe below it; ``slack`` long probes
    slowed past it by load swap places with as many neighbours. A design is
    big enough for alpha when this is below it.
    """
    total = n_long + n_neighbour
    return hypergeom_upper_tail(max(n_long - slack, 0), total, total // 2, n_long)


@dataclass(frozen=True, slots=True)
class Buckets:
    """Short, neighbour and long probes (module docstring), and everything but the long."""

    short: list[LatencySample]
    neighbour: list[LatencySample]
    long: list[LatencySample]
    reference: list[LatencySample]


def buckets(samples: Sequence[LatencySample]) -> Buckets:
    """Split a sweep (few distinct lengths) by exact length: short = the shortest,
    neighbour = the second longest, long = the longest. A log (many lengths)
    uses quantiles of length: short = bottom fifth, neighbour = [p60, p85) —
    a gap below the long bucket, so a skipped prompt just under p90 does not
    land among the neighbours — long = top decile."""
    lengths = sorted({s.prompt_tokens for s in samples})
    if len(lengths) <= 12:
        lo, mid, hi = lengths[0], lengths[-2] if len(lengths) > 1 else lengths[0], lengths[-1]
        short = [s for s in samples if s.prompt_tokens == lo]
        neighbour = [s for s in samples if s.prompt_tokens == mid and mid != hi]
        long = [s for s in samples if s.prompt_tokens == hi]
    else:
        arr = np.array([s.prompt_tokens for s in samples], dtype=float)
        q20, q60, q85, q90 = (float(np.percentile(arr, q)) for q in (20, 60, 85, 90))
        short = [s for s in samples if s.prompt_tokens <= q20]
        neighbour = [s for s in samples if q60 <= s.prompt_tokens < q85]
        long = [s for s in samples if s.prompt_tokens >= q90]
    long_ids = {id(s) for s in long}
    return Buckets(short, neighbour, long, [s for s in samples if id(s) not in long_ids])


@dataclass(frozen=True, slots=True)
class Floor:
    """Where "fast" starts (the pooled median) and the numbers the verdict weighs."""

    short_median: float
    sigma: float  # the short bucket's robust spread: the noise
    upper: float  # q75 of long ∪ neighbour: what the costlier bucket pays
    split: float  # median of long ∪ neighbour: "fast" is below it
    skipped_fraction: float

    @property
    def increment(self) -> float:
        return self.upper - self.short_median

    @property
    def cut(self) -> float:
        """The fixed floor: a fraction f of the costlier buckets' extra cost skipped."""
        return self.short_median + self.skipped_fraction * self.increment

    def material(self, long_median: float, neighbour_median: float, fraction: float) -> bool:
        """The long prompts come in at least ``fraction`` of the neighbours' extra cost (over
        a short prompt) below the neighbours: a 4x longer prompt that costs that much less
        than its neighbour did not do its work."""
        extra = neighbour_median - self.short_median
        return long_median < neighbour_median - fraction * extra


@dataclass(frozen=True, slots=True)
class Test:
    """The two exact tests, Bonferroni-combined; ``excess`` is the decisive one's table."""

    name: str  # "floor" or "median"
    threshold: float
    excess: ExcessTest
    p_value: float  # 2 x the smaller p (the median test counts only when material)
    tables: dict[str, JSONValue]

    @property
    def min_p_value(self) -> float:
        return min(1.0, 2 * self.excess.min_p_value)


def exact_test(b: Buckets, floor: Floor, material_fraction: float) -> Test:
    """Label by the fixed floor (sees a partial skip of some long prompts) and by the pooled
    median (sees a placeholder that costs something of its own); H0 holds for both."""

    def table(c: float) -> ExcessTest:
        long_fast = sum(s.seconds < c for s in b.long)
        ref_fast = sum(s.seconds < c for s in b.neighbour)
        return fast_excess(long_fast, len(b.long), ref_fast, len(b.neighbour))

    by_floor, by_median = table(floor.cut), table(floor.split)
    material = floor.material(median_of(b.long), median_of(b.neighbour), material_fraction)
    tables: dict[str, JSONValue] = {
        "floor": {**by_floor.to_json(), "threshold_s": floor.cut},
        "median": {**by_median.to_json(), "threshold_s": floor.split, "material": material},
    }
    if material and by_median.p_value < by_floor.p_value:
        return Test("median", floor.split, by_median, min(1.0, 2 * by_median.p_value), tables)
    return Test("floor", floor.cut, by_floor, min(1.0, 2 * by_floor.p_value), tables)


def median_of(bucket: list[LatencySample]) -> float:
    return float(np.median([s.seconds for s in bucket]))
