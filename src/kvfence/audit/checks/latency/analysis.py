"""Signal 3 as a hypothesis test: were the long prompts prefilled?

H0: "the long prompts were prefilled". Prefilling more tokens is more work,
so under H0 the long probes' times are stochastically no smaller than those
of the *neighbour* bucket (the longest shorter length) timed beside them:
the probes are interleaved in time, so load, GC pauses and noisy neighbours
hit both alike. Only this monotonicity is assumed — no straight line is
extrapolated: a cost curve that bends under load (batching makes it concave,
page and chunk boundaries make it steppy) would make a fitted line
over-predict the long prompts and page someone for nothing.

1. Buckets: short (the shortest length), neighbour, long (the longest).
2. Two labellings of "fast", each a symmetric function of the pooled long ∪
   neighbour sample (and of the short bucket, which is neither), so neither
   depends on which pooled probe is long: below the fixed floor
   ``median(short) + f · (q75(pooled) − median(short))`` (a probe that
   skipped a fraction f of the extra cost: sees a skip of only some long
   prompts), and below the pooled median (Mood's median test: sits in the
   gap a skipped prefill opens wherever the placeholder's own cost puts it).
3. Conditional on how many pooled probes are fast, the number among the long
   ones is hypergeometric when the labels are exchangeable, and stochastically
   smaller under H0's ordering; the one-sided exact (Fisher) p-value is its
   upper tail (`stats.fast_excess`); p = 2 × the smaller of the two
   (Bonferroni). The median labelling counts only when the long prompts'
   median lies below the neighbours' by at least a quarter of their extra
   cost over a short prompt (material: a kernel shape that makes 512 tokens
   a little faster than 215 is no leak).
   A skipped prefill (a cross-tenant cache hit, a 1-token placeholder) makes
   every long probe fast and no neighbour.
4. FAIL when p < alpha *and*
   the physics is measurable: the Theil–Sen slope over all shorter probes is
   > 0 — with ``strict_physics`` (the guard) its lower 95% bound is — and
   the same exact test, run on this sweep with the long probes' times
   replaced by the short probes' (a total skip), fails at alpha
   (`skip_test`), with a margin: this sweep, with its sizes and its noise,
   would have seen a skip, and a placeholder that costs less than the
   neighbours by much of their extra cost. A bar on single probes' spread (the extra cost against k times
   the short bucket's σ) asks the wrong question both ways: under load it
   refuses sweeps whose buckets separate plainly, and with a long-tailed
   noise it vouches for sweeps that would pass a skip. FAIL ⊂ {p < alpha},
   so the false-alarm rate is ≤ alpha.
   INCONCLUSIVE when the physics is not measurable, or when even the most
   extreme outcome (every long probe fast, no neighbour) could not reach
   alpha — the summary says how many probes would. PASS when, besides, the
   long prompts' own times are told apart from the short prompts' at alpha x
   ``skip_margin`` (`paid_test`), else INCONCLUSIVE: skipped, the long
   prompts are drawn like the short ones, so a total skip passes with about
   that chance at most, whatever the noise (the skip test answers with the
   short prompts' draw, and a skip's own draw can land among the neighbours
   where theirs did not). The skip test's margin stays: it is what sees a
   placeholder that costs something of its own (the incident's reject path
   reads its 4,095 tokens; with the skip test at alpha alone it passed at
   --alpha 1e-6 under load). Every verdict carries the p-value, the alpha
   and the requests it took.

The Theil–Sen fit over the shorter probes is drawn in the plot and reported;
it decides nothing but the strict physics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvfence.audit.base import DEFAULT_ALPHA, JSONValue, Plot, PlotSeries, Verdict
from kvfence.audit.checks.latency.config import LatencyConfig
from kvfence.audit.checks.latency.exact import (
    Buckets,
    Floor,
    LatencySample,
    Test,
    TimingKind,
    buckets,
    design_p_value,
    exact_test,
)
from kvfence.audit.checks.latency.skip import paid_test, skip_test
from kvfence.audit.stats import (
    ExcessTest,
    LinearFit,
    percentile,
    robust_line,
    robust_sigma,
)


@dataclass(slots=True)
class LatencyAnalysis:
    """The outcome of the analysis: verdict, summary, evidence and plot data."""

    verdict: Verdict
    summary: str
    evidence: dict[str, JSONValue] = field(default_factory=dict)
    plot: Plot | None = None
    fit: LinearFit | None = None
    flagged: list[LatencySample] = field(default_factory=list)
    p_value: float | None = None
    alpha: float = DEFAULT_ALPHA


def _inconclusive(why: str, evidence: dict[str, JSONValue], alpha: float) -> LatencyAnalysis:
    return LatencyAnalysis(Verdict.INCONCLUSIVE, why, {**evidence, "alpha": alpha}, alpha=alpha)


def analyse(
    samples: Sequence[LatencySample], config: LatencyConfig | None = None
) -> LatencyAnalysis:
    """Test H0 "the long prompts were prefilled" (module docstring) on timed fresh prompts."""
    cfg = config or LatencyConfig()
    alpha = cfg.alpha if cfg.alpha is not None else DEFAULT_ALPHA
    if len(samples) < cfg.min_samples:
        why = f"only {len(samples)} timed requests (need {cfg.min_samples})"
        return _inconclusive(why, {"samples": len(samples)}, alpha)
    b = buckets(samples)
    ref_lengths = {s.prompt_tokens for s in b.reference}
    if len(ref_lengths) < 2 or len(b.reference) < 3 or not b.long or not b.neighbour:
        why = "need at least two shorter prompt lengths and a long bucket to compare"
        return _inconclusive(why, {"samples": len(samples), "lengths": len(ref_lengths)}, alpha)
    fit = robust_line([s.prompt_tokens for s in b.reference], [s.seconds for s in b.reference])
    short_t, pooled = [s.seconds for s in b.short], [s.seconds for s in b.long + b.neighbour]
    floor = Floor(
        float(np.median(short_t)),
        max(robust_sigma(short_t), cfg.noise_floor_s),
        percentile(pooled, 75.0),
        float(np.median(pooled)),
        cfg.skipped_fraction,
    )
    test = exact_test(b, floor, cfg.material_fraction)
    flagged = [s for s in b.long if s.seconds < test.threshold]
    evidence = _evidence(samples, b, fit, floor, test, flagged, cfg, alpha)
    result = _judge(b, fit, floor, test, cfg, alpha, evidence)
    result.plot, result.fit, result.flagged = _plot(samples, fit, flagged), fit, flagged
    return result


def _measurable(fit: LinearFit, cfg: LatencyConfig, skip: Test | None, alpha: float) -> bool:
    """A skipped prefill would be visible: this very sweep would have failed a skip
    (`skip_test`) with a margin, and the cost grows with the length."""
    slope = fit.slope_low if cfg.strict_physics else fit.slope  # the guard: the lower bound
    if slope <= 0 or skip is None:
        return False
    # At a strict alpha even buckets that do not overlap at all cannot reach alpha x margin:
    # a skip, drawn like the short prompts, then lands under every neighbour all the same.
    apart = skip.excess.ref_fast == 0 and skip.excess.long_fast == skip.excess.long_total
    return skip.p_value < alpha and (skip.p_value < alpha * cfg.skip_margin or apart)


def _paid(b: Buckets, cfg: LatencyConfig, alpha: float, evidence: dict[str, JSONValue]) -> bool:
    """The long prompts' own times separate from the short prompts' at alpha x
    ``skip_margin`` (`paid_test`): a pass needs it, a fail does not (a skip makes them
    alike)."""
    paid = paid_test(b, cfg.skipped_fraction, cfg.material_fraction, cfg.noise_floor_s)
    evidence["paid_p_value"] = None if paid is None else paid.p_value
    if paid is None:
        return False
    # At a strict alpha even buckets that do not overlap at all cannot reach the bar; two
    # draws of one distribution (a skip) come apart that completely only by 1 / C(2n, n).
    apart = paid.excess.ref_fast == 0 and paid.excess.long_fast == paid.excess.long_total
    return paid.p_value < alpha * cfg.skip_margin or (paid.p_value < alpha and apart)


def _judge(
    b: Buckets,
    fit: LinearFit,
    floor: Floor,
    test: Test,
    cfg: LatencyConfig,
    alpha: float,
    evidence: dict[str, JSONValue],
) -> LatencyAnalysis:
    excess = test.excess
    counts = _counts(b, test)
    n = excess.long_total + excess.ref_total
    stat = f"p = {test.p_value:.2g}, alpha {alpha:.2g}, {n} requests compared"
    skip = skip_test(b, cfg.skipped_fraction, cfg.material_fraction, cfg.noise_floor_s)
    evidence["skip_visible_p_value"] = None if skip is None else skip.p_value
    bar = alpha * cfg.skip_margin
    if test.min_p_value >= alpha:  # no outcome of this design could fail: say what would
        need = _probes_needed(excess, alpha, cfg.slack)
        verdict, summary = (
            Verdict.INCONCLUSIVE,
            (
                f"too few probes to reach alpha {alpha:.2g}: even every long probe fast would give "
                f"p = {test.min_p_value:.2g}; {need}; {counts}"
            ),
        )
    elif not _measurable(fit, cfg, skip, alpha):
        verdict, summary = (
            Verdict.INCONCLUSIVE,
            f"{_unmeasurable(floor, skip, bar)}; {counts} ({stat})",
        )
    elif test.p_value < alpha:
        verdict, summary = Verdict.FAIL, f"long prompts answered too fast: {counts} ({stat})"
    elif not _paid(b, cfg, alpha, evidence):
        paid = evidence["paid_p_value"]
        shown = "no test" if paid is None else f"p = {paid:.2g}"
        verdict, summary = (
            Verdict.INCONCLUSIVE,
            (
                f"the long prompts' own times are not told apart from the short prompts' "
                f"({shown}, need < {bar:.2g}): neither a prefill nor a skip; {counts} ({stat})"
            ),
        )
    else:
        verdict, summary = Verdict.PASS, f"long prompts pay their prefill: {counts} ({stat})"
    return LatencyAnalysis(verdict, summary, evidence, p_value=test.p_value, alpha=alpha)


def _counts(b: Buckets, test: Test) -> str:
    excess = test.excess
    long_len = float(np.median([s.prompt_tokens for s in b.long]))
    mid_len = float(np.median([s.prompt_tokens for s in b.neighbour]))
    return (
        f"{excess.long_fast} of {excess.long_total} long ({long_len:.0f}-token) probes under "
        f"the {test.name} {test.threshold * 1e3:.2f} ms vs {excess.ref_fast} of {excess.ref_total} "
        f"{mid_len:.0f}-token ones"
    )


def _unmeasurable(floor: Floor, skip: Test | None, bar: float) -> str:
    shown = "no test" if skip is None else f"p = {skip.p_value:.2g}"
    return (
        f"prefill cost not measurable above noise: the costlier prompts pay only "
        f"{floor.increment * 1e3:.3f} ms over {floor.short_median * 1e3:.2f} ms "
        f"(noise σ {floor.sigma * 1e3:.3f} ms), so this sweep would not have failed a "
        f"skipped prefill (short prompts' times as the long ones': {shown}, need < {bar:.2g})"
    )


def _probes_needed(excess: ExcessTest, alpha: float, slack: int) -> str:
    for n in range(max(excess.long_total, excess.ref_total) + 1, 1001):
        if 2 * design_p_value(n, n, slack) < alpha:
            return f"{n} long and {n} neighbour probes would"
    return "more than 1000 long probes would be needed"


def _evidence(
    samples: Sequence[LatencySample],
    b: Buckets,
    fit: LinearFit,
    floor: Floor,
    test: Test,
    flagged: list[LatencySample],
    cfg: LatencyConfig,
    alpha: float,
) -> dict[str, JSONValue]:
    return {
        "samples": len(samples),
        "timing": dict(Counter(s.kind for s in samples)),
        "fit": {
            "slope_s_per_token": fit.slope,
            "intercept_s": fit.intercept,
            "slope_95ci": [fit.slope_low, fit.slope_high],
            "residual_sigma_s": fit.residual_sigma,
            "fitted_on": len(b.reference),
        },
        **_buckets_json(b, floor, cfg),
        "predicted_prefill_increment_s": floor.increment,
        "alarm_threshold_s": test.threshold,
        "test": {
            "decided_by": test.name,
            **test.tables,
            "p_value": test.p_value,
            "alpha": alpha,
            "h0": "the long prompts were prefilled: no faster than the neighbour bucket",
            "method": "one-sided exact hypergeometric (Fisher) tests, long vs neighbour, "
            "labelled by the fixed floor and by the pooled median; Bonferroni x 2",
        },
        "p_value": test.p_value,
        "alpha": alpha,
        "flagged": [
            {"prompt_tokens": s.prompt_tokens, "seconds": s.seconds, "source": s.source}
            for s in flagged[:50]
        ],
        "flagged_count": len(flagged),
    }


def _buckets_json(b: Buckets, floor: Floor, cfg: LatencyConfig) -> dict[str, JSONValue]:
    def tokens(bucket: list[LatencySample]) -> float:
        return float(np.median([s.prompt_tokens for s in bucket]))

    long_t = [s.seconds for s in b.long]
    return {
        "short_bucket": {
            "tokens": tokens(b.short),
            "n": len(b.short),
            "median_s": floor.short_median,
            "noise_sigma_s": floor.sigma,
        },
        "neighbour_bucket": {
            "tokens": tokens(b.neighbour),
            "n": len(b.neighbour),
            "median_s": float(np.median([s.seconds for s in b.neighbour])),
        },
        "long_bucket": {
            "tokens": tokens(b.long),
            "n": len(b.long),
            f"p{cfg.long_quantile:g}_s": percentile(long_t, cfg.long_quantile),
            "median_s": float(np.median(long_t)),
        },
    }


def _plot(samples: Sequence[LatencySample], fit: LinearFit, flagged: list[LatencySample]) -> Plot:
    flagged_ids = {id(s) for s in flagged}
    xs = [float(s.prompt_tokens) for s in samples]
    lo, hi = min(xs), max(xs)
    return Plot(
        kind="xy",
        title="TTFT vs prompt length",
        x_label="prompt tokens",
        y_label="seconds",
        series=[
            PlotSeries(
                "requests",
                x=xs,
                y=[s.seconds for s in samples],
                style="points",
                flags=[id(s) in flagged_ids for s in samples],
                labels=[s.source for s in samples],
            ),
            PlotSeries(
                "prefill fit",
                x=[lo, hi],
                y=[float(fit.predict(lo)), float(fit.predict(hi))],
                style="line",
            ),
        ],
        note="fit on all but the longest bucket (Theil–Sen); red: long prompts under the floor",
    )


__all__ = [
    "LatencyAnalysis",
    "LatencyConfig",
    "LatencySample",
    "TimingKind",
    "analyse",
    "buckets",
    "design_p_value",
    "skip_test",
]
