"""The audit's statistics on seeded synthetic data: direction, error rates, robustness."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvfence.audit.stats import (
    SequentialDesign,
    SequentialKS,
    divergence_excess,
    ks_critical_distance,
    ks_smaller,
    robust_line,
    robust_sigma,
    run_sequential,
)


def _lognormal(rng: np.random.Generator, n: int, median: float) -> np.ndarray:
    return np.asarray(median * np.exp(rng.normal(0.0, 0.15, n)))


# -- one-sided KS direction -----------------------------------------------------


def test_ks_smaller_detects_the_faster_sample_and_only_that_one() -> None:
    rng = np.random.default_rng(1)
    hits = _lognormal(rng, 30, 0.010)  # cache hits: faster
    misses = _lognormal(rng, 30, 0.020)
    assert ks_smaller(hits, misses).p_value < 1e-6
    # The opposite direction must find nothing: hits are not slower than misses.
    assert ks_smaller(misses, hits).p_value > 0.5


def test_ks_smaller_statistic_is_cdf_gap_of_first_sample() -> None:
    res = ks_smaller([1.0, 2.0, 3.0], [10.0, 11.0, 12.0])
    assert res.statistic == pytest.approx(1.0)
    assert (res.n_x, res.n_y) == (3, 3)
    # Complete separation of 3 vs 3 has exact one-sided p = 1 / C(6, 3).
    assert res.p_value == pytest.approx(1 / 20)
    assert ks_smaller([10.0, 11.0, 12.0], [1.0, 2.0, 3.0]).statistic == pytest.approx(0.0)


def test_ks_smaller_rejects_empty_samples() -> None:
    with pytest.raises(ValueError):
        ks_smaller([], [1.0])


def test_critical_distance_shrinks_with_samples_and_alpha() -> None:
    d_small = ks_critical_distance(10, 10, 1e-3)
    d_big = ks_critical_distance(100, 100, 1e-3)
    assert 0 < d_big < d_small <= 1
    assert ks_critical_distance(100, 100, 1e-2) < d_big


# -- sequential design ------------------------------------------------------------


def _null_draw(rng: np.random.Generator):
    def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
        return _lognormal(rng, k, 0.02), _lognormal(rng, k, 0.02)

    return draw


def test_sequential_false_alarm_rate_is_bounded_by_alpha_under_the_null() -> None:
    # alpha is large here only so that the rate is measurable with 600 replicates.
    design = SequentialDesign(alpha=0.05, batch=8, max_per_arm=48)
    rng = np.random.default_rng(2024)
    replicates = 600
    alarms = sum(run_sequential(_null_draw(rng), design).rejected for _ in range(replicates))
    rate = alarms / replicates
    # Bonferroni over 6 looks is conservative: the rate must not exceed alpha
    # (plus three binomial standard errors of slack).
    assert rate <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / replicates)


def test_uncorrected_repeated_looks_would_inflate_the_false_alarm_rate() -> None:
    # The reason for the correction: testing every look at the full alpha alarms
    # more often than alpha. Shown on the same seeded null data.
    rng = np.random.default_rng(2024)
    replicates = 600
    naive = 0
    corrected = 0
    for _ in range(replicates):
        x = _lognormal(rng, 48, 0.02)
        y = _lognormal(rng, 48, 0.02)
        ps = [ks_smaller(x[:n], y[:n]).p_value for n in range(8, 49, 8)]
        naive += any(p < 0.05 for p in ps)
        corrected += any(p < 0.05 / len(ps) for p in ps)
    assert naive / replicates > 0.05
    assert corrected / replicates <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / replicates)


def test_sequential_stops_early_on_a_clear_cache_hit_signal() -> None:
    design = SequentialDesign(alpha=1e-6, batch=8, max_per_arm=250)
    rng = np.random.default_rng(7)

    def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
        return _lognormal(rng, k, 0.005), _lognormal(rng, k, 0.020)

    res = run_sequential(draw, design)
    assert res.rejected
    assert res.p_value < design.alpha_per_look
    # Far fewer than Gu et al.'s fixed 250 + 250 requests.
    assert res.requests <= 64
    assert res.looks[-1].n_per_arm == res.n_x


def test_sequential_runs_to_budget_without_signal_and_states_its_power() -> None:
    design = SequentialDesign(alpha=1e-3, batch=16, max_per_arm=64)
    res = run_sequential(_null_draw(np.random.default_rng(3)), design)
    assert not res.rejected
    assert res.n_x == res.n_y == 64
    assert len(res.looks) == design.looks == 4
    assert 0 < res.detectable_distance < 1
    assert res.adjusted_p_value == pytest.approx(min(1.0, res.p_value * 4))


def test_sequential_detects_a_partial_leak_within_the_budget() -> None:
    # Only 60% of shared-prefix requests hit the cache: still caught.
    design = SequentialDesign(alpha=1e-3, batch=16, max_per_arm=128)
    rng = np.random.default_rng(11)

    def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
        hit = rng.random(k) < 0.6
        x = np.where(hit, _lognormal(rng, k, 0.008), _lognormal(rng, k, 0.02))
        return x, _lognormal(rng, k, 0.02)

    assert run_sequential(draw, design).rejected


def test_sequential_add_refuses_after_stop_and_waits_for_min_samples() -> None:
    test = SequentialKS(SequentialDesign(alpha=0.01, batch=4, max_per_arm=8, min_per_arm=4))
    assert test.add([1.0, 2.0], [3.0, 4.0]) is None
    assert test.history == []
    test.add([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 10.0, 11.0, 12.0])
    assert test.done
    with pytest.raises(RuntimeError):
        test.add([1.0], [2.0])


def test_sequential_finish_decides_when_a_lost_sample_skipped_a_look() -> None:
    """One failed trial in the first batch (7 < min_per_arm: no look) left the test one look
    short of its plan, so a run that spent its whole budget had no result (inconclusive: real
    vLLM at --alpha 1e-9, one salted run in five). `finish` decides on what exists."""
    test = SequentialKS(SequentialDesign(alpha=1e-3, batch=8, max_per_arm=24))
    rng = np.random.default_rng(0)
    assert test.add(rng.normal(1, 0.1, 7), rng.normal(1, 0.1, 7)) is None  # no look yet
    assert test.add(rng.normal(1, 0.1, 8), rng.normal(1, 0.1, 8)) is None
    assert test.add(rng.normal(1, 0.1, 8), rng.normal(1, 0.1, 8)) is None  # budget spent
    final = test.finish()
    assert final is not None and not final.rejected and final.n_x == 23
    assert len(final.looks) <= final.planned_looks and test.finish() is final
    # A real difference is still found on what exists.
    leak = SequentialKS(SequentialDesign(alpha=1e-3, batch=8, max_per_arm=16))
    leak.add([0.5] * 7, [1.0] * 7)
    result = leak.finish()
    assert result is not None and result.rejected
    assert SequentialKS(SequentialDesign()).finish() is None  # nothing to decide on


def test_design_validation() -> None:
    with pytest.raises(ValueError):
        SequentialDesign(alpha=0.0)
    with pytest.raises(ValueError):
        SequentialDesign(batch=10, max_per_arm=5)
    assert SequentialDesign(alpha=0.01, batch=10, max_per_arm=95).looks == 10


# -- robust fit -------------------------------------------------------------------


def test_robust_line_recovers_prefill_cost_despite_cache_hit_outliers() -> None:
    rng = np.random.default_rng(5)
    x = np.repeat([64, 128, 256, 512, 1024, 2048], 8).astype(float)
    y = 0.003 + 2e-5 * x + rng.normal(0, 2e-4, x.size)
    # A quarter of the requests answered as if the prompt were 1 token long.
    hit = rng.random(x.size) < 0.25
    y = np.where(hit, 0.003 + rng.normal(0, 2e-4, x.size), y)
    fit = robust_line(x, y)
    assert fit.slope == pytest.approx(2e-5, rel=0.15)
    assert fit.slope_low <= fit.slope <= fit.slope_high
    # Ordinary least squares is dragged well below the true slope by the same hits.
    ols_slope = np.polyfit(x, y, 1)[0]
    assert ols_slope < 0.9 * 2e-5 < fit.slope
    assert float(fit.predict(1000.0)) == pytest.approx(fit.intercept + fit.slope * 1000.0)


def test_robust_line_and_sigma_validation() -> None:
    with pytest.raises(ValueError):
        robust_line([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        robust_line([1.0, 2.0], [1.0, 2.0])
    assert robust_sigma([1.0, 1.0, 1.0, 100.0]) == 0.0
    assert robust_sigma(np.random.default_rng(0).normal(0, 2.0, 4000)) == pytest.approx(
        2.0, rel=0.1
    )


# -- divergence significance -------------------------------------------------------


def test_divergence_excess_direction_and_zero_baseline() -> None:
    # A deterministic engine (0 of 40 alone) that diverges 6 of 40 times under load.
    res = divergence_excess(0, 40, 6, 40)
    assert res.p_value < 0.05
    assert (res.baseline_rate, res.load_rate) == (0.0, 0.15)
    # Less divergence under load than alone is never evidence of interference.
    assert divergence_excess(6, 40, 0, 40).p_value == pytest.approx(1.0)
    # Equal noisy rates are not significant.
    assert divergence_excess(5, 40, 5, 40).p_value > 0.4


def test_divergence_excess_false_alarm_rate_under_equal_noise() -> None:
    rng = np.random.default_rng(9)
    alarms = 0
    for _ in range(500):
        base = int(rng.binomial(30, 0.1))
        load = int(rng.binomial(30, 0.1))
        alarms += divergence_excess(base, 30, load, 30).p_value < 0.05
    assert alarms / 500 <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 500)


def test_divergence_excess_validation() -> None:
    with pytest.raises(ValueError):
        divergence_excess(3, 2, 0, 1)
    with pytest.raises(ValueError):
        divergence_excess(0, 0, 0, 1)


def test_hypergeometric_tail_matches_scipy_and_brute_force() -> None:
    from itertools import combinations

    from scipy.stats import hypergeom

    from kvfence.audit.stats import hypergeom_upper_tail

    for total, marked, drawn in ((10, 4, 5), (24, 9, 8), (48, 16, 16), (7, 0, 3), (7, 7, 3)):
        for k in range(0, drawn + 2):
            want = float(hypergeom.sf(k - 1, total, marked, drawn))
            assert hypergeom_upper_tail(k, total, marked, drawn) == pytest.approx(want, rel=1e-9)
    # Brute force: every way to draw 4 of 9 items of which the first 4 are marked.
    draws = list(combinations(range(9), 4))
    for k in range(6):
        share = sum(sum(i < 4 for i in d) >= k for d in draws) / len(draws)
        assert hypergeom_upper_tail(k, 9, 4, 4) == pytest.approx(share, rel=1e-12)
    # Exact where floating point is not: 1 / C(64, 32) ~ 5.5e-19.
    assert hypergeom_upper_tail(32, 64, 32, 32) == pytest.approx(1 / math.comb(64, 32))


def test_fast_excess_is_fishers_one_sided_test() -> None:
    from scipy.stats import fisher_exact

    from kvfence.audit.stats import fast_excess, min_p_value

    for lf, lt, rf, rt in ((9, 9, 0, 9), (5, 8, 2, 8), (0, 8, 6, 8), (3, 16, 1, 16)):
        res = fast_excess(lf, lt, rf, rt)
        want = fisher_exact([[lf, lt - lf], [rf, rt - rf]], alternative="greater").pvalue
        assert res.p_value == pytest.approx(float(want), rel=1e-9)
        assert res.min_p_value == min_p_value(lt, rt) == pytest.approx(1 / math.comb(lt + rt, lt))
    with pytest.raises(ValueError):
        fast_excess(3, 2, 0, 4)
