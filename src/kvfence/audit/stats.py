"""The audit's statistics: pure functions over numbers, no I/O, no engine.

What each check needs and the error control it relies on:

* `ks_smaller` — one-sided two-sample Kolmogorov–Smirnov test that the first
  sample is *stochastically smaller* than the second (Gu et al., ICML 2025:
  prefix-cache hits answer faster). scipy's ``alternative`` names the CDF
  relation, not the value relation, which is easy to get backwards: samples
  that are smaller have a *larger* CDF, so "x smaller than y" is
  ``ks_2samp(x, y, alternative="greater")``.
* `SequentialKS` — a group-sequential version of that test. It looks at the
  data after every batch and stops as soon as the evidence is overwhelming,
  so a cache that leaks clearly is proven with tens of requests instead of the
  paper's fixed 250 + 250. Error control: the overall false-alarm rate is
  bounded by ``alpha`` through the union (Bonferroni) bound over the planned
  looks — look k rejects only when ``p_k < alpha / K`` where K is the number
  of looks the maximum budget allows. The bound holds whatever the
  dependence between looks (they share data), needs no asymptotics (each
  look uses the exact KS p-value for small samples) and is conservative.
  When the budget runs out without a rejection the result says how large a
  difference (KS distance) it could have seen, so a pass carries its power.
* `robust_line` — Theil–Sen fit of prefill time against prompt length, with a
  robust residual spread (scaled MAD). It tolerates ~29% gross outliers, so a
  few cache hits cannot drag the line down to meet them.
* `divergence_excess` — one-sided Fisher exact test that tenant B's output
  diverges more often under tenant A's load than alone (noninterference).
* `fast_excess` — the same one-sided exact test (hypergeometric tail, in exact
  integer arithmetic) that the long prompts are "too fast" more often than the
  reference prompts timed beside them (prefill latency, signal 3), with the
  smallest p-value the design can reach (`min_p_value`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
from scipy import stats as sps

# Scale that turns a median absolute deviation into a normal standard deviation.
MAD_TO_SIGMA = 1.482602218505602


@dataclass(frozen=True, slots=True)
class KSResult:
    """One-sided KS test of "x is stochastically smaller than y"."""

    statistic: float  # sup_t (F_x(t) - F_y(t)), in [0, 1]
    p_value: float
    n_x: int
    n_y: int


def ks_smaller(x: Sequence[float], y: Sequence[float]) -> KSResult:
    """Test H1 "values of x tend to be smaller than values of y" (one-sided KS).

    A small p-value means x's CDF lies above y's somewhere by more than chance
    allows, i.e. x is stochastically smaller. Both samples must be non-empty.
    """
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    if xa.size == 0 or ya.size == 0:
        raise ValueError("ks_smaller needs two non-empty samples")
    # F_x >= F_y everywhere under H0; "greater" is H1: F_x(t) > F_y(t) for some t.
    res = sps.ks_2samp(xa, ya, alternative="greater", method="auto")
    return KSResult(float(res.statistic), float(res.pvalue), int(xa.size), int(ya.size))


def ks_critical_distance(n_x: int, n_y: int, alpha: float) -> float:
    """Smallest one-sided KS distance detectable at level alpha (asymptotic).

    From P(D+ >= d) ~= exp(-2 d^2 n m / (n + m)) (Smirnov). Used to state the
    power of a test that did not reject: differences at least this large would
    have been seen.
    """
    if n_x <= 0 or n_y <= 0 or not 0 < alpha < 1:
        raise ValueError("need positive sample sizes and 0 < alpha < 1")
    return min(1.0, math.sqrt(-math.log(alpha) * (n_x + n_y) / (2.0 * n_x * n_y)))


@dataclass(frozen=True, slots=True)
class SequentialDesign:
    """A group-sequential one-sided KS design with Bonferroni alpha splitting.

    ``batch`` new samples per arm are taken before each look; at most
    ``max_per_arm`` per arm in total, so ``looks = ceil(max_per_arm / batch)``.
    Look k rejects H0 ("x is not smaller than y") when ``p_k < alpha / looks``;
    the family-wise false-alarm rate over all looks is then <= ``alpha``.
    """

    alpha: float = 1e-3
    batch: int = 8
    max_per_arm: int = 64
    min_per_arm: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.batch < 1 or self.max_per_arm < self.batch:
            raise ValueError("need batch >= 1 and max_per_arm >= batch")
        if not 1 <= self.min_per_arm <= self.max_per_arm:
            raise ValueError("need 1 <= min_per_arm <= max_per_arm")

    @property
    def looks(self) -> int:
        return math.ceil(self.max_per_arm / self.batch)

    @property
    def alpha_per_look(self) -> float:
        return self.alpha / self.looks


@dataclass(frozen=True, slots=True)
class Look:
    n_per_arm: int
    statistic: float
    p_value: float


@dataclass(frozen=True, slots=True)
class SequentialResult:
    """Outcome of a sequential test; ``rejected`` means "x is smaller than y"."""

    rejected: bool
    p_value: float  # the last look's p-value (unadjusted)
    threshold: float  # per-look rejection threshold (alpha / planned_looks)
    planned_looks: int
    n_x: int
    n_y: int
    looks: tuple[Look, ...]
    detectable_distance: float  # KS distance the final sample size could detect

    @property
    def requests(self) -> int:
        return self.n_x + self.n_y

    @property
    def adjusted_p_value(self) -> float:
        """Bonferroni-adjusted p-value of the stopping look (comparable with alpha)."""
        return min(1.0, self.p_value * self.planned_looks)


@dataclass(slots=True)
class SequentialKS:
    """Accumulates batches of (x, y) and stops at the first decisive look.

    Call `add` with each new batch (any sizes); `result` is set once the test
    has stopped, either because a look rejected or the budget is spent.
    """

    design: SequentialDesign
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    history: list[Look] = field(default_factory=list)
    result: SequentialResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    def add(self, x_batch: Sequence[float], y_batch: Sequence[float]) -> SequentialResult | None:
        if self.done:
            raise RuntimeError("sequential test already stopped")
        self.x.extend(float(v) for v in x_batch)
        self.y.extend(float(v) for v in y_batch)
        n = min(len(self.x), len(self.y))
        if n < self.design.min_per_arm:
            return None
        ks = ks_smaller(self.x, self.y)
        self.history.append(Look(n, ks.statistic, ks.p_value))
        budget_spent = n >= self.design.max_per_arm or len(self.history) >= self.design.looks
        rejected = ks.p_value < self.design.alpha_per_look
        if rejected or budget_spent:
            self.result = self._finish(rejected, ks)
        return self.result

    def finish(self) -> SequentialResult | None:
        """The result once the trials are spent: the last look's, or (lost samples kept a batch
        under ``min_per_arm``: a look short) a final look on what exists. None: an arm empty."""
        if self.result is not None:
            return self.result
        if not self.x or not self.y:
            return None
        ks = ks_smaller(self.x, self.y)
        self.history.append(Look(min(len(self.x), len(self.y)), ks.statistic, ks.p_value))
        self.result = self._finish(ks.p_value < self.design.alpha_per_look, ks)
        return self.result

    def _finish(self, rejected: bool, ks: KSResult) -> SequentialResult:
        return SequentialResult(
            rejected=rejected,
            p_value=ks.p_value,
            threshold=self.design.alpha_per_look,
            planned_looks=self.design.looks,
            n_x=ks.n_x,
            n_y=ks.n_y,
            looks=tuple(self.history),
            detectable_distance=ks_critical_distance(ks.n_x, ks.n_y, self.design.alpha_per_look),
        )


def run_sequential(
    draw: Callable[[int], tuple[Sequence[float], Sequence[float]]],
    design: SequentialDesign,
) -> SequentialResult:
    """Drive a `SequentialKS`: ``draw(k)`` returns k new samples per arm.

    Never draws more than ``design.max_per_arm`` per arm in total.
    """
    test = SequentialKS(design)
    taken = 0
    while True:
        k = min(design.batch, design.max_per_arm - taken)
        if taken < design.min_per_arm:
            k = max(k, design.min_per_arm - taken)
        xs, ys = draw(k)
        taken += k
        result = test.add(xs, ys)
        if result is not None:
            return result
        if taken >= design.max_per_arm:
            # Samples were lost (draw returned fewer than asked): decide on what exists.
            final = test.finish()
            if final is None:
                raise ValueError("run_sequential: draw returned no samples")
            return final


@dataclass(frozen=True, slots=True)
class LinearFit:
    """Robust straight line y = intercept + slope * x with its residual spread."""

    slope: float
    intercept: float
    slope_low: float  # confidence interval of the slope (Theil–Sen, 95%)
    slope_high: float
    residual_sigma: float  # 1.4826 * MAD of residuals: a robust standard deviation
    n: int

    def predict(self, x: float | Sequence[float]) -> np.ndarray:
        return self.intercept + self.slope * np.asarray(x, dtype=float)


def robust_line(x: Sequence[float], y: Sequence[float]) -> LinearFit:
    """Theil–Sen fit; needs at least two distinct x values."""
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    if xa.shape != ya.shape or xa.size < 3:
        raise ValueError("robust_line needs at least 3 paired points")
    if np.unique(xa).size < 2:
        raise ValueError("robust_line needs at least two distinct x values")
    res = sps.theilslopes(ya, xa, alpha=0.95, method="separate")
    slope = float(res.slope)
    intercept = float(res.intercept)
    residuals = ya - (intercept + slope * xa)
    mad = float(np.median(np.abs(residuals - np.median(residuals))))
    return LinearFit(
        slope=slope,
        intercept=intercept,
        slope_low=float(res.low_slope),
        slope_high=float(res.high_slope),
        residual_sigma=MAD_TO_SIGMA * mad,
        n=int(xa.size),
    )


def robust_sigma(values: Sequence[float]) -> float:
    """Scaled MAD: a standard deviation that a few outliers cannot inflate."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        raise ValueError("robust_sigma of an empty sample")
    return MAD_TO_SIGMA * float(np.median(np.abs(a - np.median(a))))


@dataclass(frozen=True, slots=True)
class DivergenceTest:
    """Baseline vs under-load divergence counts and the one-sided Fisher p-value."""

    baseline_diverged: int
    baseline_total: int
    load_diverged: int
    load_total: int
    p_value: float

    @property
    def baseline_rate(self) -> float:
        return self.baseline_diverged / self.baseline_total

    @property
    def load_rate(self) -> float:
        return self.load_diverged / self.load_total


def divergence_excess(
    baseline_diverged: int, baseline_total: int, load_diverged: int, load_total: int
) -> DivergenceTest:
    """One-sided Fisher exact test of H1 "divergence under load > baseline divergence".

    Exact for any counts, including a baseline of zero (a deterministic engine),
    where a handful of divergences under load is already significant.
    """
    for d, t in ((baseline_diverged, baseline_total), (load_diverged, load_total)):
        if t <= 0 or not 0 <= d <= t:
            raise ValueError(f"bad divergence count {d}/{t}")
    table = [
        [load_diverged, load_total - load_diverged],
        [baseline_diverged, baseline_total - baseline_diverged],
    ]
    # Odds ratio > 1 means the load row diverges more often: "greater".
    res = sps.fisher_exact(table, alternative="greater")
    return DivergenceTest(
        baseline_diverged, baseline_total, load_diverged, load_total, float(res.pvalue)
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; raises on empty input."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        raise ValueError("percentile of an empty sample")
    return float(np.percentile(a, q))


def hypergeom_upper_tail(k: int, total: int, marked: int, drawn: int) -> float:
    """P(X >= k) for X ~ Hypergeometric(total, marked, drawn), exactly (integer arithmetic).

    X is how many of the ``drawn`` items fall among the ``marked`` ones when
    ``drawn`` of ``total`` are chosen at random without replacement.
    """
    if not 0 <= marked <= total or not 0 <= drawn <= total:
        raise ValueError(f"bad hypergeometric sizes {total=} {marked=} {drawn=}")
    hits = sum(
        math.comb(marked, i) * math.comb(total - marked, drawn - i)
        for i in range(max(k, 0), min(marked, drawn) + 1)
    )
    return float(Fraction(hits, math.comb(total, drawn)))


@dataclass(frozen=True, slots=True)
class ExcessTest:
    """Long vs reference probes counted "fast", and the one-sided exact p-value."""

    long_fast: int
    long_total: int
    ref_fast: int
    ref_total: int
    p_value: float
    min_p_value: float  # the p-value of the most extreme table: every long probe fast, no ref

    def to_json(self) -> dict[str, float | int]:
        return {
            "long_fast": self.long_fast,
            "long_total": self.long_total,
            "reference_fast": self.ref_fast,
            "reference_total": self.ref_total,
            "p_value": self.p_value,
            "min_p_value": self.min_p_value,
        }


def fast_excess(long_fast: int, long_total: int, ref_fast: int, ref_total: int) -> ExcessTest:
    """One-sided Fisher exact test of H1 "long probes are fast more often than reference ones".

    Under H0 the "fast" labels are exchangeable between the two groups (the
    probes are interleaved in time, so load hits both alike); conditional on
    how many probes were fast in all, the number among the long ones is
    hypergeometric, and the p-value is its upper tail. Exact for any counts.
    """
    for f, t in ((long_fast, long_total), (ref_fast, ref_total)):
        if t <= 0 or not 0 <= f <= t:
            raise ValueError(f"bad fast count {f}/{t}")
    total, fast = long_total + ref_total, long_fast + ref_fast
    return ExcessTest(
        long_fast,
        long_total,
        ref_fast,
        ref_total,
        hypergeom_upper_tail(long_fast, total, fast, long_total),
        min_p_value(long_total, ref_total),
    )


def min_p_value(long_total: int, ref_total: int) -> float:
    """The smallest p-value `fast_excess` can return with these group sizes: 1 / C(N, n)."""
    return float(Fraction(1, math.comb(long_total + ref_total, long_total)))
